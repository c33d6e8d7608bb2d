"""The finalizer thread: jobs end through RQ in order, a failing end fails the job, close waits."""

from __future__ import annotations

import threading
from typing import Any

import redis
from rq import Queue
from rq.job import Job

from worker.finalizer import Finalizer

REDIS_DB = 9


def test_jobs_end_in_order_off_the_calling_thread_and_close_waits(redis_conn: redis.Redis) -> None:
    queue = Queue("finalizer", connection=redis_conn)
    jobs = [Job.create(func=print, connection=redis_conn) for _ in range(20)]
    ended: list[tuple[str, Any, str]] = []
    gate = threading.Event()

    def success(job: Job, q: Queue, execution: Any, value: Any) -> None:
        gate.wait(5)
        ended.append((job.id, value, threading.current_thread().name))

    finalizer = Finalizer(success, lambda *a: None)
    for i, job in enumerate(jobs):
        finalizer.submit(job, queue, None, {"n": i})
    assert ended == []  # submitting never waits for RQ
    gate.set()
    finalizer.close()
    assert [(job_id, value) for job_id, value, _ in ended] == [(j.id, {"n": i}) for i, j in enumerate(jobs)]
    assert {thread for _, _, thread in ended} == {"mlxq-finalizer"}


def test_a_job_whose_end_fails_is_failed_with_the_reason_and_the_rest_go_on(redis_conn: redis.Redis) -> None:
    queue = Queue("finalizer", connection=redis_conn)
    jobs = [Job.create(func=print, connection=redis_conn) for _ in range(3)]
    finished: list[str] = []
    failed: list[tuple[str, str]] = []

    def success(job: Job, q: Queue, execution: Any, value: Any) -> None:
        if job is jobs[1]:
            raise RuntimeError("RQ could not save the result")
        finished.append(job.id)

    def failure(job: Job, q: Queue, execution: Any, exc_info: Any) -> None:
        failed.append((job.id, str(exc_info[1])))
        if job is jobs[1]:
            raise redis.ConnectionError("and Redis went away")  # logged; the thread goes on

    finalizer = Finalizer(success, failure)
    for job in jobs:
        finalizer.submit(job, queue, None, None)
    finalizer.close()
    assert finished == [jobs[0].id, jobs[2].id]
    assert failed == [(jobs[1].id, "RQ could not save the result")]
