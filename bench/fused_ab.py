"""Probe: a decode step with and without `worker/fused_ops.py`'s kernels, alternated in one process.

    python -m bench.fused_ab [--model llama-1b|tiny|PATH] [--rows 64] [--rounds 8] [--steps 32]

Single measurements on the lent GPU's host spread by 2x from one minute to the next, so this times the
two variants in turns: each round runs `--steps` steps of a `DecodeBatch` (ragged rows, logit bias, the
default attention) with the kernels on, then as many of a second batch with them off; the table gives
the median, min and max over the rounds, then one step of each split between device syncs (median of
`--steps`). Then the launch of custom kernels alone and interleaved (the ragged-attention kernel and
the add/RMS-norm kernel, 16 calls each, as a step has them), which shows whether switching between
custom kernels costs MLX more than calling one. Prints tables; writes nothing. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from worker import fused_ops, ragged_attention

from .batch_step import _PARTS, _anatomy, _decode_batch, _time_steps
from .checkpoints import checkpoint
from .launch_probe import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, _time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fused_ab")
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    if not fused_ops.available():
        raise SystemExit("the fused kernels run on MLX's CUDA build only")
    from worker.engine import Engine

    engine = Engine.load(str(checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models")))
    model, b, n = engine.model, args.rows, args.context
    steps = {}
    for on in (True, False):
        model.fused_kernels = on
        steps[on], _ = _decode_batch(engine, b, n, True, True, None)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for on in (True, False):
            model.fused_kernels = on
            times[on].append(_time_steps(steps[on], args.steps))
    print(f"model={args.model} rows={b} context~{n} rounds={args.rounds} steps={args.steps}")
    print("\n| fused kernels | median ms/step | min | max | tok/s at the median |")
    print("| --- | --- | --- | --- | --- |")
    for on, t in times.items():
        med = statistics.median(t)
        print(
            f"| {'on' if on else 'off'} | {med:.2f} | {min(t):.2f} | {max(t):.2f} | {b / med * 1000:,.0f} |"
        )
    print("\n| fused kernels | graph | launch | device after launch | read back |")
    print("| --- | --- | --- | --- | --- |")
    for on in (True, False, True, False):
        parts = _anatomy(engine, b, n, args.steps, False, on)
        cells = " | ".join(f"{statistics.median(parts[k]):.2f}" for k in _PARTS)
        print(f"| {'on' if on else 'off'} | {cells} |")

    dt = mx.bfloat16
    x = mx.random.normal((b, 1, HIDDEN)).astype(dt)
    norm = nn.RMSNorm(HIDDEN)
    norm.weight = norm.weight.astype(dt)
    q = mx.random.normal((b, HEADS, 1, HEAD_DIM)).astype(dt)
    cache = mx.random.normal((b, KV_HEADS, 256, HEAD_DIM)).astype(dt)
    rows = ragged_attention.RaggedRows(mx.array([(i * 7) % 48 for i in range(b)], dtype=mx.int32), 248, 256)
    mx.eval(x, norm.weight, q, cache)

    def attention() -> mx.array:
        return ragged_attention.decode_attention(q, cache, cache, rows, HEAD_DIM**-0.5)

    def add_norm() -> mx.array:
        return fused_ops.add_rms_norm(x, x, norm, True)[1]

    kinds = {
        "ragged attention x16": lambda: [attention() for _ in range(16)],
        "add_rms_norm x16": lambda: [add_norm() for _ in range(16)],
        "both, interleaved, x16 each": lambda: [a for _ in range(16) for a in (attention(), add_norm())],
        "matmul x16, for scale": lambda: [x @ norm.weight[:, None] for _ in range(16)],
    }
    print("\n| custom kernels | graph ms/call | launch ms/call | device after launch ms/call |")
    print("| --- | --- | --- | --- |")
    for name, build in kinds.items():
        calls = 32 if "interleaved" in name else 16
        graph, launch, device = _time(build, calls, 20)
        print(f"| {name} | {graph:.3f} | {launch:.3f} | {device:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
