"""Probe: what attention costs on a GPU the first time it meets a key length, and how to avoid it.

    python -m bench.sdpa_probe [--model llama-1b|tiny|PATH] [--skip-model]

MLX's CUDA build runs attention over many query positions through cuDNN, whose execution plans are
built per shape (and strides) of queries, keys and mask. A prompt tail prefilled on top of a cached
prefix has a new key length almost every time, so it may pay a plan build each time. Measured here,
first call and again (median of 5), per key length:
- attention alone, 16 queries over a cached prefix: keys sliced to the exact length with the causal
  mask (what the model does now), against the cache's whole buffer (its capacity, a multiple of 256)
  with an additive mask hiding the columns past each query;
- one decode step's attention, 64 rows: no mask, boolean mask, additive mask;
- the model: a 16-token tail on top of a cached prefix at several offsets (first call and again).
Then the first part again in a child process with cuDNN attention turned off (MLX_CUDA_USE_CUDNN_SDPA=0).
Prints tables; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64  # Llama-3.2-1B


def _ms(fn: Any) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1000


def _first_again(fn: Any) -> tuple[float, float]:
    first = _ms(fn)
    return first, statistics.median(_ms(fn) for _ in range(5))


def _tail_attention(
    capacity: int, lengths: list[int], queries: int = 16
) -> list[tuple[str, int, float, float]]:
    dt = mx.bfloat16
    keys = mx.random.normal((1, KV_HEADS, capacity, HEAD_DIM)).astype(dt)
    values = mx.random.normal((1, KV_HEADS, capacity, HEAD_DIM)).astype(dt)
    mx.eval(keys, values)
    scale = HEAD_DIM**-0.5
    rows = []
    for n in lengths:  # n: cached tokens; the queries are positions n .. n + queries - 1
        q = mx.random.normal((1, HEADS, queries, HEAD_DIM)).astype(dt)
        mx.eval(q)
        end = n + queries

        def sliced(q: mx.array = q, end: int = end) -> mx.array:
            return mx.fast.scaled_dot_product_attention(
                q, keys[..., :end, :], values[..., :end, :], scale=scale, mask="causal"
            )

        def whole(q: mx.array = q, n: int = n) -> mx.array:
            columns = mx.arange(capacity)[None, :]
            visible = columns <= (mx.arange(queries)[:, None] + n)
            mask = mx.where(visible, mx.array(0, dt), mx.array(-mx.inf, dt))[None, None]
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)

        a, b = sliced(), whole()
        err = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        rows.append(("sliced keys, causal", n, *_first_again(sliced)))
        rows.append(
            (f"whole buffer ({capacity}), additive mask (max diff {err:.3g})", n, *_first_again(whole))
        )
    return rows


def _decode_attention(rows: int = 64, length: int = 300, capacity: int = 512) -> list[tuple[str, float]]:
    dt = mx.bfloat16
    keys = mx.random.normal((rows, KV_HEADS, capacity, HEAD_DIM)).astype(dt)
    values = mx.random.normal((rows, KV_HEADS, capacity, HEAD_DIM)).astype(dt)
    q = mx.random.normal((rows, HEADS, 1, HEAD_DIM)).astype(dt)
    starts = mx.array([i * 3 for i in range(rows)])
    visible = (mx.arange(length)[None, :] >= starts[:, None])[:, None, None, :]
    additive = mx.where(visible, mx.array(0, dt), mx.array(-mx.inf, dt))
    mx.eval(keys, values, q, visible, additive)
    scale = HEAD_DIM**-0.5
    out = []
    for label, mask in (("no mask", None), ("boolean mask", visible), ("additive mask", additive)):

        def run(mask: Any = mask) -> list[mx.array]:  # 16 layers' worth
            return [
                mx.fast.scaled_dot_product_attention(
                    q, keys[..., :length, :], values[..., :length, :], scale=scale, mask=mask
                )
                for _ in range(16)
            ]

        out.append((label, _first_again(run)[1]))
    # Two queries (the second a copy) over the whole buffer with an additive mask: a multi-query shape,
    # which MLX hands to cuDNN with the mask as a bias, planned once per buffer size.
    columns = mx.arange(capacity)[None, :]
    seen = (columns >= starts[:, None]) & (columns < length)
    wide = mx.where(seen, mx.array(0, dt), mx.array(-mx.inf, dt))[:, None, None, :]
    wide2 = mx.broadcast_to(wide, (rows, 1, 2, capacity))
    q2 = mx.concatenate([q, q], axis=2)
    mx.eval(wide2, q2)
    want = mx.fast.scaled_dot_product_attention(
        q, keys[..., :length, :], values[..., :length, :], scale=scale, mask=additive
    )
    got = mx.fast.scaled_dot_product_attention(q2, keys, values, scale=scale, mask=wide2)[:, :, :1]
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()

    def two_queries() -> list[mx.array]:
        return [
            mx.fast.scaled_dot_product_attention(q2, keys, values, scale=scale, mask=wide2)[:, :, :1]
            for _ in range(16)
        ]

    first, again = _first_again(two_queries)
    out.append((f"2 queries, whole buffer, additive mask (first {first:.1f} ms; max diff {err:.3g})", again))
    from worker.engine import ragged_attention

    if ragged_attention.available():
        ragged = ragged_attention.RaggedRows(starts.astype(mx.int32), length, capacity)
        got = ragged_attention.decode_attention(q, keys, values, ragged, scale)
        err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()

        def kernel() -> list[mx.array]:
            return [ragged_attention.decode_attention(q, keys, values, ragged, scale) for _ in range(16)]

        first, again = _first_again(kernel)
        out.append(
            (f"worker.engine.ragged_attention kernel (first {first:.1f} ms; max diff {err:.3g})", again)
        )
    return out


def _model_tails(model_name: str, offsets: list[int]) -> list[tuple[bool, int, float, float]]:
    from worker.engine.models.loader import load_model

    from .checkpoints import checkpoint

    path = checkpoint(model_name, Path(os.environ.get("MLXQ_BENCH_CACHE", "/tmp/mlxq-bench")))
    model, _ = load_model(path)
    cache = model.make_cache()
    top = max(offsets)
    ids = mx.random.randint(0, model.args.vocab_size, (1, top))
    for start in range(0, top, 2048):
        model(ids[:, start : start + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    tail = mx.random.randint(0, model.args.vocab_size, (1, 16))
    out = []
    for bucket in (False, True):
        model.bucket_keys = bucket
        for n in offsets:
            n += 7 * bucket  # offsets the other mode did not meet

            def run(n: int = n) -> mx.array:
                for c in cache:
                    c.offset = n
                return model.hidden(tail, cache=cache, last=15)

            out.append((bucket, n, *_first_again(run)))
    return out


def _components(model_name: str) -> list[tuple[str, int, float, float]]:
    """Each part of a tail prefill at key lengths it has not seen: which one pays the first-call cost."""
    from worker.engine.models.loader import load_model

    from .checkpoints import checkpoint

    path = checkpoint(model_name, Path(os.environ.get("MLXQ_BENCH_CACHE", "/tmp/mlxq-bench")))
    model, _ = load_model(path)
    cache = model.make_cache()
    ids = mx.random.randint(0, model.args.vocab_size, (1, 8448))  # capacity 8448: every offset below fits
    for start in range(0, 8448, 2048):
        model(ids[:, start : start + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    a = model.args
    dt = cache[0].keys.dtype
    tail = mx.random.randint(0, model.args.vocab_size, (1, 16))
    kv = mx.random.normal((1, 16, a.n_kv_heads, a.head_dim)).astype(dt).transpose(0, 2, 1, 3)
    q = mx.random.normal((1, 16, a.num_attention_heads, a.head_dim)).astype(dt).transpose(0, 2, 1, 3)
    mx.eval(kv, q)
    rope = model.layers[0].self_attn.rope
    scale = a.head_dim**-0.5

    def at(n: int) -> None:
        for c in cache:
            c.offset = n

    def update(n: int) -> Any:
        at(n)
        return [c.update_and_fetch(kv, kv) for c in cache]

    def roped(n: int) -> Any:
        return [rope(q, offset=n) for _ in range(16)]

    def attention(n: int, queries: int = 16, mask: Any = "causal") -> Any:
        keys, values = cache[0].keys, cache[0].values
        qq = q[:, :, -queries:]
        return [
            mx.fast.scaled_dot_product_attention(
                qq, keys[..., : n + 16, :], values[..., : n + 16, :], scale=scale, mask=mask
            )
            for _ in range(16)
        ]

    def model_all(n: int) -> Any:
        at(n)
        return model.hidden(tail, cache=cache)

    def model_last(n: int) -> Any:
        at(n)
        return model.hidden(tail, cache=cache, last=15)

    parts = [
        ("cache update + fetch, 16 layers", update),
        ("rope at offset, 16x", roped),
        ("attention 16 queries causal, 16x", attention),
        ("attention 1 query, 16x", lambda n: attention(n, 1, None)),
        ("model tail, every position", model_all),
        ("model tail, last position only", model_last),
    ]
    out = []
    for i, (label, fn) in enumerate(parts):
        for n in (8192 + 10 * i + 1, 8192 + 10 * i + 2, 8192 + 10 * i + 5):
            out.append((label, n, *_first_again(lambda fn=fn, n=n: fn(n))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--attention-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--components", action="store_true", help="only the per-part first-call table")
    parser.add_argument("--decode", action="store_true", help="only the decode attention table")
    args = parser.parse_args()
    cudnn = os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1")
    print(f"device={mx.default_device()} MLX {mx.__version__} cudnn_sdpa={cudnn}")
    if args.decode:
        print("\n| decode attention, 64 rows x 300 keys (buffer 512), 16 calls | ms |")
        print("| --- | --- |")
        for label, ms in _decode_attention():
            print(f"| {label} | {ms:.3f} |")
        return
    if args.components:
        print("\n| part of a tail prefill | cached | first ms | again ms |")
        print("| --- | --- | --- | --- |")
        for label, n, first, again in _components(args.model):
            print(f"| {label} | {n} | {first:.2f} | {again:.3f} |")
        return
    lengths = [8192, 8193, 8200, 8231, 8300, 8301]
    print("\n| attention, 16 queries over a cached prefix | cached | first ms | again ms |")
    print("| --- | --- | --- | --- |")
    for label, n, first, again in _tail_attention(8448, lengths):
        print(f"| {label} | {n} | {first:.2f} | {again:.3f} |")
    if args.attention_only:
        return
    print("\n| decode attention, 64 rows x 300 keys (buffer 512), 16 calls | ms |")
    print("| --- | --- |")
    for label, ms in _decode_attention():
        print(f"| {label} | {ms:.3f} |")
    if not args.skip_model:
        print(f"\n| model {args.model}: 16-token tail after a cached prefix | cached | first ms | again ms |")
        print("| --- | --- | --- | --- |")
        for bucket, n, first, again in _model_tails(args.model, [8192, 8193, 8200, 8231, 8300, 4000, 4001]):
            label = "bucketed keys (whole cache steps, masked)" if bucket else "exact keys, causal"
            print(f"| {label} | {n} | {first:.2f} | {again:.3f} |")
    env = {**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": "0"}
    subprocess.run([sys.executable, "-m", "bench.sdpa_probe", "--attention-only"], env=env, check=False)


if __name__ == "__main__":
    main()
