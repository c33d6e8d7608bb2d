"""The RQ worker's own parts on real Redis: heartbeats (one round trip each, RQ's back-to-back repeats
skipped), RQ's loop between jobs going on while Redis is unreachable, jobs taken from a queue but never
started (put back, not failed), and many jobs ended together (one transaction, what RQ writes for each;
dependents and repeats as RQ handles them)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_server import CuttableProxy
from rq import Queue, Repeat
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from jobs import keys
from worker import rq_worker
from worker.rq_worker import MlxqWorker
from worker.stream_writer import StreamOptions


def _commands(conn: redis.Redis, names: tuple[str, ...] = ("hset", "expire")) -> dict[str, int]:
    stats = conn.info("commandstats")
    return {k: int(stats.get(f"cmdstat_{k}", {"calls": 0})["calls"]) for k in names}


def test_a_heartbeat_is_sent_once_and_a_repeat_of_it_at_once_is_skipped(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(rq_worker, "monotonic", lambda: clock[0])
    w = MlxqWorker(["beats"], connection=redis_conn, stream_options=StreamOptions())
    idle_ttl = w.worker_ttl + 60

    def beat(timeout: int | None = None) -> tuple[bytes | None, int, dict[str, int]]:
        before = _commands(redis_conn)
        w.heartbeat(timeout)
        after = _commands(redis_conn)
        sent = {k: after[k] - before[k] for k in after}
        return redis_conn.hget(w.key, "last_heartbeat"), redis_conn.ttl(w.key), sent

    stamp, ttl, sent = beat()
    assert stamp is not None and idle_ttl - 2 <= ttl <= idle_ttl
    assert sent == {"hset": 1, "expire": 2}  # RQ's three commands, sent together
    clock[0] += 0.5
    again, _, sent = beat()  # RQ's loop beating again at once: nothing sent
    assert again == stamp and sent == {"hset": 0, "expire": 0}
    _, short, sent = beat(35)  # a job's shorter TTL always goes out
    assert short <= 35 and sent == {"hset": 1, "expire": 2}
    _, back, _ = beat()  # and so does the idle TTL after it
    assert idle_ttl - 2 <= back <= idle_ttl
    clock[0] += 1.5
    later, _, sent = beat()  # a second later the same TTL is refreshed again
    assert later != stamp and sent == {"hset": 1, "expire": 2}


def test_the_worker_goes_on_when_redis_drops_between_jobs(
    redis_conn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis unreachable just as a job ends (seen when it restarts under a bulk run): RQ's loop then
    sets the worker's state, beats and checks for suspension before its dequeue, and any of those
    failing used to make RQ quit, taking the worker process and its loaded model down. Now they are
    skipped, the dequeue waits for Redis, and the next job runs."""
    db = redis_conn.connection_pool.connection_kwargs.get("db", 0)
    port = redis_conn.connection_pool.connection_kwargs["port"]
    proxy = CuttableProxy(port)
    conn = redis.Redis(port=proxy.port, db=db, retry=Retry(NoBackoff(), 0))  # errors at once, no retries
    q = Queue("between-jobs", connection=conn, serializer=JSONSerializer)
    try:
        w = MlxqWorker([q], connection=conn, stream_options=StreamOptions())
        first, second = (q.enqueue_call("os.getcwd") for _ in range(2))  # refused by the allowlist, quickly
        ended: list[str] = []

        def after_job() -> None:  # the first job's end: Redis goes away for half a second
            ended.append("job")
            if len(ended) == 1:
                proxy.cut_for(0.5)

        w.after_job = after_job
        with caplog.at_level("WARNING", logger="worker.rq_worker"):
            assert w.work(burst=True)

        assert ended == ["job", "job"]
        for job in (first, second):
            assert job.get_status(refresh=True) == "failed"
            assert "is not an mlxq job" in (job.latest_result().exc_string or "")
        assert "redis unreachable between jobs" in caplog.text
    finally:
        conn.close()
        proxy.close()
        Queue("between-jobs", connection=redis_conn, serializer=JSONSerializer).delete(delete_jobs=True)


def test_a_job_taken_but_never_started_goes_back_to_the_head_of_its_queue(redis_conn: redis.Redis) -> None:
    """A worker's BLMOVE (or claim) moved the job to RQ's intermediate list and the worker never got
    it (Redis restarted before the reply): RQ's maintenance, a minute later, would fail it as "stuck in
    intermediate queue". It never ran, so it goes back to the head of its queue, queued, no error on
    its stream, its first-seen mark gone."""
    q = Queue("stuck", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    stuck = q.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "a", "candidates": ["b"]}]},))
    behind = q.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "c", "candidates": ["d"]}]},))
    redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")  # the reply that never came
    first_seen = q.intermediate_queue.get_first_seen_key(stuck.id)

    q.intermediate_queue.cleanup(w, q)  # first look: only noted
    assert redis_conn.exists(first_seen) and q.job_ids == [behind.id]
    redis_conn.set(first_seen, time.time() - 120)  # a minute and more later
    q.intermediate_queue.cleanup(w, q)

    assert q.job_ids == [stuck.id, behind.id]
    assert redis_conn.llen(q.intermediate_queue_key) == 0 and not redis_conn.exists(first_seen)
    assert stuck.get_status(refresh=True) == "queued" and q.failed_job_registry.count == 0
    assert not redis_conn.exists(keys.stream_key(stuck.id))


ROW = {"rows": [{"prompt": "a", "candidates": ["b"]}]}


def _started(w: MlxqWorker, q: Queue, n: int, **enqueue: Any) -> list[tuple[Job, Queue, Any, Any]]:
    """`n` score jobs as a batch holds them once started: (job, queue, execution, return value)."""
    jobs = [q.enqueue_call(keys.SCORE_FUNC, args=(ROW,), **enqueue) for _ in range(n)]
    for job in jobs:  # claimed: off the queue
        q.connection.lrem(q.key, 1, job.id)
    executions = w._start_claimed(jobs)
    return [
        (job, q, execution, {"n": i}) for i, (job, execution) in enumerate(zip(jobs, executions, strict=True))
    ]


def _ended_state(job: Job) -> dict[str, Any]:
    """What RQ keeps of an ended job, without its times and ids."""
    conn = job.connection
    fields = {k.decode() for k in conn.hgetall(job.key)}
    results = Result.all(job, serializer=JSONSerializer)
    return {
        "status": job.get_status(refresh=True),
        "fields": fields,
        "ttl": conn.ttl(job.key) > 0,
        "results": [(r.type, r.return_value) for r in results],
        "finished registry": job.id in job.finished_job_registry,
        "started registry": job.id in job.started_job_registry,
    }


def test_jobs_ended_together_are_ended_as_rq_ends_one_in_one_transaction(redis_conn: redis.Redis) -> None:
    q = Queue("ends", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    (alone, *_), together = _started(w, q, 1), _started(w, q, 20)
    w._finalize_success(*alone)  # RQ's own end of one job
    before = _commands(redis_conn, ("exec", "watch"))
    w._finalize_successes(together)
    after = _commands(redis_conn, ("exec", "watch"))
    assert {k: after[k] - before[k] for k in after} == {"exec": 1, "watch": 1}  # RQ: 20 of each
    reference = _ended_state(alone[0])
    assert reference["status"] == "finished" and reference["finished registry"]
    assert reference["results"] == [(Result.Type.SUCCESSFUL, alone[3])]
    for job, _, execution, value in together:
        assert _ended_state(job) == {**reference, "results": [(Result.Type.SUCCESSFUL, value)]}
        assert not redis_conn.exists(execution.key)
    assert int(redis_conn.hget(w.key, "successful_job_count") or 0) == 21
    assert float(redis_conn.hget(w.key, "total_working_time") or 0) > 0
    assert q.started_job_registry.count == 0 and q.finished_job_registry.count == 21
    assert w.executions == {}


def test_a_job_with_a_dependent_or_repeats_ends_through_rq_and_its_dependent_is_enqueued(
    redis_conn: redis.Redis,
) -> None:
    q = Queue("ends", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    plain, parent = _started(w, q, 2)
    (repeating,) = _started(w, q, 1, repeat=Repeat(times=1))
    child = q.enqueue_call(keys.SCORE_FUNC, args=(ROW,), depends_on=parent[0])
    assert child.get_status(refresh=True) == "deferred"
    w._finalize_successes([plain, parent, repeating])
    assert plain[0].get_status(refresh=True) == parent[0].get_status(refresh=True) == "finished"
    assert child.get_status(refresh=True) == "queued" and child.id in q.job_ids
    assert repeating[0].id in q.job_ids  # RQ's repeat: queued again at once


def test_a_dependent_added_while_jobs_end_together_is_not_lost(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RQ's race: a job gets a dependent after its dependents were read, before the commit. The commit
    fails (the dependents set is watched) and starts over; the job then ends through RQ, which enqueues
    the dependent."""
    q = Queue("ends", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    ended = _started(w, q, 3)
    children: list[Job] = []
    real_now = rq_worker.now

    def now_with_a_new_dependent() -> Any:
        if not children:  # between the read of the dependents and the commit, once
            children.append(q.enqueue_call(keys.SCORE_FUNC, args=(ROW,), depends_on=ended[1][0]))
        return real_now()

    monkeypatch.setattr(rq_worker, "now", now_with_a_new_dependent)
    w._finalize_successes(ended)
    assert [job.get_status(refresh=True) for job, *_ in ended] == ["finished"] * 3
    assert children[0].get_status(refresh=True) == "queued" and children[0].id in q.job_ids
    assert int(redis_conn.hget(w.key, "successful_job_count") or 0) == 3


def test_a_job_whose_end_fails_fails_with_the_reason_and_the_others_finish(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = Queue("ends", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    good, bad, other = _started(w, q, 3)

    def cannot_save(*args: Any, **kwargs: Any) -> None:
        raise ValueError("this result cannot be saved")

    monkeypatch.setattr(bad[0], "_handle_success", cannot_save)  # RQ's write of this one job fails
    w._finalize_successes([good, bad, other])
    assert good[0].get_status(refresh=True) == other[0].get_status(refresh=True) == "finished"
    assert bad[0].get_status(refresh=True) == "failed"
    assert "this result cannot be saved" in (bad[0].latest_result().exc_string or "")
    assert int(redis_conn.hget(w.key, "successful_job_count") or 0) == 2
