"""What a warm prefix's second time to first token is made of, many times over
(`python3 -m bench.warm_probe [--model llama-1b] [--reps 12] [--prefix 8192]`; prints tables, ~1 minute
on the H200; `--model tiny --prefix 1024` here).

The `warm_cache` figure takes the median of three pairs, and its second TTFTs have ranged 2.9-13 ms
on the H200 for the same code. Here each repetition takes a fresh prefix and runs, in an order that
turns every repetition, three pairs (a cold first request on the prefix, then a second with a new tail):

- `back to back`: the second right after the first returned (as the figure does);
- `settled`: before the second, the device finishes (`mx.synchronize`) and Python's garbage collector
  runs, then 20 ms pass: what is left is the second request's own cost;
- `phases`: the second with each phase forced to finish before the next (`fig_diagnose._patched`):
  tokenizing, the cache lookup with its KV gathered, the tail's prefill with its logits evaluated.

Per second request also: the garbage collector's time inside it (`gc.callbacks`) and MLX's active and
cached memory just before it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

import worker.engine.engine
from bench.checkpoints import checkpoint
from bench.fig_diagnose import _BEGIN, _patched
from bench.prompts import PromptMaker
from jobs.schema import GenerateRequest
from worker.engine import Engine

from .common import phase_timers

VARIANTS = ("back to back", "settled", "phases")
PHASES = {
    "tokenize": (Engine, "prompt_tokens"),
    "lookup + KV gathered": (Engine, _BEGIN),
    "prefill + logits": (worker.engine.engine, "prefill"),
}


class _GcClock:
    """Seconds the garbage collector ran since `reset`."""

    def __init__(self) -> None:
        self.total = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.total = 0.0


def _ttft(engine: Engine, text: str) -> float:
    request = GenerateRequest.model_validate({"prompt": text, "max_tokens": 1, "temperature": 0.0})
    first: list[float] = []
    t0 = time.perf_counter()
    engine.generate(request, lambda _t, _ids: first.append(time.perf_counter()))
    return first[0] - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.warm_probe")
    p.add_argument("--model", default="llama-1b", help="a bench checkpoint name (bench.checkpoints)")
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--prefix", type=int, default=8192, help="prefix tokens")
    p.add_argument("--tail", type=int, default=16, help="tail tokens")
    a = p.parse_args(argv)
    engine = Engine.load(str(checkpoint(a.model, Path.home() / ".cache/mlxq/bench-models")))
    maker = PromptMaker(engine.tokenizer, seed=3)
    clock = _GcClock()
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for rep in range(a.reps + 1):  # the first warms up
        turn = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
        for variant in turn:
            prefix = maker.pieces(a.prefix - maker.special)
            first = _ttft(engine, prefix + maker.pieces(a.tail))
            if variant == "settled":
                mx.synchronize()
                gc.collect()
                time.sleep(0.02)
            row = {"first ms": first * 1e3, "active MiB": mx.get_active_memory() / 2**20}
            row["cached MiB"] = mx.get_cache_memory() / 2**20
            clock.reset()
            second = prefix + maker.pieces(a.tail)
            if variant == "phases":
                with _patched(engine), phase_timers(PHASES) as phases:
                    row["second ms"] = _ttft(engine, second) * 1e3
                row.update({k: 1e3 * v["s"] for k, v in phases.items()})
            else:
                row["second ms"] = _ttft(engine, second) * 1e3
            row["gc ms"] = clock.total * 1e3
            row["ratio %"] = 100 * row["second ms"] / row["first ms"]
            if rep:
                rows[variant].append(row)
    print(f"model={a.model} prefix={a.prefix} tail={a.tail} reps={a.reps} (ms unless named)")
    for variant in VARIANTS:
        print(f"\n{variant}: median (min-max); each repetition's second ms:", end=" ")
        print(", ".join(f"{r['second ms']:.1f}" for r in rows[variant]))
        print("| value | median | min | max |\n| --- | --- | --- | --- |")
        for key in rows[variant][0]:
            v = [r[key] for r in rows[variant]]
            print(f"| {key} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")


if __name__ == "__main__":
    main()
