"""Probe: decode steps launched on a thread of their own (`worker.engine.launcher`), with Python's thread switch
interval as the launcher sets it and as Python's default (5 ms), against the way a GPU worker stepped
before `ccf04c3` (the launch on the loop's thread, the tokens handled on an overlap thread meanwhile),
and against no overlap at all, alternating in one process.

    python -m bench.launcher_ab [--model llama-1b] [--rows 64] [--context 128] [--steps 64] [--rounds 4]
        [--handle-us 400]

Each round, for each way: `--rows` ragged rows (the kernel where it runs) decoded freely for `--steps`
steps, each step's tokens handed to a Python function that holds the GIL for `--handle-us`
microseconds (a stand-in for the rows' token handling: text, stop strings, streams); ms a step. First,
32 greedy steps of the same prompts each way, whose tokens must agree row for row. Prints tables, no
JSON; ~1 minute on the H200.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from worker.engine.generate import DecodeBatch, prefill
from worker.engine.launcher import Launcher
from worker.engine.sampler import Sampler

from .checkpoints import checkpoint

WAYS = ("launcher", "launcher, 5 ms switch", "overlap", "plain")
T = TypeVar("T")


class _Overlapped(DecodeBatch):
    """The step as it was before the launcher: the next step built and launched on this thread, the
    tokens handled on a one-thread executor meanwhile."""

    def __init__(self, model: Any, pool: Executor, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.pool = pool

    def step_with(self, handle: Callable[[list[int]], T], ends_all: Callable[[T], bool] | None = None) -> T:
        if self._fresh:
            return super().step_with(handle, ends_all)
        assert self._pending is not None
        pending = self._pending
        next_tokens = self._next_step(pending)
        handled: Future[T] = self.pool.submit(handle, [int(t) for t in pending.tolist()])
        mx.async_eval(next_tokens)
        result = handled.result()
        self._stepped()
        return result


def _batch(engine: Any, way: str, rows: int, context: int, pools: dict[str, Any]) -> DecodeBatch:
    random.seed(rows * 1000 + context)
    vocab = engine.model.args.vocab_size
    if way == "overlap":
        batch: DecodeBatch = _Overlapped(engine.model, pools["overlap"], pad_shapes=True, ragged_kernel=None)
    else:
        launcher = pools["launcher"] if way.startswith("launcher") else None
        batch = DecodeBatch(engine.model, pad_shapes=True, ragged_kernel=None, launcher=launcher)
    caches, logits, samplers = [], [], []
    for i in range(rows):
        n = context - (i * 7) % 48
        cache = engine.model.make_cache()
        logits.append(prefill(engine.model, [random.randrange(100, 1000) for _ in range(n)], cache, 4096))
        caches.append(cache)
        samplers.append(Sampler(vocab, temperature=0.0, logit_bias={0: -100.0}))
    joined = mx.concatenate(logits)
    mx.eval(joined, [c.state for cache in caches for c in cache])
    batch.add(caches, joined, samplers)
    return batch


def _handler(us: float) -> Any:
    def handle(tokens: list[int]) -> list[int]:
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass
        return tokens

    return handle


def _sync(batch: DecodeBatch, launcher: Launcher) -> None:
    batch.quiet()
    mx.synchronize(launcher.stream)
    mx.synchronize()


def _time(batch: DecodeBatch, launcher: Launcher, steps: int, handle: Any, way: str) -> float:
    switch = sys.getswitchinterval()
    if way == "launcher, 5 ms switch":
        sys.setswitchinterval(0.005)
    try:
        return _time_steps(batch, launcher, steps, handle)
    finally:
        sys.setswitchinterval(switch)


def _time_steps(batch: DecodeBatch, launcher: Launcher, steps: int, handle: Any) -> float:
    for _ in range(4):
        batch.step_with(handle)
    _sync(batch, launcher)
    t0 = time.perf_counter()
    for _ in range(steps):
        batch.step_with(handle)
    _sync(batch, launcher)
    return (time.perf_counter() - t0) / steps * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.launcher_ab")
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--handle-us", type=float, default=400.0)
    args = ap.parse_args(argv)
    from worker.engine.engine import Engine

    engine = Engine.load(str(checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models")))
    launcher = Launcher()
    pools = {"overlap": ThreadPoolExecutor(1), "launcher": launcher}
    b, n = args.rows, args.context
    tokens = {}
    for way in WAYS:
        batch = _batch(engine, way, b, n, pools)
        tokens[way] = [batch.step() for _ in range(32)]
        _sync(batch, launcher)
    print(
        f"model={args.model} rows={b} context~{n} device={mx.default_device()} handle={args.handle_us} us "
        f"switch interval {sys.getswitchinterval() * 1e6:.0f} us"
    )
    for way in WAYS[1:]:
        same = sum(
            all(x[r] == y[r] for x, y in zip(tokens[WAYS[0]], tokens[way], strict=True)) for r in range(b)
        )
        print(f"same 32 greedy tokens, {WAYS[0]} vs {way}: {same}/{b} rows")
    handle = _handler(args.handle_us)
    free: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            batch = _batch(engine, way, b, n, pools)
            free[way].append(_time(batch, launcher, args.steps, handle, way))
            del batch
    print("\nms a step stepping freely, median of the rounds (min-max)\n")
    print("| way | ms a step | tok/s | vs overlap |")
    print("| --- | --- | --- | --- |")
    base = statistics.median(free["overlap"])
    for way in WAYS:
        m = statistics.median(free[way])
        spread = f"{min(free[way]):.2f}-{max(free[way]):.2f}"
        print(f"| {way} | {m:.2f} ({spread}) | {b / m * 1000:,.0f} | {base / m:.2f}x |")
    print("\neach round:", {w: [round(x, 2) for x in free[w]] for w in WAYS})
    launcher.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
