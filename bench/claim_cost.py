"""The host cost of one score batch's claim, alone: `python -m bench.claim_cost REDIS_URL [JOBS] [REPS]`.

Queues JOBS one-row score jobs as a producer does, claims them beside a first job as a score batch
does (`ScoreClaimer`), and prints the median wall and thread-CPU milliseconds of a claim over REPS
(the first five dropped). The thread's CPU time is the worker's own work (parsing, checking and
restoring jobs), which load from other processes on the host does not inflate as it does wall time.
Run it in two checkouts in alternating order to compare them. It empties the given Redis database.
"""

from __future__ import annotations

import statistics
import sys
import time

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from mlxq.worker.score_claim import ClaimBudget, ScoreClaimer


def main(url: str, jobs: int = 63, reps: int = 45) -> None:
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    queue = Queue("claim-cost", connection=conn, serializer=JSONSerializer)
    claimer = ScoreClaimer(conn, JSONSerializer, ClaimBudget())
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(reps):
        with conn.pipeline() as pipe:
            for i in range(jobs):
                row = {"prompt": f"hello {i}", "candidates": [" a", " b"]}
                queue.enqueue("jobs.score", {"rows": [row]}, pipeline=pipe)
            pipe.execute()
        t, c = time.perf_counter(), time.thread_time()
        claimed = claimer.claim(queue, rows_taken=1)
        wall.append(1000 * (time.perf_counter() - t))
        cpu.append(1000 * (time.thread_time() - c))
        if len(claimed) != jobs:
            raise SystemExit(f"claimed {len(claimed)} of {jobs} jobs")
        conn.flushdb()
    med_wall, med_cpu = statistics.median(wall[5:]), statistics.median(cpu[5:])
    print(f"claim of {jobs} jobs: wall {med_wall:.3f} ms, cpu {med_cpu:.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:4]))
