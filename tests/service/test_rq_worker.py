"""The RQ worker's own parts on real Redis: its job watch, jobs taken from a queue but never started
(put back, not failed) or taken twice, its command channel and stop signals. RQ's loop between jobs:
`test_rq_loop.py`; many jobs started and ended together: `test_rq_batches.py`."""

from __future__ import annotations

import logging
import signal
import threading
import time
import zlib
from collections.abc import Callable

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus

from mlxq.jobs import keys
from mlxq.worker import rq_worker
from mlxq.worker.job_claim import JobClaimer
from mlxq.worker.job_runs import Run
from mlxq.worker.job_watch import JobWatch
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.stream_writer import StreamOptions


def test_one_watch_thread_serves_a_workers_batches_one_after_another(redis_conn: redis.Redis) -> None:
    """The worker's jobs are watched by one thread for its life (started with its first batch, stopped
    at its teardown): a later batch's jobs are heartbeaten and their cancels seen as the first's were,
    and once a batch is over none of its jobs is beaten again or reads as cancelled."""
    q = Queue("one-watch", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker(
        [q], connection=redis_conn, stream_options=StreamOptions(), heartbeat_s=0.02, cancel_poll_s=0.01
    )
    w.register_birth()

    def started() -> Run:
        job = q.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "a", "candidates": ["b"]}]},))
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
        (run,) = w.start([job], q)
        return run

    def beat_of(run: Run) -> bytes | None:
        return redis_conn.hget(run.job.key, "last_heartbeat")

    def eventually(check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline, "not seen in time"
            time.sleep(0.01)

    watches = []
    for _ in range(2):
        run = started()
        with w.watching([run]) as watch:
            watches.append(watch)
            first = beat_of(run)
            eventually(lambda run=run, first=first: beat_of(run) != first)  # heartbeaten
            redis_conn.set(keys.cancel_key(run.job.id), 1)
            eventually(lambda run=run: w.is_cancelled(run.job.id))
        assert not w.is_cancelled(run.job.id)
        last = beat_of(run)
        time.sleep(0.1)  # several beats' time: none for a job whose batch is over
        assert beat_of(run) == last
    assert watches[0] is watches[1]
    threads = [t for t in threading.enumerate() if t.name == "mlxq-job-watch" and t is watches[0]._thread]
    assert threads and threads[0].is_alive()
    w.teardown()
    assert not threads[0].is_alive()


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


def test_a_job_cannot_lift_the_workers_timeout_limit(redis_conn: redis.Redis) -> None:
    q = Queue("timeouts", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), max_job_timeout=600)
    asked = [None, 30, 600, 601, -1]
    jobs = [q.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},), timeout=t) for t in asked]
    for job in jobs:
        if asked[jobs.index(job)] is None:
            job.timeout = None  # enqueued without one, as a plain-Redis producer may
    assert [w.batches.timeout_of(job) for job in jobs] == [600, 30, 600, 600, 600]  # default 3600, capped
    anything = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions(), max_job_timeout=-1)
    assert [anything.batches.timeout_of(job) for job in jobs] == [3600, 30, 600, 601, -1]


def test_a_rejected_jobs_reason_is_not_overwritten_by_maintenance(redis_conn: redis.Redis) -> None:
    """A job the allowlist refuses fails with its reason; the maintenance a minute later finds no
    trace of it in the intermediate list to fail again as "stuck"."""
    q = Queue("rejects", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    job = q.enqueue_call("os.getcwd")
    assert w.work(burst=True)
    assert redis_conn.llen(q.intermediate_queue_key) == 0
    reason = job.latest_result().exc_string or ""
    assert "is not an mlxq job" in reason
    q.intermediate_queue.cleanup(w, q)
    w.handle_job_failure(job, q, exc_string="Job was stuck in intermediate queue.")  # as RQ's cleanup would
    assert job.get_status(refresh=True) == "failed"
    assert "is not an mlxq job" in (job.latest_result().exc_string or "")


def test_a_payload_that_inflates_past_the_limit_is_put_aside_uninflated(redis_conn: redis.Redis) -> None:
    """1 MB of zlib can hold 1 GiB: RQ would inflate it whole as it reads the job. Here it is measured
    in steps that stop at the limit, the job is put aside with the reason, and the job behind it runs
    (it fails: no component runs it in this bare worker, which is its own clear reason)."""
    q = Queue("bombs", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    payload = b'["jobs.score", null, [{"rows": []}], {}]' + b" " * (17 << 20)  # valid JSON, 17 MiB
    bomb = zlib.compress(payload, 9)
    assert len(bomb) < 100_000
    redis_conn.hset(
        keys.rq_job_key("bomb"),
        mapping={
            "data": bomb,
            "origin": "bombs",
            "status": "queued",
            "created_at": "2026-01-01T12:00:00.000000Z",
        },
    )
    redis_conn.rpush(q.key, "bomb")
    behind = q.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    assert w.work(burst=True)
    (_, entry), *_ = redis_conn.xrange(keys.dead_letter_key("bombs"))
    assert entry[b"job_id"] == b"bomb"
    assert b"inflates to more than 16777216 bytes" in entry[b"reason"], entry
    assert behind.get_status(refresh=True) == "failed"  # it was read and run (by nobody here)
    assert "runs no jobs.score jobs" in (behind.latest_result().exc_string or "")
    assert w.fatal_error is None
    claimer_view = JobClaimer(redis_conn, JSONSerializer)  # a claim's look never inflates it either
    redis_conn.rpush(q.key, "bomb")
    assert claimer_view.claim(q, lambda _queued: True, limit=4) == []


def test_a_job_taken_again_after_it_started_or_ended_is_not_run_twice(
    redis_conn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """After a Sentinel failover the new primary can hold a queue from before a take while the job's
    start (or end) was written there again: the same id is waiting a second time. Taken again, by a
    claim or by RQ's own dequeue, it is not run: its records stay, its id leaves the intermediate list."""
    q = Queue("again", connection=redis_conn, serializer=JSONSerializer)
    w = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())
    w.register_birth()
    running, ended = (
        q.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "a", "candidates": ["b"]}]},))
        for _ in range(2)
    )
    for _ in range(2):
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    _, ended_run = w.batches.start([running, ended], q)
    w.batches.succeed(ended_run, {"rows": []})

    redis_conn.rpush(q.key, running.id, ended.id)  # the replayed queue
    for _ in range(2):  # a claim takes both again
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    taken = [Job.fetch(j.id, connection=redis_conn, serializer=JSONSerializer) for j in (running, ended)]
    with caplog.at_level("WARNING", logger="mlxq.worker.rq_worker"):
        assert w.start(taken, q) == []
    assert len(running.get_executions()) == 1 and running.get_status(refresh=True) == "started"
    assert ended.get_status(refresh=True) == "finished"
    assert redis_conn.llen(q.intermediate_queue_key) == 0
    said = [r.getMessage() for r in caplog.records if "taken again" in r.getMessage()]
    assert len(said) == 2 and "while started" in said[0] and "while finished" in said[1]

    twice = q.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "c", "candidates": ["d"]}]},))
    redis_conn.rpush(q.key, twice.id)  # waiting twice, and taken twice in one claim
    for _ in range(2):
        redis_conn.lmove(q.key, q.intermediate_queue_key, "LEFT", "RIGHT")
    copies = [Job.fetch(twice.id, connection=redis_conn, serializer=JSONSerializer) for _ in range(2)]
    assert [run.job.id for run in w.start(copies, q)] == [twice.id]
    assert len(twice.get_executions()) == 1 and redis_conn.llen(q.intermediate_queue_key) == 0

    redis_conn.rpush(q.key, ended.id)  # and RQ's own dequeue, by a worker that runs no score jobs (a
    other = MlxqWorker([q], connection=redis_conn, stream_options=StreamOptions())  # job it ran would fail)
    other.work(burst=True)
    assert ended.get_status(refresh=True) == "finished" and q.failed_job_registry.count == 0
    assert redis_conn.llen(q.key) == 0 and redis_conn.llen(q.intermediate_queue_key) == 0


def test_the_command_channel_lets_a_done_worker_exit_at_once(redis_conn: redis.Redis) -> None:
    """RQ stops the worker's pubsub thread after unsubscribing; with redis-py 8.2 that stop waits for
    the thread, and a thread that had already seen the unsubscribe sat out RQ's 60 s wait for a new
    subscription: burst workers that were done took a minute to exit. Here the thread is put in that
    state first, and the worker's unsubscribe still returns within its one-second bounds."""
    w = MlxqWorker(["exit"], connection=redis_conn, stream_options=StreamOptions())
    w.subscribe()
    assert w.pubsub_thread is not None
    w.pubsub.unsubscribe()  # the thread reads the reply and then waits for a subscription
    deadline = time.monotonic() + 10
    while w.pubsub.subscribed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not w.pubsub.subscribed
    time.sleep(0.2)  # into get_message's wait for a subscription
    started = time.monotonic()
    w.unsubscribe()
    assert time.monotonic() - started < 10  # was sleep_time, 60 s


class _ReenteredStderr(logging.Handler):
    """A log handler whose write fails as a stream's does when a signal handler's log line lands in
    the middle of another write to it (and logging's own error report fails the same way)."""

    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")


def test_a_stop_signal_landing_mid_write_to_stderr_still_stops_the_worker(redis_conn: redis.Redis) -> None:
    """RQ's warm-stop handler logs before it records the stop: a log write that re-enters stderr must
    not unwind it (the worker would go on as if never asked); a second signal cancels all the same."""
    w = MlxqWorker(["signals"], connection=redis_conn, stream_options=StreamOptions())
    w.set_state(WorkerStatus.BUSY)
    rq_log, ours = logging.getLogger("rq.worker"), logging.getLogger(rq_worker.__name__)
    failing = _ReenteredStderr()
    levels = (rq_log.level, ours.level)
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    for logger in (rq_log, ours):
        logger.addHandler(failing)
        logger.setLevel(logging.INFO)
    try:
        w.request_stop(signal.SIGTERM, None)
        assert w._stop_requested
        assert signal.getsignal(signal.SIGTERM) == w.request_force_stop
        w._watch = JobWatch(w, [], beat_s=10.0, poll_s=0.1)
        w.request_force_stop(signal.SIGTERM, None)  # the second signal: cancel the running jobs
        assert w._force_stop
    finally:
        for logger, level in zip((rq_log, ours), levels, strict=True):
            logger.removeHandler(failing)
            logger.setLevel(level)
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
