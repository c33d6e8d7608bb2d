"""TEMPORARY probe: a score batch's host phases without the model's forward, one thread: claim, RQ
start, tokenize (validation and the engine's row preparation), mlxq's writes, RQ's end, of 64-job
batches of one-row score jobs as the `queue` figure makes them. CPU ms a batch of each (thread clock,
median and range) and Python calls a job under cProfile.
PYTHONPATH=. python bench/probe_phases.py REDIS_URL BATCHES [profile-sort]"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from bench.checkpoints import checkpoint
from bench.prompts import PromptMaker
from bench.queue_client import enqueue_many
from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.job_results import JobResults
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.score_claim import ClaimBudget, ScoreClaimer
from mlxq.worker.score_jobs import ScoreJobs
from mlxq.worker.stream_writer import StreamOptions

url, B = sys.argv[1], int(sys.argv[2])
SORT = sys.argv[3] if len(sys.argv) > 3 else None
tiny = str(checkpoint("tiny", Path.home() / ".cache" / "mlxq" / "bench-models"))
engine = Engine.load(tiny)
conn = redis.Redis.from_url(url)
conn.flushdb()
q = Queue("p", connection=conn, serializer=JSONSerializer)
opts = StreamOptions()
w = MlxqWorker([q], connection=conn, stream_options=opts)
w.register_birth()
claimer = ScoreClaimer(conn, w.serializer, ClaimBudget(), w.dead_letters)
results = JobResults(conn, opts)
scores = ScoreJobs(engine, w, results, claimer)
tokenizer = engine.tokenizer.clone()
maker = PromptMaker(Tokenizer.from_dir(tiny), seed=5)
payloads = []
for _ in range(64 * (B + 2)):
    prompt = maker.prompt(16)
    payloads.append({"rows": [{"prompt": prompt, "candidates": maker.candidates(prompt, 2)}]})
enqueue_many(q, "jobs.score", payloads)
# One real batch scored, its results reused for every batch (the model's forward is not measured).
jobs0, _ = claimer.claim_batch(q)
runs0 = w.start(jobs0, q)
prep0 = scores._prepare(runs0, tokenizer)
res0 = engine.score_many(prep0)  # type: ignore[arg-type]
w.batches.succeed_many([(r, x.model_dump(mode="json")) for r, x in zip(runs0, res0, strict=True)])
gc.freeze()
gc_s = [0.0, 0.0, 0.0]
gc_n = [0, 0, 0]
_gc_t0 = [0.0]


def _gc_time(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_t0[0] = time.thread_time()
    else:
        gc_s[info["generation"]] += time.thread_time() - _gc_t0[0]
        gc_n[info["generation"]] += 1


gc.callbacks.append(_gc_time)

PHASES = ("claim", "start", "tokenize", "write", "end")
cpu: dict[str, list[float]] = {k: [] for k in PHASES}
profs = {k: cProfile.Profile() for k in PHASES}
jobs_seen = 0


def timed(name: str, fn: Any, *a: Any) -> Any:
    p = profs[name] if SORT else None
    c0 = time.thread_time()
    if p:
        p.enable()
    out = fn(*a)
    if p:
        p.disable()
    cpu[name].append(1000 * (time.thread_time() - c0))
    return out


for _ in range(B):
    jobs, _ = timed("claim", claimer.claim_batch, q)
    runs = timed("start", w.start, jobs, q)
    timed("tokenize", scores._prepare, runs, tokenizer)
    values = timed("write", results.finish_scores, [(r.job, res0[i % len(res0)]) for i, r in enumerate(runs)])
    timed("end", w.batches.succeed_many, list(zip(runs, values, strict=True)))
    jobs_seen += len(runs)
medians = " ".join(f"{k}={statistics.median(v):.2f}({min(v):.2f}-{max(v):.2f})" for k, v in cpu.items())
total = statistics.median([sum(v[i] for v in cpu.values()) for i in range(B)])
print(f"{medians} total={total:.2f} ms CPU a batch of {jobs_seen / B:.0f}")
print(
    "gc ms a batch by generation:",
    [round(1000 * t / B, 3) for t in gc_s],
    "passes a batch:",
    [n / B for n in gc_n],
)
if SORT:
    calls = {k: pstats.Stats(p).total_calls for k, p in profs.items()}  # type: ignore[attr-defined]
    print("calls a job:", " ".join(f"{k}={v / jobs_seen:.0f}" for k, v in calls.items()))
    for k, p in profs.items():
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats(SORT).print_stats(30)
        print("=====", k, s.getvalue())
