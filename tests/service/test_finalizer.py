"""The finalizer thread: jobs end through RQ in order, those handed over while it was busy together,
off the calling thread; close waits; a failing end leaves the thread alive."""

from __future__ import annotations

import threading
from typing import Any

import redis
from rq import Queue
from rq.job import Job

from mlxq.worker.finalizer import Finalizer
from mlxq.worker.job_runs import Ended, Run

REDIS_DB = 9


def test_jobs_end_in_order_together_off_the_calling_thread_and_close_waits(redis_conn: redis.Redis) -> None:
    queue = Queue("finalizer", connection=redis_conn)
    jobs = [Job.create(func=print, connection=redis_conn) for _ in range(20)]
    calls: list[tuple[list[tuple[str, Any]], str]] = []
    gate = threading.Event()

    def end(batch: list[Ended]) -> None:
        gate.wait(5)
        calls.append(([(run.job.id, value) for run, value in batch], threading.current_thread().name))

    finalizer = Finalizer(end)
    for i, job in enumerate(jobs):
        finalizer.submit(Run(job, queue, None), {"n": i})  # type: ignore[arg-type]
    assert calls == []  # submitting never waits for RQ
    gate.set()
    finalizer.close()
    assert [item for batch, _ in calls for item in batch] == [(j.id, {"n": i}) for i, j in enumerate(jobs)]
    assert {thread for _, thread in calls} == {"mlxq-finalizer"}
    # What was handed over when the thread woke ends in one call, all handed over while it waited in
    # the next: two calls at most for 20 jobs.
    assert 1 <= len(calls) <= 2


def test_an_end_that_raises_is_logged_and_later_jobs_still_end(redis_conn: redis.Redis) -> None:
    queue = Queue("finalizer", connection=redis_conn)
    jobs = [Job.create(func=print, connection=redis_conn) for _ in range(2)]
    ended: list[str] = []

    def end(batch: list[Ended]) -> None:
        if batch[0][0].job is jobs[0]:
            raise redis.ConnectionError("Redis went away")  # logged; the thread goes on
        ended.extend(run.job.id for run, _ in batch)

    finalizer = Finalizer(end)
    finalizer.submit(Run(jobs[0], queue, None), None)  # type: ignore[arg-type]
    finalizer.close()
    finalizer.submit(Run(jobs[1], queue, None), None)  # type: ignore[arg-type]
    finalizer.close()
    assert ended == [jobs[1].id]


def test_a_batchs_last_jobs_end_on_the_callers_thread_after_those_handed_over_before(
    redis_conn: redis.Redis,
) -> None:
    """`end_now`: the jobs a batch ends with are ended on its own thread (nothing is left to overlap
    with them), once every job handed over before has ended on the finalizer's; a failing end is
    logged there as on the thread, never raised into the batch."""
    queue = Queue("finalizer", connection=redis_conn)
    jobs = [Job.create(func=print, connection=redis_conn) for _ in range(4)]
    calls: list[tuple[list[str], str]] = []

    def end(batch: list[Ended]) -> None:
        calls.append(([run.job.id for run, _ in batch], threading.current_thread().name))
        if batch[0][0].job is jobs[3]:
            raise redis.ConnectionError("Redis went away")

    finalizer = Finalizer(end)
    finalizer.submit_many([(Run(j, queue, None), None) for j in jobs[:2]])  # type: ignore[arg-type]
    finalizer.end_now([(Run(jobs[2], queue, None), None)])  # type: ignore[arg-type]
    assert calls == [([jobs[0].id, jobs[1].id], "mlxq-finalizer"), ([jobs[2].id], "MainThread")]
    finalizer.end_now([(Run(jobs[3], queue, None), None)])  # type: ignore[arg-type]
    assert calls[-1] == ([jobs[3].id], "MainThread")
    finalizer.end_now([])  # nothing handed over, nothing to end
    assert len(calls) == 3
