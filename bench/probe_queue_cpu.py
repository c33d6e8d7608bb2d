"""Probe (issue 29): a claimed job's restore and its end's changed fields, microseconds a job, in
whichever tree is first on PYTHONPATH (run it against two trees in turn). Needs a Redis URL; uses and
empties DB 9 of it: `python -m bench.probe_queue_cpu redis://127.0.0.1:6395/9`."""

from __future__ import annotations

import statistics
import sys
import time
from functools import lru_cache

import redis
from rq import Queue
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from mlxq.worker import job_claim, rq_batches
from mlxq.worker.bounded_job import BoundedJob


def main(url: str, n: int = 640, reps: int = 20) -> None:
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    q = Queue("probe", connection=conn, serializer=JSONSerializer)
    payload = {
        "rows": [{"prompt": "hello world this is a prompt of sixteen tokens", "candidates": [" a", " b"]}]
    }
    hashes = [
        (job.id, conn.hgetall(job.key)) for job in (q.enqueue("mlxq.jobs.score", payload) for _ in range(n))
    ]
    at = now()
    stamp = utcformat(at).encode()
    started = {b"started_at": stamp, b"last_heartbeat": stamp, b"worker_name": b"w", b"status": b"started"}

    def restore_all() -> list[BoundedJob]:
        jobs = [job_claim._restored(job_id, dict(fields), conn, JSONSerializer) for job_id, fields in hashes]
        assert all(isinstance(job, BoundedJob) and job.stored_fields is not None for job in jobs)
        return jobs  # type: ignore[return-value]

    def start(jobs: list[BoundedJob]) -> None:  # as the start script leaves a job
        for job in jobs:
            job.started_at = job.last_heartbeat = at
            job.worker_name = "w"
            assert job.stored_fields is not None
            job.stored_fields.update(started)

    def end(jobs: list[BoundedJob]) -> None:  # batches of 64, a date memory each (as `_end_call`)
        for i in range(0, len(jobs), 64):
            date_text = lru_cache(maxsize=8)(utcformat)
            for job in jobs[i : i + 64]:
                rq_batches.RqBatches._changed_fields(None, job, at, date_text)  # type: ignore[arg-type]

    restore_s, end_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        jobs = restore_all()
        restore_s.append((time.perf_counter() - t0) / n * 1e6)
        start(jobs)
        t0 = time.perf_counter()
        end(jobs)
        end_s.append((time.perf_counter() - t0) / n * 1e6)
    print(f"restore (claim): {statistics.median(restore_s):.2f} us/job (min {min(restore_s):.2f})")
    print(f"changed fields (end): {statistics.median(end_s):.2f} us/job (min {min(end_s):.2f})")
    conn.flushdb()


if __name__ == "__main__":
    main(sys.argv[1])
