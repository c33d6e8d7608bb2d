"""Probe (temporary): one Qwen3-30B-A3B-shaped sparse layer's experts (128 x 2,048 -> 768, top-8, 4-bit
group 64, bf16) at N tokens, four ways: the grouped experts' kernel (`expert_kernel`), the pairs'
gathered quantized matmuls (unsorted), every token by every expert (`SwitchGLU.every_expert_outputs`),
and the experts dequantized for the forward (`SwitchGLU.dense_from`). Prints median ms (range) over 30
evaluations after 5 discarded."""

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


def main(hidden: int = 2048, width: int = 768, experts: int = 128, top: int = 8) -> None:
    mx.random.seed(0)
    block = moe.SwitchGLU(hidden, width, experts)
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, 64, 4, class_predicate=lambda _p, m: isinstance(m, moe.SwitchLinear))
    block.fuse(top)
    mx.eval(block.parameters())
    print(
        f"device {mx.default_device()} fused: dense_from {block.dense_from}, every {block.every_from},",
        f"grouped {block.grouped}",
    )
    for n in (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024):
        xs = [mx.random.normal((n, 1, hidden)).astype(mx.bfloat16) for _ in range(4)]
        chosen = [mx.argsort(mx.random.uniform(shape=(n, experts)), axis=-1)[:, :top] for _ in range(4)]
        es = [e.astype(mx.uint32) for e in chosen]
        mx.eval(xs, es)
        row = [f"N={n:5d} pairs={top * n:6d}"]
        ways = (("grouped", True, None, None), ("pairs", False, None, None), ("every", False, 1, None))
        for label, grouped, every, dense in (*ways, ("dense", False, None, 1)):
            if (dense is not None and n < 64) or (grouped and n > 64):
                continue
            block.grouped, block.every_from, block.every_tokens, block.dense_from = (
                grouped,
                every,
                1 << 30,
                dense,
            )
            try:
                med, lo, hi = timed(lambda i, xs=xs, es=es: block.expert_outputs(xs[i % 4], es[i % 4]))
            except Exception as error:  # a failing way is reported, the others still timed
                row.append(f"{label} failed: {error}")
                continue
            row.append(f"{label} {med:7.3f} ms ({lo:.3f}-{hi:.3f})")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
