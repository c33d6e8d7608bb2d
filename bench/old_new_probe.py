"""Temporary probe (run on the H200, 2026-12-04): one job's decode with HEAD's engine against an older
commit's, in one process on the same weights, in rotating turns. Usage, with `.bench-src` (HEAD, `git
archive HEAD mlxq worker jobs producer bench pyproject.toml`) and `.bench-old` (`git archive e9cbd52
worker jobs producer bench pyproject.toml`) beside each other: `python3 bench/old_new_probe.py ROOT 30`.
The old tree imports as `worker`/`jobs`, the new one as `mlxq.*`, so both load side by side."""

import glob
import statistics
import sys
import time

R = sys.argv[1]
sys.path[:0] = [f"{R}/.bench-src", f"{R}/.bench-old"]
from jobs.schema import GenerateRequest as OldReq  # noqa: E402
from worker.engine import Engine as OldEngine  # noqa: E402
from worker.engine.generation_batch import generate as old_generate  # noqa: E402

from mlxq.jobs.schema import GenerateRequest as NewReq  # noqa: E402
from mlxq.worker.engine import Engine as NewEngine  # noqa: E402
from mlxq.worker.engine.generation_batch import generate as new_generate  # noqa: E402

model = glob.glob("/root/.cache/mlxq/bench-models/llama-1b")[0]
old, new = OldEngine.load(model), NewEngine.load(model)
n = 256
prompt = "The history of the queue worker began " * 8


def run(engine, gen, req):  # type: ignore[no-untyped-def]
    times = []

    def sink(delta, ids):  # type: ignore[no-untyped-def]
        times.append((time.perf_counter(), len(ids)))

    payload = {"prompt": prompt, "max_tokens": n, "temperature": 0.0}
    payload["logit_bias"] = {str(i): -100.0 for i in engine.tokenizer.eos_ids}
    gen(engine, req.model_validate(payload), sink)
    return sum(k for _, k in times[1:]) / (times[-1][0] - times[0][0])


paths = {"old": (old, old_generate, OldReq), "new": (new, new_generate, NewReq)}
res: dict[str, list[float]] = {"old": [], "new": []}
for rep in range(int(sys.argv[2]) + 2):
    for k in ["old", "new"] if rep % 2 == 0 else ["new", "old"]:
        r = run(*paths[k])
        if rep >= 2:
            res[k].append(r)
for k, v in res.items():
    print(k, "median", round(statistics.median(v), 1), "range", round(min(v), 1), round(max(v), 1))
ratios = [b / a for a, b in zip(res["old"], res["new"], strict=True)]
print("new/old per rep median", round(statistics.median(ratios), 3), min(ratios), max(ratios))
