"""Temporary probe: decode attention of 64 ragged rows on CUDA, narrow kernel vs wide vs MLX's sdpa."""

# ruff: noqa: B023
import time

import mlx.core as mx

from mlxq.worker.engine import ragged_attention as ra


def timed(fn, reps=200):
    for _ in range(10):
        mx.eval(fn())
    t0 = time.perf_counter()
    outs = [fn() for _ in range(reps)]
    mx.eval(outs)
    return (time.perf_counter() - t0) / reps * 1e6


for d, h, hkv in [(64, 32, 8), (128, 32, 8), (256, 8, 4)]:
    for end in (256, 1024):
        b, cap = 64, end + 64
        q = mx.random.normal((b, h + hkv, 1, d)).astype(mx.bfloat16)
        k = mx.random.normal((b, hkv, cap, d)).astype(mx.bfloat16)
        v = mx.random.normal((b, hkv, cap, d)).astype(mx.bfloat16)
        starts = mx.random.randint(0, end // 2, (b,)).astype(mx.int32)
        rows = ra.RaggedRows(starts, end, cap)
        sc = d**-0.5
        res = {}
        for name, wide_from in (("narrow", 10**6), ("wide", 1)):
            ra.WIDE_FROM = wide_from
            res[name] = timed(lambda: ra.decode_attention(q, k, v, rows, sc, heads=h))
        ra.WIDE_FROM = 128
        qh = q[:, :h]
        res["masked"] = timed(lambda: ra._masked(qh, k, v, rows, sc))
        kk, vv = k[..., :end, :], v[..., :end, :]
        res["sdpa_nomask"] = timed(lambda: mx.fast.scaled_dot_product_attention(qh, kk, vv, scale=sc))
        print(
            f"d={d} heads={h}/{hkv} keys={end}: " + ", ".join(f"{n} {t:.1f}us" for n, t in res.items()),
            flush=True,
        )
