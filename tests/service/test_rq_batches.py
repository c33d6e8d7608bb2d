"""`rq_batches`: RQ's start and end of jobs, done for many at once, against RQ's own version of each:
the same records in Redis (status, registries, results, TTLs, executions, the worker's counters) in one
transaction instead of several round trips per job; dependents and repeats as RQ handles them."""

from __future__ import annotations

import json
import logging
import time
import zlib
from typing import Any

import pytest
import redis
from rq import Callback, Queue, Repeat, Retry
from rq.job import Dependency, Job, JobStatus
from rq.rate_limit import RateLimit
from rq.registry import CanceledJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.webhook import Webhook

from mlxq.jobs import keys
from mlxq.jobs.schema import ScoredRow, ScoreResult
from mlxq.worker import rq_batches, rq_job_hash
from mlxq.worker.bounded_job import BoundedJob
from mlxq.worker.job_claim import JobClaimer
from mlxq.worker.job_results import JobResults
from mlxq.worker.job_runs import Run
from mlxq.worker.job_watch import CancelKeys
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.stream_writer import StreamOptions

ROW = {"rows": [{"prompt": "a", "candidates": ["b"]}]}


def _commands(conn: redis.Redis, names: tuple[str, ...]) -> dict[str, int]:
    stats = conn.info("commandstats")
    return {k: int(stats.get(f"cmdstat_{k}", {"calls": 0})["calls"]) for k in names}


def _job_state(job: Job) -> dict[str, Any]:
    """What RQ keeps of a started job, without its times and ids."""
    conn = job.connection
    return {
        "status": job.get_status(refresh=True),
        "worker": (conn.hget(job.key, "worker_name") or b"").decode(),
        "fields": {k.decode() for k in conn.hgetall(job.key)},
        "ttl": conn.ttl(job.key),
        "started registry": job.id in job.started_job_registry,
        "executions": len(job.get_executions()),
        "heartbeat": conn.hget(job.key, "last_heartbeat") is not None,
        "execution fields": {k.decode() for e in job.get_executions() for k in conn.hgetall(e.key)},
        "execution ttl": all(conn.ttl(e.key) > 0 for e in job.get_executions()),
        "executions ttl": conn.ttl(f"rq:executions:{job.id}") > 0,
        "in the worker's executions": all(
            conn.sismember(e.worker_executions_key, e.composite_key) for e in job.get_executions()
        ),
        "worker's executions ttl": all(conn.ttl(e.worker_executions_key) > 0 for e in job.get_executions()),
    }


def test_jobs_started_together_are_started_as_rq_starts_one_by_one_script_call(
    redis_conn: redis.Redis,
) -> None:
    q, w = _born_worker(redis_conn, "starts")
    jobs = [q.enqueue_call(keys.SCORE_FUNC, args=(ROW,)) for _ in range(6)]
    for _ in jobs:  # taken from the queue, as RQ's dequeue (BLMOVE) leaves them
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    alone, together = jobs[0], jobs[1:]
    execution = w.prepare_execution(alone)  # RQ's own start of one job
    w.prepare_job_execution(alone, remove_from_intermediate_queue=True)
    before = _commands(redis_conn, ("exec", "evalsha"))
    runs = w.batches.start(together, q)
    after = _commands(redis_conn, ("exec", "evalsha"))
    assert {k: after[k] - before[k] for k in after} == {"exec": 0, "evalsha": 1}  # one script call
    reference = _job_state(alone)
    assert reference["status"] == "started" and reference["started registry"] and reference["executions"] == 1
    for run in runs:
        assert _job_state(run.job) == reference
        assert run.execution.id in w.executions
    assert execution.id
    assert redis_conn.llen(q.intermediate_queue_key) == 0
    assert w.get_state() == "busy"


def _born_worker(redis_conn: redis.Redis, queue: str) -> tuple[Queue, MlxqWorker]:
    """A queue of JSON-serialized jobs and a registered worker serving it."""
    q = Queue(queue, connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    return q, w


def _started(w: MlxqWorker, q: Queue, n: int, sparse: bool = False, **enqueue: Any) -> list[tuple[Run, Any]]:
    """`n` score jobs as a batch holds them once started, each with a return value."""
    jobs = [q.enqueue_call(keys.SCORE_FUNC, args=(ROW,), **enqueue) for _ in range(n)]
    for _ in jobs:  # claimed: off the queue, onto the intermediate list as RQ's dequeue leaves it
        q.connection.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    # Every other job read back from its hash, as a worker's dequeue or claim has it (its end writes
    # only the fields that change); the others as enqueued (their end writes every field). `sparse`:
    # the last job's hash lacks fields RQ's enqueue writes, as a producer in another language may leave it.
    if sparse:
        q.connection.hdel(jobs[-1].key, "group_id", "stopped_callback_name")
    jobs = [
        BoundedJob.fetch(job.id, connection=q.connection, serializer=JSONSerializer)
        if i % 2 or (sparse and i == len(jobs) - 1)
        else job
        for i, job in enumerate(jobs)
    ]
    return [(run, {"n": i}) for i, run in enumerate(w.batches.start(jobs, q))]


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
        "executions": conn.exists(f"rq:executions:{job.id}"),
        "timing fields set": {
            k: bool(conn.hget(job.key, k))
            for k in ("started_at", "ended_at", "last_heartbeat", "enqueued_at")
        },
        "worker": conn.hget(job.key, "worker_name"),
        # Every other field's value, and the result entry's fields (RQ writes each one at its end).
        "values": {k: v for k, v in conn.hgetall(job.key).items() if k.decode() not in _PER_JOB},
        "result fields": [sorted(f) for _, f in conn.xrange(f"rq:results:{job.id}")],
        "result ttl": conn.ttl(f"rq:results:{job.id}") > 0,
        "finished in": round(
            float(conn.zscore(job.finished_job_registry.key, job.id) or 0) - time.time(), -1
        ),
        "ended after started": conn.hget(job.key, "ended_at") >= conn.hget(job.key, "started_at"),
    }


# Fields that differ from job to job (times, the payload's own text) and are compared as set or not.
_PER_JOB = {"created_at", "started_at", "ended_at", "last_heartbeat", "enqueued_at", "data", "description"}


def test_jobs_ended_together_are_ended_as_rq_ends_one_by_one_script_call(redis_conn: redis.Redis) -> None:
    q, w = _born_worker(redis_conn, "ends")
    (alone, *_), together = _started(w, q, 1), _started(w, q, 21, sparse=True)
    w.batches.succeed(*alone)  # RQ's own end of one job
    before = _commands(redis_conn, ("exec", "watch", "evalsha"))
    w.batches.succeed_many(together)
    after = _commands(redis_conn, ("exec", "watch", "evalsha"))
    assert {k: after[k] - before[k] for k in after} == {"exec": 0, "watch": 0, "evalsha": 1}  # RQ: 21 EXECs
    reference = _ended_state(alone[0].job)
    assert reference["status"] == "finished" and reference["finished registry"]
    assert reference["results"] == [(Result.Type.SUCCESSFUL, alone[1])]
    for run, value in together:
        assert _ended_state(run.job) == {**reference, "results": [(Result.Type.SUCCESSFUL, value)]}
        assert not redis_conn.exists(run.execution.key)
    assert int(redis_conn.hget(w.key, "successful_job_count") or 0) == 22
    assert float(redis_conn.hget(w.key, "total_working_time") or 0) > 0
    assert q.started_job_registry.count == 0 and q.finished_job_registry.count == 22
    assert w.executions == {}


def test_a_job_with_a_dependent_or_repeats_ends_through_rq_and_its_dependent_is_enqueued(
    redis_conn: redis.Redis,
) -> None:
    q, w = _born_worker(redis_conn, "ends")
    plain, parent = _started(w, q, 2)
    (repeating,) = _started(w, q, 1, repeat=Repeat(times=1))
    child = q.enqueue_call(keys.SCORE_FUNC, args=(ROW,), depends_on=parent[0].job)
    assert child.get_status(refresh=True) == "deferred"
    w.batches.succeed_many([plain, parent, repeating])
    assert plain[0].job.get_status(refresh=True) == parent[0].job.get_status(refresh=True) == "finished"
    assert child.get_status(refresh=True) == "queued" and child.id in q.job_ids
    assert repeating[0].job.id in q.job_ids  # RQ's repeat: queued again at once


def test_a_dependent_added_while_jobs_end_together_is_not_lost(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RQ's race: a job gets a dependent after its dependents were read, before the commit. The commit
    fails (the dependents set is watched) and starts over; the job then ends through RQ, which enqueues
    the dependent."""
    q, w = _born_worker(redis_conn, "ends")
    ended = _started(w, q, 3)
    children: list[Job] = []
    real_now = rq_batches.now

    def now_with_a_new_dependent() -> Any:
        if not children:  # between the read of the dependents and the commit, once
            children.append(q.enqueue_call(keys.SCORE_FUNC, args=(ROW,), depends_on=ended[1][0].job))
        return real_now()

    monkeypatch.setattr(rq_batches, "now", now_with_a_new_dependent)
    w.batches.succeed_many(ended)
    assert [run.job.get_status(refresh=True) for run, _ in ended] == ["finished"] * 3
    assert children[0].get_status(refresh=True) == "queued" and children[0].id in q.job_ids
    assert int(redis_conn.hget(w.key, "successful_job_count") or 0) == 3


def test_a_job_whose_end_fails_fails_with_the_reason_and_the_others_finish(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, w = _born_worker(redis_conn, "ends")
    good, bad, other = _started(w, q, 3)

    def cannot_save(*args: Any, **kwargs: Any) -> None:
        raise ValueError("this result cannot be saved")

    monkeypatch.setattr(bad[0].job, "get_result_ttl", cannot_save)  # the end of this one job fails
    w.batches.succeed_many([good, bad, other])
    assert good[0].job.get_status(refresh=True) == other[0].job.get_status(refresh=True) == "finished"
    assert bad[0].job.get_status(refresh=True) == "failed"
    assert "this result cannot be saved" in (bad[0].job.latest_result().exc_string or "")
    assert int(redis_conn.hget(w.key, "successful_job_count") or 0) == 2


def test_an_abandoned_job_that_finished_is_ended_by_another_worker_as_rq_ends_one(
    redis_conn: redis.Redis,
) -> None:
    """A worker died after writing a job's result: another worker ends it with the same records as
    RQ's own end of a job, and the dead execution's records go."""
    q = Queue("ends", connection=redis_conn, serializer=JSONSerializer)
    dead = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), name="dead")
    dead.register_birth()
    (alone, *_), (abandoned, value) = _started(dead, q, 1), _started(dead, q, 1)[0]
    dead.batches.succeed(*alone)  # RQ's own end of one job
    rescuer = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), name="rescuer")
    rescuer.register_birth()
    job = Job.fetch(abandoned.job.id, connection=redis_conn, serializer=JSONSerializer)
    rescuer.batches.end_abandoned(job, q, abandoned.execution, value)
    reference = _ended_state(alone[0].job)
    assert _ended_state(job) == {**reference, "results": [(Result.Type.SUCCESSFUL, value)]}
    assert not redis_conn.exists(abandoned.execution.key)
    execution = abandoned.execution
    assert not redis_conn.sismember(execution.worker_executions_key, execution.composite_key)
    assert q.started_job_registry.count == 0


def _cancelled_state(job: Job) -> dict[str, Any]:
    """What RQ keeps of a canceled job, without its times and ids."""
    conn = job.connection
    return {
        "status": job.get_status(refresh=True),
        "fields": {k.decode() for k in conn.hgetall(job.key)} - {"ended_at"},
        "persists": conn.ttl(job.key) == -1,
        "results": Result.all(job, serializer=JSONSerializer),
        "canceled registry": job.id in _canceled_registry(job).get_job_ids(),
        "started registry": job.id in job.started_job_registry,
        "finished registry": job.id in job.finished_job_registry,
        "executions": len(job.get_executions()),
    }


def _canceled_registry(job: Job) -> CanceledJobRegistry:
    return CanceledJobRegistry(job.origin, connection=job.connection, serializer=JSONSerializer)


CANCELLED = {"text": "Par", "finish_reason": "cancelled"}


def test_a_job_cancelled_while_it_ran_ends_as_rqs_cancel_ends_a_job(redis_conn: redis.Redis) -> None:
    """A running job its producer cancelled ends `canceled` with the records RQ's `Job.cancel` writes,
    plus the end of its execution: alone, among jobs ended together, and when another worker ends it
    after its own worker died. The others in the batch finish as before."""
    q, w = _born_worker(redis_conn, "cancels")
    (reference_run, _), (alone, _), (in_batch, _), (finishing, value) = _started(w, q, 4)
    reference_run.job.cancel()  # RQ's own cancel, then the worker's end of the execution
    with redis_conn.pipeline() as pipe:
        w.cleanup_execution(reference_run.job, pipeline=pipe, execution=reference_run.execution)
        pipe.execute()
    reference = _cancelled_state(reference_run.job)
    assert reference["status"] == "canceled" and reference["canceled registry"]
    assert not reference["started registry"] and reference["executions"] == 0

    w.batches.succeed(alone, CANCELLED)
    w.batches.succeed_many([(in_batch, CANCELLED), (finishing, value)])
    for run in (alone, in_batch):
        assert _cancelled_state(run.job) == reference
        assert redis_conn.hget(run.job.key, "ended_at")
    assert finishing.job.get_status(refresh=True) == "finished"
    assert q.started_job_registry.count == 0 and q.canceled_job_registry.count == 3

    dead = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), name="dead")
    dead.register_birth()
    ((abandoned, _),) = _started(dead, q, 1)
    job = Job.fetch(abandoned.job.id, connection=redis_conn, serializer=JSONSerializer)
    w.batches.end_abandoned(job, q, abandoned.execution, CANCELLED)
    assert _cancelled_state(job) == reference


def _calls(conn: redis.Redis) -> int:
    """Commands the server ran so far, those inside scripts and transactions included."""
    stats = conn.info("commandstats")
    skip = {"cmdstat_info", "cmdstat_multi", "cmdstat_exec", "cmdstat_watch"}
    return sum(int(v["calls"]) for k, v in stats.items() if k not in skip)


def test_a_batch_starts_and_ends_each_job_in_fewer_commands_than_rq_and_leaves_the_same_records(
    redis_conn: redis.Redis,
) -> None:
    """RQ's start and end of one job run 11 + 15 commands for it; a batch writes the same records
    (the tests above) without RQ's repeated writes of one field or one key: 8 + 11 a job run inside
    Redis, and a few for the batch; the worker sends one script call for each (and its own state and
    heartbeat beside the start's)."""
    q, w = _born_worker(redis_conn, "costs")
    n = 40
    jobs = [q.enqueue_call(keys.SCORE_FUNC, args=(ROW,)) for _ in range(n)]
    for _ in jobs:
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    c0, s0 = _calls(redis_conn), _commands(redis_conn, ("evalsha",))["evalsha"]
    runs = w.batches.start(jobs, q)
    c1, s1 = _calls(redis_conn), _commands(redis_conn, ("evalsha",))["evalsha"]
    w.batches.succeed_many([(run, {"n": 1}) for run in runs])
    c2, s2 = _calls(redis_conn), _commands(redis_conn, ("evalsha",))["evalsha"]
    assert c1 - c0 <= 8 * n + 7  # the script call and the commands it runs
    assert c2 - c1 <= 11 * n + 3
    assert s1 - s0 == 1 and s2 - s1 == 1
    assert q.finished_job_registry.count == n and q.started_job_registry.count == 0
    assert not redis_conn.smembers(runs[0].execution.worker_executions_key)


def test_an_end_sent_again_ends_no_job_twice_and_a_server_without_the_scripts_is_sent_them(
    redis_conn: redis.Redis,
) -> None:
    """The end script sent a second time (its reply lost on the way, `retrying` sends it again) leaves
    one result a job and counts each job once; a server that lost its scripts (a restart, SCRIPT
    FLUSH) is sent them again and the batch goes on."""
    q, w = _born_worker(redis_conn, "again")
    redis_conn.script_flush()
    ended = _started(w, q, 3)
    assert w.batches._end_together(ended) == [True] * 3
    assert w.batches._end_together(ended) == [True] * 3
    for run, value in ended:
        assert [r.return_value for r in Result.all(run.job, serializer=JSONSerializer)] == [value]
        assert run.job.get_status(refresh=True) == "finished"
    assert int(redis_conn.hget(w.key, "successful_job_count") or 0) == 3


def test_a_callers_commands_ride_in_the_start_round_trip_and_count_once_when_it_is_sent_again(
    redis_conn: redis.Redis,
) -> None:
    """What a generation job needs before its first forward rides in the round trip that starts it
    (`Rider`): its stream's opening (its attempt count saved), its cancel key, the queue's head. A
    server that lost the start script (NOSCRIPT) is sent it and the round trip again, riders and all:
    each attempt is still counted once, and no `restart` entry is written for it."""
    q, w = _born_worker(redis_conn, "riders")
    jobs = [q.enqueue_call(keys.GENERATE_FUNC, args=({"prompt": f"p{i}"},)) for i in range(3)]
    for _ in jobs:
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    waiting = q.enqueue_call(keys.GENERATE_FUNC, args=({"prompt": "next"},))
    redis_conn.set(keys.cancel_key(jobs[1].id), 1)  # cancelled just before it starts
    redis_conn.script_flush()
    loads = _commands(redis_conn, ("script|load", "script"))
    opening, cancels = JobResults(redis_conn, StreamOptions()).opening(), CancelKeys()
    heads = JobClaimer(redis_conn, JSONSerializer).heads([q])
    runs = w.batches.start(jobs, q, [opening, cancels, heads])
    assert _commands(redis_conn, ("script|load", "script")) != loads  # it was sent again
    assert [run.job.get_status(refresh=True) for run in runs] == ["started"] * 3
    assert cancels.found == [False, True, False]
    assert heads.ids == {q.name: [waiting.id]}
    writers = opening.writers()
    for run, writer in zip(runs, writers, strict=True):
        assert writer.job_id == run.job.id and writer.deferred
        assert json.loads(redis_conn.hget(run.job.key, "meta") or b"{}") == {"mlxq_attempt": 1}
        assert redis_conn.xlen(keys.stream_key(run.job.id)) == 0


def test_a_riders_error_reply_is_handed_to_it_and_the_jobs_still_start(redis_conn: redis.Redis) -> None:
    """A rider's command that fails (a stream key holding another type) fails nothing in the start:
    the jobs are started (the caller then fails them through RQ), and the error is the rider's."""
    q, w = _born_worker(redis_conn, "rider-error")
    job = q.enqueue_call(keys.GENERATE_FUNC, args=({"prompt": "p"},))
    redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    redis_conn.set(keys.stream_key(job.id), "not a stream")
    opening = JobResults(redis_conn, StreamOptions()).opening()
    (run,) = w.batches.start([job], q, [opening])
    assert run.job.get_status(refresh=True) == "started"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        opening.writers()


def test_the_fields_a_batch_end_saves_are_those_of_rqs_to_dict(redis_conn: redis.Redis) -> None:
    """`saved_fields` (what RQ's end saves of a job, computed without compressing its payload again)
    against RQ's own `Job.to_dict`, for jobs with and without each optional field RQ writes, as enqueued,
    read back from their hashes, and as a batch leaves them once started and ended."""
    q = Queue("fields", connection=redis_conn, serializer=JSONSerializer)
    plain = q.enqueue_call(keys.SCORE_FUNC, args=(ROW,))
    full = q.enqueue_call(
        keys.SCORE_FUNC,
        args=(ROW,),
        timeout=30,
        result_ttl=60,
        failure_ttl=90,
        ttl=600,
        description="",
        meta={"a": 1},
        retry=Retry(max=2, interval=[1, 2]),
        repeat=Repeat(times=2, interval=[5]),
        on_success=Callback("mlxq.jobs.keys.rq_job_key", timeout=7),
        on_failure=Callback("mlxq.jobs.keys.rq_job_key", timeout=8),
        on_stopped=Callback("mlxq.jobs.keys.rq_job_key", timeout=9),
        rate_limit=RateLimit("tenant", 3),
        webhooks=[Webhook("https://example.com/hook", "finished")],
    )
    dependent = q.enqueue_call(
        keys.SCORE_FUNC, args=(ROW,), depends_on=Dependency(jobs=[plain], allow_failure=True)
    )
    jobs: list[Job] = [plain, full, dependent]
    jobs += [BoundedJob.fetch(j.id, connection=redis_conn, serializer=JSONSerializer) for j in jobs]
    odd = BoundedJob.fetch(plain.id, connection=redis_conn, serializer=JSONSerializer)
    odd.group_id, odd.enqueue_at_front_on_retry, odd.number_of_retries = "g", True, 1
    odd.worker_name, odd.started_at, odd.ended_at, odd.last_heartbeat = "w", now(), now(), now()
    odd.retries_left, odd.enqueue_at_front, odd.allow_dependency_failures = 0, False, False
    odd._status = JobStatus.FINISHED
    for job in [*jobs, odd]:
        rqs = job.to_dict(include_meta=False, include_result=False)
        assert rq_job_hash.saved_fields(job) == rqs
        assert rq_job_hash.saved_fields(job, with_data=False) == {k: v for k, v in rqs.items() if k != "data"}


def test_a_batch_end_leaves_a_payload_stored_as_rq_stores_it_and_writes_another_as_rqs_end_does(
    redis_conn: redis.Redis,
) -> None:
    """A payload RQ compressed is left as stored (RQ's end would write the same bytes); one a producer
    stored uncompressed is written compressed, as RQ's own end of the same job writes it."""
    q, w = _born_worker(redis_conn, "payloads")
    jobs = [q.enqueue_call(keys.SCORE_FUNC, args=(ROW,)) for _ in range(3)]
    stored = redis_conn.hget(jobs[0].key, "data")
    for job in jobs[1:]:  # as a producer that does not compress writes it
        redis_conn.hset(job.key, "data", zlib.decompress(stored))
    for _ in jobs:
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    read = [BoundedJob.fetch(j.id, connection=redis_conn, serializer=JSONSerializer) for j in jobs]
    assert [j.payload_as_rq_stores_it() for j in read] == [True, False, False]
    rq_end, *together = w.batches.start(read, q)
    w.batches.succeed(rq_end, {"n": 0})  # RQ's own end
    w.batches.succeed_many([(run, {"n": 1}) for run in together])
    assert redis_conn.hget(jobs[0].key, "data") == stored  # RQ's end: its own compression, the same bytes
    assert redis_conn.hget(jobs[1].key, "data") == stored and redis_conn.hget(jobs[2].key, "data") == stored
    assert [j.get_status(refresh=True) for j in jobs] == ["finished"] * 3


def test_jobs_ended_together_are_logged_by_id_in_one_line_a_queue(
    redis_conn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    q, w = _born_worker(redis_conn, "logged")
    ended = _started(w, q, 3)
    with caplog.at_level(logging.INFO, logger=w.log.name):
        w.batches.succeed_many(ended)
    lines = [r.getMessage() for r in caplog.records if "Jobs OK" in r.getMessage()]
    # as RQ wrote it, or quoted as a worker's log writes RQ's lines (`cli.RqLines`, set up by other tests)
    said = f"Worker {w.name}: logged: Jobs OK (3): " + " ".join(run.job.id for run, _ in ended)
    assert lines in ([said], [f"msg={json.dumps(said)}"])


def test_a_result_mlxq_wrote_is_ended_in_rq_as_written_not_dumped_again(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RQ's end of a score batch sends each result as the text mlxq's writes stored (`JobResults`
    keeps it on the job): RQ keeps the same result as its own end of that value, and the value is not
    serialized again; a value other than the one written is."""
    q, w = _born_worker(redis_conn, "written")
    (alone, *_), together = _started(w, q, 1), _started(w, q, 6)
    score = ScoreResult(
        rows=[ScoredRow(logits=[0.5, -1.25], logprobs=[-0.2, -1.9], input_tokens=3, cached_tokens=1)],
        input_tokens=3,
        cached_tokens=1,
    )
    first, *values = JobResults(redis_conn, StreamOptions()).finish_scores(
        [(run.job, score) for run, _ in [alone, *together]]
    )
    w.batches.succeed(alone[0], first)  # RQ's own end of such a value
    read = [run for run, _ in together if isinstance(run.job, BoundedJob)]
    assert read and all(run.job.returned is not None for run in read)
    ended = [(run, v) for (run, _), v in zip(together, values, strict=True)]
    ended[-1] = (ended[-1][0], dict(values[-1]))  # a copy: not the value written, dumped again
    dumped: list[Any] = []
    real = JSONSerializer.dumps
    monkeypatch.setattr(JSONSerializer, "dumps", staticmethod(lambda v: dumped.append(v) or real(v)))
    w.batches.succeed_many(ended)
    assert len(dumped) == len(together) - len(read) + (
        1 if isinstance(together[-1][0].job, BoundedJob) else 0
    )
    reference = _ended_state(alone[0].job)
    for run, value in ended:
        assert _ended_state(run.job) == {**reference, "results": [(Result.Type.SUCCESSFUL, value)]}
