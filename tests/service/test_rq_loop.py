"""RQ's loop between jobs on real Redis (`rq_loop.BetweenJobs`): heartbeats (one round trip each, RQ's
back-to-back repeats skipped), the writes between a job and the next dequeue in one round trip, the
loop going on while Redis is unreachable, and what it leaves in Redis (the worker's hash, its TTLs,
`rq suspend` honoured) against RQ's own `SimpleWorker` between the same two jobs."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_server import CuttableProxy
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend
from rq.utils import now, utcparse
from rq.worker import WorkerStatus

from mlxq.jobs import keys
from mlxq.worker import rq_loop
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.stream_writer import StreamOptions


def _commands(conn: redis.Redis, names: tuple[str, ...] = ("hset", "expire")) -> dict[str, int]:
    stats = conn.info("commandstats")
    return {k: int(stats.get(f"cmdstat_{k}", {"calls": 0})["calls"]) for k in names}


def test_a_heartbeat_is_sent_once_and_a_repeat_of_it_at_once_is_skipped(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(rq_loop, "monotonic", lambda: clock[0])
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


def test_between_jobs_the_worker_writes_state_beat_and_stats_and_reads_rq_suspend_in_one_go(
    redis_conn: redis.Redis,
) -> None:
    """After a job RQ's loop set the worker's state `idle` twice, beat twice, and read the suspension
    flag, each in a round trip of its own, and the stats were published in another: `idle` writes
    and reads them all together, and the loop's repeats that follow send nothing. A flag set by
    `rq suspend` is honoured, and a state the loop sets afterwards (its `suspended`) is written."""
    w = MlxqWorker(["between"], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    published: list[Any] = []

    class Stats:
        def publish(self, ttl_s: int | None = None, pipeline: Any = None) -> None:
            published.append(pipeline)
            pipeline.hset("between-stats", "jobs_done", len(published))

        def on_heartbeat(self, ttl_s: int, pipeline: Any = None) -> None:
            pass

    w.stats = Stats()
    w.set_state(WorkerStatus.BUSY)
    w.between_jobs.idle()
    assert redis_conn.hget(w.key, "state") == b"idle"
    assert redis_conn.hget("between-stats", "jobs_done") == b"1"
    assert w.worker_ttl + 58 <= redis_conn.ttl(w.key) <= w.worker_ttl + 60  # the idle TTL
    before = _commands(redis_conn, ("hset", "expire", "exists"))
    w.heartbeat()  # RQ's loop after the job, its suspension check and its dequeue's state
    w.check_for_suspension(False)
    w.set_state(WorkerStatus.IDLE)
    assert _commands(redis_conn, ("hset", "expire", "exists")) == before  # all said already
    w.set_state(WorkerStatus.IDLE)  # not just after `idle`: written
    assert _commands(redis_conn, ("hset",))["hset"] == before["hset"] + 1

    redis_conn.set("between-stats", "not a hash")  # a write refused (WRONGTYPE), not Redis away
    w.set_state(WorkerStatus.BUSY)
    w.between_jobs.idle()  # said in the log; the worker goes on
    before = _commands(redis_conn, ("hset",))["hset"]
    w.set_state(WorkerStatus.IDLE)  # RQ's loop then writes its own, as before `idle`
    assert _commands(redis_conn, ("hset",))["hset"] == before + 1
    assert redis_conn.hget(w.key, "state") == b"idle"
    redis_conn.delete("between-stats")

    redis_conn.set("rq:suspended", 1)  # `rq suspend` while a job ran
    try:
        w.between_jobs.idle()
        with pytest.raises(StopRequested):  # RQ's own check runs: a burst worker stops
            w.check_for_suspension(True)
        w.set_state(WorkerStatus.SUSPENDED)  # as RQ's check sets it while it waits for `rq resume`
        assert redis_conn.hget(w.key, "state") == b"suspended"
        w.set_state(WorkerStatus.IDLE)  # and back: written, though `idle` wrote it before
        assert redis_conn.hget(w.key, "state") == b"idle"
    finally:
        redis_conn.delete("rq:suspended", "between-stats")


def test_the_beat_rqs_dequeue_sends_once_it_took_a_job_is_left_to_the_jobs_start(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RQ's dequeue beats before it blocks and again once it returns; after a long wait the second
    would go out, a round trip before the job's start, which beats in its own round trip a moment
    later. Once a job was taken it is left to the start; a dequeue that timed out still beats."""
    clock = [1000.0]

    def later() -> float:  # every reading two seconds after the last: each beat is due
        clock[0] += 2.0
        return clock[0]

    monkeypatch.setattr(rq_loop, "monotonic", later)
    q = Queue("beat-start", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    job = q.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "a", "candidates": ["b"]}]},))
    stamps: list[bytes | None] = []
    beat = MlxqWorker.heartbeat

    def noted(self: MlxqWorker, timeout: int | None = None, pipeline: Any = None) -> None:
        beat(self, timeout, pipeline)
        stamps.append(redis_conn.hget(self.key, "last_heartbeat"))

    monkeypatch.setattr(MlxqWorker, "heartbeat", noted)
    taken = w.dequeue_job_and_maintain_ttl(timeout=1)
    assert taken is not None and taken[0].id == job.id
    assert len(stamps) == 2 and stamps[0] == stamps[1]  # the one before the wait went out, not the other
    (run,) = w.start([taken[0]], q)
    assert redis_conn.hget(w.key, "last_heartbeat") != stamps[0]  # the start's
    assert run.job.get_status(refresh=True) == "started"
    assert w.dequeue_job_and_maintain_ttl(timeout=1, max_idle_time=1) is None
    assert stamps[-1] != stamps[-2]  # no job taken: RQ's beat after the wait went out


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

        class CutAfterFirstJob:  # the worker's stats, published at each job's end
            def publish(self, ttl_s: int | None = None, pipeline: Any = None) -> None:
                ended.append("job")
                if len(ended) == 1:  # the first job's end: Redis goes away for half a second
                    proxy.cut_for(0.5)

            def on_heartbeat(self, ttl_s: int, pipeline: Any = None) -> None:
                pass

        w.stats = CutAfterFirstJob()
        with caplog.at_level("WARNING", logger="mlxq.worker.rq_loop"):
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


# --- against RQ's own worker -----------------------------------------------------------------------


class _Succeeds:
    """A job kind for the loop's tests, no model needed: each job it is handed is started through the
    worker and ended through RQ's own end of a job, as the real components do."""

    def __init__(self, worker: MlxqWorker) -> None:
        self.worker = worker

    def run(self, first: Job, queue: Queue) -> None:
        (run,) = self.worker.start([first], queue)
        self.worker.batches.succeed(run, {"ok": True})


def _worker_and_jobs(kind: str, q: Queue, jobs: int) -> SimpleWorker:
    """RQ's own `SimpleWorker` (its jobs run `os.getcwd`) or an mlxq worker (its jobs are score jobs,
    run by `_Succeeds`), registered as `work` registers it, with `jobs` queued."""
    if kind == "rq":
        w = SimpleWorker([q], connection=q.connection, serializer=JSONSerializer)
        func: str = "os.getcwd"
        args: tuple[Any, ...] = ()
    else:
        w = MlxqWorker([q], connection=q.connection, stream_options=StreamOptions())
        w.runners[keys.SCORE_FUNC] = _Succeeds(w)
        func, args = keys.SCORE_FUNC, ({"rows": [{"prompt": "a", "candidates": ["b"]}]},)
    for _ in range(jobs):
        q.enqueue_call(func, args=args)
    w.register_birth()
    return w


def _round(w: SimpleWorker, burst: bool) -> tuple[Job, Queue] | None:
    """The start of a round of RQ 3's `BaseWorker.work`, as it calls the worker: the suspension check,
    maintenance when due, the dequeue."""
    w.check_for_suspension(burst)
    if w.should_run_maintenance_tasks:
        w.run_maintenance_tasks()
    return w.dequeue_job_and_maintain_ttl(timeout=1)


def _seen(w: SimpleWorker) -> dict[str, Any]:
    """What RQ's loop keeps of the worker in Redis (and in memory), its times as ages."""
    conn = w.connection
    beat = conn.hget(w.key, "last_heartbeat")
    ttl = conn.ttl(w.key)
    return {
        "fields": {k.decode() for k in conn.hkeys(w.key)},
        "state": conn.hget(w.key, "state"),
        "state in memory": w.get_state(),
        "jobs done": conn.hget(w.key, "successful_job_count"),
        "beaten lately": beat is not None and (now() - utcparse(beat.decode())).total_seconds() < 5,
        "ttl": "idle" if 0 <= w.worker_ttl + 60 - ttl <= 3 else ttl,
        "executions ttl": conn.ttl(w.executions_key),
        "registered": conn.sismember("rq:workers", w.key),
    }


def _between_two_jobs(kind: str, conn: redis.Redis) -> tuple[list[dict[str, Any]], bool]:
    """Two rounds of RQ's loop by a worker of `kind` over two queued jobs: what it keeps once the first
    job ended (its `execute_job`, `work`'s beat after it) and once the next dequeue took a job; and
    whether that was the second job."""
    q = Queue(f"loop-{kind}", connection=conn, serializer=JSONSerializer)
    w = _worker_and_jobs(kind, q, 2)
    first, second = q.get_job_ids()
    taken = _round(w, burst=False)
    assert taken is not None and taken[0].id == first
    w.execute_job(*taken)
    w.heartbeat()
    after_job = _seen(w)
    taken = _round(w, burst=False)
    assert taken is not None and Job.fetch(first, connection=conn).get_status() == "finished"
    return [after_job, _seen(w)], taken[0].id == second


def test_between_jobs_the_worker_keeps_what_rqs_own_worker_keeps(redis_conn: redis.Redis) -> None:
    """From one job's end to the next job's dequeue an mlxq worker skips or batches RQ's writes
    (`BetweenJobs`; how many it sends: the tests above); what that leaves in Redis is what RQ's own
    `SimpleWorker` leaves: its hash's fields, state `idle` (in Redis and in memory), a fresh
    `last_heartbeat`, the idle TTL on its key, no executions key left, its registration."""
    rq_seen, rq_took_next = _between_two_jobs("rq", redis_conn)
    mlxq_seen, mlxq_took_next = _between_two_jobs("mlxq", redis_conn)
    assert rq_took_next and mlxq_took_next
    assert rq_seen[0]["state"] == b"idle" and rq_seen[0]["ttl"] == "idle" and rq_seen[0]["beaten lately"]
    assert rq_seen[0]["jobs done"] == b"1" and "total_working_time" in rq_seen[0]["fields"]
    assert mlxq_seen == rq_seen


def _held_by_rq_suspend(kind: str, conn: redis.Redis, burst: bool) -> dict[str, Any]:
    """`rq suspend` while a worker of `kind` runs its first job: the states its hash shows while RQ's
    loop waits for `rq resume` (a thread resumes once it sees `suspended`), or the stop of a burst
    worker, and whether the second job was taken."""
    q = Queue(f"held-{kind}-{burst}", connection=conn, serializer=JSONSerializer)
    w = _worker_and_jobs(kind, q, 2)
    taken = _round(w, burst)
    assert taken is not None
    suspend(conn)  # while the first job runs
    states: list[bytes | None] = []

    def resume_once_suspended() -> None:
        deadline = time.monotonic() + 10
        while conn.hget(w.key, "state") != b"suspended" and time.monotonic() < deadline:
            time.sleep(0.02)
        states.append(conn.hget(w.key, "state"))
        resume(conn)

    resumer = threading.Thread(target=resume_once_suspended)
    try:
        w.execute_job(*taken)
        w.heartbeat()
        if not burst:
            resumer.start()
        try:
            next_taken = _round(w, burst)
            stopped = False
        except StopRequested:
            next_taken, stopped = None, True
    finally:
        if resumer.is_alive():
            resumer.join()
        resume(conn)
    return {
        "stopped": stopped,
        "states while suspended": states,
        "state after": conn.hget(w.key, "state"),
        "second job taken": next_taken is not None,
        "left queued": q.count,
    }


@pytest.mark.parametrize("burst", [True, False])
def test_rq_suspend_holds_the_worker_as_it_holds_rqs_own(redis_conn: redis.Redis, burst: bool) -> None:
    """`rq suspend` sent while a job runs: `BetweenJobs` read the flag in its one round trip after the
    job, so RQ's own check runs next, and the worker does what RQ's `SimpleWorker` does: a burst
    worker stops before taking another job; any other shows `suspended` until `rq resume`, then goes
    back to `idle` and takes the next job."""
    rq_held = _held_by_rq_suspend("rq", redis_conn, burst)
    mlxq_held = _held_by_rq_suspend("mlxq", redis_conn, burst)
    if burst:
        assert rq_held["stopped"] and rq_held["left queued"] == 1
    else:
        assert rq_held["states while suspended"] == [b"suspended"] and rq_held["second job taken"]
    assert rq_held["state after"] == b"idle"
    assert mlxq_held == rq_held
