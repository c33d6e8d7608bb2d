"""TEMPORARY probe: claim, RQ start and RQ end of 64-job score batches in one thread, no model: CPU
time per batch of each, and a cProfile of each. python -m bench.probe_rq_cpu BATCHES [profile]"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from bench.queue_client import enqueue_many
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.score_claim import ClaimBudget, ScoreClaimer
from mlxq.worker.stream_writer import StreamOptions

B = int(sys.argv[1])
PROFILE = len(sys.argv) > 2
conn = redis.Redis(port=6391, db=6)
conn.flushdb()
q = Queue("p", connection=conn, serializer=JSONSerializer)
w = MlxqWorker([q], connection=conn, stream_options=StreamOptions())
w.register_birth()
claimer = ScoreClaimer(conn, JSONSerializer, ClaimBudget())
rows = [
    {"rows": [{"prompt": f"hello world number {i} of the batch", "candidates": [" a", " b"]}]}
    for i in range(64 * (B + 2))
]
enqueue_many(q, "jobs.score", rows)
cpu = {"claim": [], "start": [], "end": []}
profs = {k: cProfile.Profile() for k in cpu}


def timed(name, fn, *a):
    p = profs[name] if PROFILE else None
    c0 = time.thread_time()
    if p:
        p.enable()
    out = fn(*a)
    if p:
        p.disable()
    cpu[name].append(1000 * (time.thread_time() - c0))
    return out


for b in range(B + 1):
    jobs, _ = timed("claim", claimer.claim_batch, q)
    runs = timed("start", w.batches.start, jobs, q)
    timed("end", w.batches.succeed_many, [(r, {"rows": [{"scores": [0.1, 0.2]}]}) for r in runs])
    if b == 0:
        for v in cpu.values():
            v.clear()
        profs = {k: cProfile.Profile() for k in cpu}
medians = " ".join(f"{k}={statistics.median(v):.2f}({min(v):.2f}-{max(v):.2f})" for k, v in cpu.items())
print(medians, "ms CPU a batch of 64")
if PROFILE:
    for k, p in profs.items():
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats(sys.argv[2]).print_stats(25)
        print("=====", k, s.getvalue())
