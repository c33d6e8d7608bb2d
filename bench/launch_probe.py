"""Probe: what the host spends launching one op of a decode step, per kind of op.

    python -m bench.launch_probe [--rows 64] [--capacity 256] [--calls 16] [--repeats 20]

A batched decode step on MLX's CUDA build is host-bound (`bench.batch_step`: ~5 ms of launch against
~2 ms of device work at 64 rows of the 1B shape). This times, per kind of op at the 1B shape's decode
sizes, `--calls` independent calls evaluated by one `async_eval` with the device idle: graph building
(Python), launch (MLX's evaluation on the host), and what the device still runs afterwards, each per
call (median over `--repeats`). Kinds: a matmul (rows x 2048 @ 2048 x 2048), an elementwise add, RoPE,
MLX's attention over a slice of the cache, the same with a boolean mask, and mlxq's ragged-attention
kernel (`worker.engine.ragged_attention`, CUDA only). Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from worker.engine import ragged_attention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 8, 64


def _time(build: Callable[[], list[mx.array]], calls: int, repeats: int) -> tuple[float, float, float]:
    """Median (graph, launch, device) milliseconds per call."""
    parts: list[tuple[float, float, float]] = []
    for r in range(repeats + 2):  # the first two meet every shape
        mx.synchronize()
        t0 = time.perf_counter()
        outs = build()
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.synchronize()
        t3 = time.perf_counter()
        if r >= 2:
            parts.append(((t1 - t0) * 1000 / calls, (t2 - t1) * 1000 / calls, (t3 - t2) * 1000 / calls))
    return tuple(statistics.median(p[i] for p in parts) for i in range(3))  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.launch_probe")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    b, cap, n = args.rows, args.capacity, args.calls
    end = cap - 8
    dt = mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    x = mx.random.normal((b, 1, HIDDEN)).astype(dt)
    w = mx.random.normal((HIDDEN, HIDDEN)).astype(dt) * 0.02
    q = mx.random.normal((b, HEADS, 1, HEAD_DIM)).astype(dt)
    keys = mx.random.normal((b, KV_HEADS, cap, HEAD_DIM)).astype(dt)
    values = mx.random.normal((b, KV_HEADS, cap, HEAD_DIM)).astype(dt)
    starts = mx.array([(i * 7) % 48 for i in range(b)], dtype=mx.int32)
    visible = (mx.arange(end)[None, :] >= starts[:, None])[:, None, None, :]
    scale = HEAD_DIM**-0.5
    mx.eval(x, w, q, keys, values, starts, visible)
    kinds: dict[str, Callable[[], list[mx.array]]] = {
        "matmul (rows x 2048 @ 2048 x 2048)": lambda: [x @ w for _ in range(n)],
        "add (rows x 2048)": lambda: [x + x for _ in range(n)],
        "rope (fast.rope, rows x 32 heads)": lambda: [
            mx.fast.rope(q, HEAD_DIM, traditional=False, base=500000.0, scale=1.0, offset=end)
            for _ in range(n)
        ],
        "attention, keys sliced, no mask": lambda: [
            mx.fast.scaled_dot_product_attention(q, keys[..., :end, :], values[..., :end, :], scale=scale)
            for _ in range(n)
        ],
        "attention, keys sliced, boolean mask": lambda: [
            mx.fast.scaled_dot_product_attention(
                q, keys[..., :end, :], values[..., :end, :], scale=scale, mask=visible
            )
            for _ in range(n)
        ],
    }
    if ragged_attention.available():
        rows = ragged_attention.RaggedRows(starts, end, cap)
        kinds["mlxq ragged-attention kernel"] = lambda: [
            ragged_attention.decode_attention(q, keys, values, rows, scale) for _ in range(n)
        ]
    print(f"rows={b} capacity={cap} calls={n} device={mx.default_device()} dtype={dt}\n")
    print("| op | graph ms/call | launch ms/call | device after launch ms/call |\n| --- | --- | --- | --- |")
    for name, build in kinds.items():
        graph, launch, device = _time(build, n, args.repeats)
        print(f"| {name} | {graph:.3f} | {launch:.3f} | {device:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
