"""TEMPORARY probe: the bench's `queue` figure (`fig_score.queue_overhead`) run without loading mlx-lm
(not installed here), CPU sizes without the unbatched and cProfile passes; one JSON line out.
python -m bench.probe_ab LABEL REDIS_URL"""

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

label, url = sys.argv[1], sys.argv[2]
tiny = str(checkpoint("tiny", Path.home() / ".cache" / "mlxq" / "bench-models"))
sizes = dataclasses.replace(SIZES["cpu"], queue_jobs_unbatched=0, profile_jobs=0)
conn = redis.Redis.from_url(url)
b = Bench(tiny, tiny, sizes, url, Path(tempfile.mkdtemp(prefix="claim-ab-")), None, None, None, conn)  # type: ignore[arg-type]
load = os.getloadavg()[0]
out = queue_overhead(b)
for name, row in out["table"].items():
    keep = {k: row[k] for k in ("jobs", "finished", "jobs_s", "batches", "ms_per_job_outside_mlx")}
    phases = row["score_phase_ms_per_batch"]
    print(json.dumps({"label": label, "pass": name, "load": load, **keep, "phases": phases}))
