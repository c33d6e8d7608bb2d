"""Probe (temporary): one Qwen3-30B-A3B-shaped sparse layer's experts (128 x 2,048 -> 768, top-8, 4-bit
group 64, bf16) at N tokens, the gathered quantized matmuls against the experts dequantized for the forward
(`SwitchGLU.dense_from`); and one token's gate/up gathered matmul at 7 and 8 pairs (MLX's CUDA build takes
`gather_qmv` below 8). Prints median ms over 30 evaluations after 5 discarded."""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.models import moe


def timed(fn: Any, reps: int = 30, warm: int = 5) -> tuple[float, float, float]:
    for _ in range(warm):
        mx.eval(fn(0))
    ms = []
    for i in range(reps):
        t = time.perf_counter()
        mx.eval(fn(i))
        ms.append((time.perf_counter() - t) * 1e3)
    ms.sort()
    return statistics.median(ms), ms[0], ms[-1]


def main() -> None:
    mx.random.seed(0)
    block = moe.SwitchGLU(2048, 768, 128)
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, 64, 4, class_predicate=lambda _p, m: isinstance(m, moe.SwitchLinear))
    block.fuse()
    mx.eval(block.parameters())
    print(f"device {mx.default_device()} dense_from after fuse: {block.dense_from}")
    for n in (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096):
        xs = [mx.random.normal((n, 1, 2048)).astype(mx.bfloat16) for _ in range(4)]
        es = [mx.argsort(mx.random.uniform(shape=(n, 128)), axis=-1)[:, :8] for _ in range(4)]
        es = [e.astype(mx.uint32) for e in es]
        mx.eval(xs, es)
        row = [f"N={n:5d} pairs={8 * n:6d}"]
        for label, dense_from, sort_from in (
            ("quantized", None, 64),
            ("unsorted", None, 1 << 30),
            ("dense", 1, 64),
        ):
            if (dense_from is not None or sort_from > 64) and 8 * n < 64:
                continue
            block.dense_from, moe.SORT_FROM = dense_from, sort_from
            med, lo, hi = timed(lambda i, xs=xs, es=es: block.expert_outputs(xs[i % 4], es[i % 4]))
            row.append(f"{label} {med:8.3f} ms ({lo:.3f}-{hi:.3f})")
        moe.SORT_FROM = 64
        print("  ".join(row), flush=True)
    gate_up = block.gate_up_proj
    x = mx.random.normal((1, 1, 2048)).astype(mx.bfloat16)
    for pairs in (4, 7, 8, 16):
        experts = mx.arange(pairs, dtype=mx.uint32).reshape(1, pairs) * 3
        rows = mx.zeros((1, pairs), dtype=mx.uint32)
        mx.eval(experts, rows)
        med, lo, hi = timed(lambda i, e=experts, r=rows: gate_up(x, e, r), reps=100)
        print(f"one token gate/up gather_qmm, {pairs:2d} pairs: {med:.4f} ms ({lo:.4f}-{hi:.4f})", flush=True)
    # two calls of 4 pairs (gather_qmv) against one of 8
    e8 = mx.arange(8, dtype=mx.uint32).reshape(1, 8) * 3
    r8 = mx.zeros((1, 8), dtype=mx.uint32)
    mx.eval(e8, r8)
    med, lo, hi = timed(
        lambda i: mx.concatenate(
            [gate_up(x, e8[:, :4], r8[:, :4]), gate_up(x, e8[:, 4:], r8[:, 4:])], axis=1
        ),
        reps=100,
    )
    print(f"one token gate/up, 8 pairs as two calls of 4: {med:.4f} ms ({lo:.4f}-{hi:.4f})", flush=True)


if __name__ == "__main__":
    main()
