"""TEMPORARY probe: the bench's `queue` figure (`fig_score.queue_overhead`) without mlx-lm (not
installed here): CPU sizes, the batched passes (pipeline on, off) and, with PROFILE=1, the cProfile
pass, whose profiles are written beside. One JSON line a pass. Run from the tree under test:
PYTHONPATH=. python bench/probe_queue2.py LABEL REDIS_URL OUTDIR [PROFILE]"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import redis

from bench.checkpoints import checkpoint
from bench.common import SIZES, Bench
from bench.fig_score import queue_overhead

label, url, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
profile = len(sys.argv) > 4 and sys.argv[4] == "1"
tiny = str(checkpoint("tiny", Path.home() / ".cache" / "mlxq" / "bench-models"))
sizes = dataclasses.replace(
    SIZES["cpu"],
    queue_jobs_unbatched=0,
    profile_jobs=1000 if profile else 0,
    queue_jobs=0 if profile else 5000,
)
conn = redis.Redis.from_url(url)
b = Bench(tiny, tiny, sizes, url, Path(tempfile.mkdtemp(prefix="q2-")), None, None, None, conn)  # type: ignore[arg-type]
load = os.getloadavg()[0]
out = queue_overhead(b)
out_dir.mkdir(parents=True, exist_ok=True)
for text in out["cprofile"].values():
    (out_dir / f"{label}.prof.txt").write_text(text)
for name, row in out["table"].items():
    keep = {k: row[k] for k in ("jobs", "finished", "jobs_s", "batches", "ms_per_job_outside_mlx")}
    phases = {k: round(v, 3) for k, v in row["score_phase_ms_per_batch"].items()}
    line = json.dumps({"label": label, "pass": name, "load": load, **keep, "phases": phases})
    print(line)
    with open(out_dir / "runs.jsonl", "a") as f:
        f.write(line + "\n")
