"""Temporary probe: the CPU bench shape (64 rows, 512-token prefix, 64 own) through engine.score_many,
rows in place (cascade, at several score-block sizes) against a copy per row; peak and time."""

import random
import statistics
import sys
import time

import mlx.core as mx

from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.cache import shared_prefix as sp

e = Engine.load("/root/.cache/mlxq/bench-models/tiny", EngineOptions(prefix_cache_bytes=0))
rng = random.Random(0)
V = e.model.args.vocab_size


def job():
    p = [rng.randrange(100, V) for _ in range(512)]
    return [(p + [rng.randrange(100, V) for _ in range(64)], list(range(10, 18))) for _ in range(64)]


cls = type(e.model)
orig = cls.reads_shared_prefix


def run(mode):
    if mode == "copy":
        cls.reads_shared_prefix = property(lambda s: False)
    else:
        cls.reads_shared_prefix = orig
        sp.SCORE_BLOCK_BYTES = mode
    j = job()
    mx.synchronize()
    a0 = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    e.score_many([j])
    dt = time.perf_counter() - t0
    return dt, (mx.get_peak_memory() - a0) / 2**20


modes = ["copy", 1 << 22, 1 << 23, 1 << 21]
res = {m: [] for m in modes}
for turn in range(int(sys.argv[1])):
    for m in modes[turn % 4 :] + modes[: turn % 4]:
        r = run(m)
        if turn:
            res[m].append(r)
for m, rs in res.items():
    print(m, f"time med {statistics.median(x[0] for x in rs):.3f}", f"peak MiB {max(x[1] for x in rs):.1f}")
