"""Probe: one batching worker under cProfile, serving N generation jobs enqueued at once.

    python -m bench.profile_batch [--model tiny|llama-1b|PATH] [--jobs 64] [--max-tokens 128]
        [--prompt-words 48] [--redis-url URL|private]

A real worker process (`bench.worker_proc`, `MLXQ_MAX_BATCH_SEQUENCES=--jobs`) runs the jobs of
`bench.batch_generate` twice (the first run meets every shape); prints the second run's tokens/s and
phase timers, then the worker's profile of both runs (top functions by own time, then by cumulative
time within rq/worker/jobs/redis).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

from .batch_generate import _payloads, run_jobs
from .checkpoints import checkpoint
from .queue_client import BenchWorker, private_redis


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_batch")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = ap.parse_args(argv)
    model = str(checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models"))
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(private_redis()) if args.redis_url == "private" else args.redis_url
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        env = {"MLXQ_MAX_BATCH_SEQUENCES": str(args.jobs)}
        worker = BenchWorker(model, url, workdir, "profile", env=env, cprofile=True).start()
        try:
            worker.wait_ready()
            for label in ("first", "measured"):
                payloads = _payloads(args.jobs, args.max_tokens, args.prompt_words, f"{label}-")
                run = run_jobs(worker, payloads, label, 600)
            phases = {k: round(v, 3) if isinstance(v, float) else v for k, v in run.phases.items()}
            print(f"{args.jobs} jobs x {args.max_tokens} tokens: {run.wall_s:.3f} s, ")
            print(f"{run.tokens / run.wall_s:,.0f} tok/s; phases {phases}")
        finally:
            worker.stop()
        time.sleep(0.5)
        assert worker.profile_path is not None
        print(worker.profile_path.read_text() if worker.profile_path.exists() else "no profile written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
