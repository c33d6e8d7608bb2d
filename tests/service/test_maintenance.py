"""`maintenance`: RQ's registry maintenance under a lease that dies with its holder, and abandoned jobs
that had written their result ended `finished` instead of failed or run again (real Redis, real RQ)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from rq import Queue, Retry
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from mlxq.jobs import keys
from mlxq.jobs.schema import ScoreResult
from mlxq.worker.job_results import JobResults
from mlxq.worker.job_runs import Run
from mlxq.worker.maintenance import Lease
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.stream_writer import StreamOptions

REDIS_DB = 12
ROW = {"rows": [{"prompt": "a", "candidates": ["b"]}]}
RESULT = ScoreResult.model_validate(
    {
        "rows": [{"logits": [2.0], "logprobs": [0.0], "input_tokens": 1, "cached_tokens": 0}],
        "input_tokens": 1,
        "cached_tokens": 0,
    }
)


def _events(conn: redis.Redis, job_id: str) -> list[str]:
    return [f[b"event"].decode() for _, f in conn.xrange(keys.stream_key(job_id))]


def _start(dead: MlxqWorker, q: Queue, **enqueue: Any) -> Run:
    """A job started by `dead` (as its batch starts one: off the intermediate list, `started`)."""
    job = q.enqueue_call(keys.SCORE_FUNC, args=(ROW,), **enqueue)
    q.connection.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    (run,) = dead.start([job], q)
    return run


def _abandon(conn: redis.Redis, q: Queue) -> None:
    """Every execution in the started registry expired, as when its worker stopped beating."""
    registry = q.started_job_registry.key
    conn.zadd(registry, dict.fromkeys(conn.zrange(registry, 0, -1), 1))


def test_a_lease_is_short_renewed_while_held_and_freed_only_by_its_holder(redis_conn: redis.Redis) -> None:
    key = "rq:clean_registries:leases"
    held = Lease(redis_conn, key, 2, "holder")
    other = Lease(redis_conn, key, 2, "other")
    assert held.acquire()
    assert 0 < redis_conn.ttl(key) <= 2 and redis_conn.get(key) == held.token.encode()
    assert not other.acquire()
    other.release()  # not its lease: nothing happens
    assert redis_conn.get(key) == held.token.encode()
    time.sleep(3)  # past its TTL: renewed by its thread while held
    assert redis_conn.get(key) == held.token.encode() and not held.lost
    held.release()
    assert not redis_conn.exists(key)
    assert other.acquire()
    other._stop.set()  # its holder dies: nobody renews it, and Redis drops it within its TTL
    other._thread.join()  # type: ignore[union-attr]
    assert 0 < redis_conn.ttl(key) <= 2


def test_a_worker_holds_the_maintenance_lock_for_a_heartbeat_ttl_not_fifteen_minutes(
    redis_conn: redis.Redis,
) -> None:
    q = Queue("locks", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), heartbeat_s=2.0)
    seen: list[int] = []
    w.maintenance.clean = lambda queue, handlers: seen.append(redis_conn.ttl(queue.registry_cleaning_key))  # type: ignore[method-assign]
    w.clean_registries()
    assert len(seen) == 1 and 0 < seen[0] <= w.get_heartbeat_ttl(None) == 11
    assert not redis_conn.exists(q.registry_cleaning_key)  # given back
    redis_conn.set(q.registry_cleaning_key, "someone else", ex=30)
    w.clean_registries()  # held by another worker: this one skips the queue
    assert len(seen) == 1 and redis_conn.get(q.registry_cleaning_key) == b"someone else"


def test_an_idle_worker_wakes_for_maintenance_on_time(redis_conn: redis.Redis) -> None:
    """RQ blocks an idle worker on its queues for `worker_ttl - 15` s, and looks at maintenance only
    between two waits."""
    w = MlxqWorker(["idle"], connection=redis_conn, stream_options=StreamOptions(), maintenance_interval=15)
    assert w.dequeue_timeout == 15 < w.worker_ttl - 15
    short = MlxqWorker(
        ["idle"], connection=redis_conn, stream_options=StreamOptions(), worker_ttl=20, maintenance_interval=9
    )
    assert short.dequeue_timeout == 5


def test_an_abandoned_job_that_wrote_its_result_ends_finished_the_others_as_rq_ends_them(
    redis_conn: redis.Redis,
) -> None:
    """A worker killed between a job's result/`done` write and RQ's end of it: the next maintenance
    ends the job `finished` with that result, even with retries left (it is not run again, its stream
    keeps its one `done`). Abandoned jobs that wrote nothing are retried or failed, as RQ does."""
    q = Queue("abandoned", connection=redis_conn, serializer=JSONSerializer)
    dead = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), name="dead")
    dead.register_birth()
    options = StreamOptions()
    wrote = _start(dead, q, retry=Retry(max=2))
    JobResults(redis_conn, options).finish_scores([(wrote.job, RESULT)])
    retried = _start(dead, q, retry=Retry(max=1))
    failed = _start(dead, q)
    _abandon(redis_conn, q)

    rescuer = MlxqWorker([q], connection=redis_conn, stream_options=options, name="rescuer")
    rescuer.register_birth()
    rescuer.clean_registries()

    job = Job.fetch(wrote.job.id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == "finished"
    (result,) = Result.all(job, serializer=JSONSerializer)
    assert result.type == Result.Type.SUCCESSFUL and result.return_value == RESULT.model_dump(mode="json")
    assert job.id in q.finished_job_registry and job.id not in q.started_job_registry
    assert not redis_conn.exists(wrote.execution.key)
    assert _events(redis_conn, job.id) == ["done"]
    assert job.id not in q.job_ids
    assert retried.job.get_status(refresh=True) == "queued" and q.job_ids == [retried.job.id]
    assert failed.job.get_status(refresh=True) == "failed"
    assert "AbandonedJobError" in (failed.job.latest_result().exc_string or "")  # type: ignore[union-attr]
    assert _events(redis_conn, failed.job.id) == ["error"]  # its stream ends, as a failed job's does
    assert not redis_conn.exists(keys.stream_key(retried.job.id))  # it says `restart` when it runs
    assert q.started_job_registry.count == 0
    assert not redis_conn.exists(q.registry_cleaning_key)


def test_a_running_job_that_wrote_its_result_is_left_to_its_worker(redis_conn: redis.Redis) -> None:
    """Only abandoned jobs (their heartbeat expired) are ended by maintenance: a live worker's job
    between its `done` and RQ's end is its own worker's to end."""
    q = Queue("alive", connection=redis_conn, serializer=JSONSerializer)
    alive = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), name="alive")
    alive.register_birth()
    run = _start(alive, q)
    JobResults(redis_conn, StreamOptions()).finish_scores([(run.job, RESULT)])
    other = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), name="other")
    other.clean_registries()
    assert run.job.get_status(refresh=True) == "started" and run.job.id in q.started_job_registry
    alive.batches.succeed_many([(run, RESULT.model_dump(mode="json"))])
    assert run.job.get_status(refresh=True) == "finished"


def test_a_done_left_by_an_earlier_job_of_the_same_id_does_not_end_a_new_run(redis_conn: redis.Redis) -> None:
    """A producer may reuse a job id: the result and `done` of the earlier job are no proof that the
    abandoned run finished. It fails as abandoned, as RQ would fail it."""
    q = Queue("reused", connection=redis_conn, serializer=JSONSerializer)
    dead = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), name="dead")
    run = _start(dead, q)
    JobResults(redis_conn, StreamOptions()).finish_scores([(run.job, RESULT)])  # the earlier job's end
    later = datetime.now(timezone.utc) + timedelta(seconds=10)  # this run started after it
    redis_conn.hset(run.job.key, "started_at", utcformat(later))
    _abandon(redis_conn, q)
    MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), name="other").clean_registries()
    assert run.job.get_status(refresh=True) == "failed"
    assert "AbandonedJobError" in (run.job.latest_result().exc_string or "")  # type: ignore[union-attr]


def test_a_job_taken_but_never_started_is_requeued_half_a_minute_after_a_pass_saw_it(
    redis_conn: redis.Redis,
) -> None:
    """A worker died between taking jobs (BLMOVE, claims) and starting them: a pass notes them (RQ's
    first-seen mark), and a pass `STUCK_AFTER_S` later puts them back at the head of their queue, in
    their order, queued, never failed. A job a live worker has started, or one just taken, stays."""
    q = Queue("stuck", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    first, second, running, fresh, behind = (q.enqueue_call(keys.SCORE_FUNC, args=(ROW,)) for _ in range(5))
    for _ in range(3):  # first, second, running taken by a worker that then started only `running`
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    (started,) = w.start([Job.fetch(running.id, connection=redis_conn, serializer=JSONSerializer)], q)

    w.maintenance.clean(q, [])  # the first pass notes them
    assert redis_conn.lrange(q.intermediate_queue_key, 0, -1) == [first.id.encode(), second.id.encode()]
    for job in (first, second):
        redis_conn.set(q.intermediate_queue.get_first_seen_key(job.id), time.time() - 31)
    redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")  # `fresh`: taken a moment ago
    w.maintenance.clean(q, [])

    assert q.job_ids == [first.id, second.id, behind.id]
    assert redis_conn.lrange(q.intermediate_queue_key, 0, -1) == [fresh.id.encode()]
    for job in (first, second):
        assert job.get_status(refresh=True) == "queued"
        assert not redis_conn.exists(q.intermediate_queue.get_first_seen_key(job.id))
    assert started.job.get_status(refresh=True) == "started" and q.failed_job_registry.count == 0
