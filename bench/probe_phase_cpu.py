"""TEMPORARY probe: a burst worker in-process over N one-row score jobs; CPU time (thread_time) per
score phase and a cProfile per phase (each on its own thread). Usage:
python -m bench.probe_phase_cpu N [profile]"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from bench.checkpoints import checkpoint
from bench.prompts import PromptMaker
from bench.queue_client import enqueue_many
from mlxq.worker import score_phases
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.settings import WorkerSettings

N = int(sys.argv[1])
PROFILE = len(sys.argv) > 2 and sys.argv[2] == "profile"
URL = os.environ.get("PROBE_REDIS", "redis://127.0.0.1:6391/5")
tiny = checkpoint("tiny", Path.home() / ".cache" / "mlxq" / "bench-models")
conn = redis.Redis.from_url(URL)
conn.flushdb()
maker = PromptMaker(Tokenizer.from_dir(str(tiny)), seed=5)
payloads = []
for _ in range(N):
    p = maker.prompt(16)
    payloads.append({"rows": [{"prompt": p, "candidates": maker.candidates(p, 2)}]})

cpu: dict[str, float] = defaultdict(float)
wall: dict[str, float] = defaultdict(float)
profs: dict[str, cProfile.Profile] = {}
orig = score_phases.ScorePhases.timed


@contextmanager
def timed(self, phase, aside=False):
    key = f"{phase}{' (aside)' if aside else ''}"
    t0, c0 = time.perf_counter(), time.thread_time()
    prof = profs.setdefault(key, cProfile.Profile()) if PROFILE else None
    if prof is not None:
        prof.enable()
    try:
        with orig(self, phase, aside):
            yield
    finally:
        if prof is not None:
            prof.disable()
        cpu[key] += time.thread_time() - c0
        wall[key] += time.perf_counter() - t0


score_phases.ScorePhases.timed = timed
from mlxq.worker.service import WorkerService  # noqa: E402

settings = WorkerSettings(model=str(tiny), queues=["probe"], redis_url=URL, name=f"probe-{os.getpid()}")
service = WorkerService.start(settings)
if os.environ.get("PROBE_FREEZE"):
    import gc

    gc.freeze()
if os.environ.get("PROBE_THRESH"):
    import gc

    gc.set_threshold(int(os.environ["PROBE_THRESH"]), 10, 10)
q = Queue("probe", connection=conn, serializer=JSONSerializer)
enqueue_many(q, "jobs.score", payloads)
t0 = time.perf_counter()
c0 = time.process_time()
service.work(burst=True)
dt = time.perf_counter() - t0
pc = time.process_time() - c0
stats = dict(service.stats.latest)
batches = int(stats.get("score_batches", 0))
jobs = int(stats.get("score_jobs", 0))
print(
    json.dumps(
        {
            "jobs": jobs,
            "batches": batches,
            "wall_s": dt,
            "process_cpu_s": pc,
            "load": os.getloadavg()[0],
            "cpu_ms_per_batch": {k: 1000 * v / batches for k, v in sorted(cpu.items())},
            "wall_ms_per_batch": {k: 1000 * v / batches for k, v in sorted(wall.items())},
            "cpu_us_per_job": {k: 1e6 * v / jobs for k, v in sorted(cpu.items())},
        }
    )
)
if PROFILE:
    for key, prof in profs.items():
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(30)
        print(f"===== {key}\n{s.getvalue()}")
