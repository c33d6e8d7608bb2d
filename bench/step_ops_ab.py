"""Probe: a ragged decode step with q and k rotated by one RoPE and SwiGLU as one compiled op (the
model's code since they were made so) against the same step with two RoPEs and silu then multiply,
alternating in one process.

    python -m bench.step_ops_ab [--model llama-1b] [--rows 64] [--context 128] [--steps 64] [--rounds 4]

Each round, for each way: 64 rows (ragged, the kernel where it runs) decoded freely for `--steps` steps
(ms a step, as a worker steps them), then one step at a time split between device syncs (graph
building, launch, device after it; `bench.batch_step`'s anatomy); first, 32 greedy steps of the same
prompts each way, whose tokens must agree row for row (the two ways compute the same numbers).
Prints tables, no JSON; ~1 minute on the H200.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from worker.engine.models import llama

from .batch_step import _PARTS, _anatomy, _decode_batch, _time_steps
from .checkpoints import checkpoint


@contextmanager
def _apart() -> Iterator[None]:
    """The model as it was: q and k rotated one after the other, silu and multiply as two ops."""
    one, swiglu = llama.Attention._one_matmul, llama._swiglu
    llama.Attention._one_matmul = lambda self, x: False  # type: ignore[method-assign]
    llama._swiglu = lambda gate, up: nn.silu(gate) * up
    try:
        yield
    finally:
        llama.Attention._one_matmul = one  # type: ignore[method-assign]
        llama._swiglu = swiglu


@contextmanager
def _way(name: str) -> Iterator[None]:
    if name == "apart":
        with _apart():
            yield
    else:
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_ops_ab")
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    from worker.engine.engine import Engine

    engine = Engine.load(str(checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models")))
    b, n = args.rows, args.context
    ways = ("together", "apart")
    tokens = {}
    for way in ways:
        with _way(way):
            step, _ = _decode_batch(engine, b, n, True, False, None)
            tokens[way] = [step() for _ in range(32)]
    same = sum(
        all(x[r] == y[r] for x, y in zip(tokens["together"], tokens["apart"], strict=True)) for r in range(b)
    )
    print(f"model={args.model} rows={b} context~{n} device={mx.default_device()}")
    print(f"same 32 greedy tokens, together vs apart: {same}/{b} rows")
    free: dict[str, list[float]] = {w: [] for w in ways}
    parts: dict[str, dict[str, list[float]]] = {w: {k: [] for k in _PARTS} for w in ways}
    for r in range(args.rounds):
        for way in ways if r % 2 == 0 else ways[::-1]:
            with _way(way):
                step, _ = _decode_batch(engine, b, n, True, False, None)
                free[way].append(_time_steps(step, args.steps))
                for k, v in _anatomy(engine, b, n, args.steps).items():
                    parts[way][k].append(statistics.median(v))
    print("\nms a step, median of the rounds' medians (min-max over rounds)\n")
    print("| way | stepping freely | graph building | launch | device after launch | read back |")
    print("| --- | --- | --- | --- | --- | --- |")
    for way in ways:
        cells = [free[way], *(parts[way][k] for k in _PARTS)]
        print(
            f"| {way} | "
            + " | ".join(f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f})" for c in cells)
            + " |"
        )
    print("\nstepping freely, each round:", {w: [round(x, 2) for x in free[w]] for w in ways})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
