"""Probe (temporary): one job through the queue on the old lone path, the old batch path and the new
single path, in turns, in one run.

Real `mlxq worker` processes on one model, each on its own queue: `old-lone` and `old-batch` run the
code of `--old-root` (a checkout from before the lone path was deleted; `old-lone` with
`MLXQ_MAX_BATCH_SEQUENCES=1` and `MLXQ_SCORE_BATCH_ROWS=0`, which took the lone path there), `new` runs
this checkout with its defaults (every job a batch, a lone job a batch of one). Each repetition sends
one generation job and one score job to each worker, the order rotating; the first `--warmup`
repetitions are discarded. Prints per-rep figures and the median and range of each, as JSON too.
Without `--old-root`: the lone and batch configurations of this checkout only.

`python -m bench.one_path_ab --model tiny|llama-1b [--reps 10] [--old-root DIR]`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import checkpoint
from bench.prompts import PromptMaker
from producer import Client
from worker.engine.text.tokenizer import Tokenizer

LONE = {"MLXQ_MAX_BATCH_SEQUENCES": "1", "MLXQ_SCORE_BATCH_ROWS": "0"}
ROOT = str(Path(__file__).resolve().parents[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--own", type=int, default=16)
    p.add_argument("--cands", type=int, default=8)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    p.add_argument("--out", default="")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "mlxq" / "bench-models"))
    p.add_argument("--old-root", default="")
    a = p.parse_args()
    if a.old_root:
        configs = {"old-lone": (a.old_root, LONE), "old-batch": (a.old_root, {}), "new": (ROOT, {})}
    else:
        configs = {"lone": (ROOT, LONE), "batch": (ROOT, {})}
    path = checkpoint(a.model, Path(a.cache_dir))
    tok = Tokenizer.from_dir(path)
    maker = PromptMaker(tok, seed=1)
    bias = {i: -100.0 for i in tok.eos_ids}
    logs = Path(tempfile.mkdtemp())
    procs = []
    for name, (root, env) in configs.items():
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "producer.cli", "worker", "--model", str(path)]
        cmd += ["--queue", f"ab-{name}", "--redis-url", a.redis_url, "--log-level", "WARNING"]
        pythonpath = os.pathsep.join(
            [root, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
        )
        full_env = {**os.environ, **env, "PYTHONPATH": pythonpath}
        procs.append(subprocess.Popen(cmd, env=full_env, cwd=root, stdout=log, stderr=subprocess.STDOUT))
    per: dict[str, dict[str, list[float]]] = {n: {"decode_tok_s": [], "score_rows_s": []} for n in configs}
    try:
        with Client(a.redis_url) as client:
            for rep in range(a.warmup + a.reps):
                gen_prompt = maker.prompt(32)
                prefix = maker.pieces(a.prefix)
                rows = []
                for _ in range(a.rows):
                    prompt = prefix + maker.pieces(a.own)
                    rows.append({"prompt": prompt, "candidates": maker.candidates(prompt, a.cands)})
                names = list(configs)
                names = names[rep % len(names) :] + names[: rep % len(names)]
                if (rep // len(names)) % 2:
                    names.reverse()
                line: dict[str, Any] = {"rep": rep}
                for name in names:
                    h = client.submit_generate(
                        gen_prompt, max_tokens=a.tokens, temperature=0, logit_bias=bias, queue=f"ab-{name}"
                    )
                    r = h.result(timeout=900)
                    t0 = time.perf_counter()
                    s = client.submit_score(rows, queue=f"ab-{name}")
                    s.result(timeout=900)
                    rows_s = a.rows / (time.perf_counter() - t0)
                    line[name] = (r.timings.decode_tokens_per_s, rows_s)
                    if rep >= a.warmup:
                        per[name]["decode_tok_s"].append(r.timings.decode_tokens_per_s or 0.0)
                        per[name]["score_rows_s"].append(rows_s)
                print(json.dumps(line), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    summary: dict[str, Any] = {"model": a.model, "reps": a.reps, "tokens": a.tokens, "prefix": a.prefix}
    base = next(iter(configs))
    for fig in ("decode_tok_s", "score_rows_s"):
        summary[fig] = {n: _spread(per[n][fig]) for n in configs}
        for n in list(configs)[1:]:
            ratios = [x / b for x, b in zip(per[n][fig], per[base][fig], strict=True)]
            summary[fig][f"{n}/{base}"] = _spread(ratios)
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "per": per}, indent=1))


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    main()
