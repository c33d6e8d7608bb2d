"""Probe (temporary): the host time to build one batched decode step's graph, without evaluating it.

Builds `DecodeBatch._next_step` (the forward over the batch caches and the rows' draw) for a tiny
random-weight Llama (16 layers, fused, tied embeddings, llama3 RoPE as Llama-3.2-1B), rows of
different lengths, `pad_shapes=True`; evaluates each step outside the timed region so the caches move
on. `--kernel`: the ragged-kernel path a GPU takes (`RaggedRows`); the CUDA kernel cannot be built
here, so `attention.decode_attention` is a one-op stand-in (a slice of q) in that mode.

    python -m bench.probe_build --rows 64 --kernel --steps 200 [--profile] [--dot]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import statistics
import tempfile
import time
from typing import Any

import mlx.core as mx
import numpy as np

from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.models import attention
from mlxq.worker.engine.models.llama import Model
from mlxq.worker.engine.models.model_args import ModelArgs
from mlxq.worker.engine.ragged_attention import RaggedRows
from mlxq.worker.engine.sampler import Sampler


def _stand_in(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: RaggedRows,
    scale: float,
    heads: int | None = None,
    shape: tuple[int, ...] | None = None,
) -> mx.array:
    """One op in place of the CUDA kernel (its Python is a few lines and one call), in its shape
    (with `shape`: an evaluated zero broadcast, one op that reads nothing; q's other reader, the
    cache's write of the keys, keeps its branch in the graph)."""
    if shape is None:
        return q[:, :heads] if heads is not None else q
    return mx.broadcast_to(_ZERO, shape).astype(q.dtype)


_ZERO = mx.zeros((1,), dtype=mx.bfloat16)


def _one_op(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    """One primitive in place of a fast op the CPU build expands into its fallback (`--gpu-like`)."""
    return mx.abs(x)


def build_model(dtype: mx.Dtype) -> Model:
    args = ModelArgs(
        hidden_size=128,
        num_hidden_layers=16,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=512,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    model = Model(args)
    model.set_dtype(dtype)
    model.fuse()
    mx.eval(model.parameters())
    return model


def build_batch(model: Model, rows: int, kernel: bool, dtype: mx.Dtype, seed: int) -> DecodeBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(128, 257, size=rows) if rows > 1 else [200]
    args = model.args
    caches = []
    for n in lengths:
        shape = (1, args.n_kv_heads, int(n), 64)
        arrays = [[mx.random.normal(shape).astype(dtype) for _ in range(2)] for _ in model.layers]
        caches.append([KVCache.from_state(k, v) for k, v in arrays])
    batch = DecodeBatch(model, pad_shapes=True, ragged_kernel=kernel)
    logits = mx.random.normal((rows, args.vocab_size))
    batch.add(caches, logits, [Sampler(args.vocab_size, temperature=0) for _ in range(rows)])
    batch.step()  # the fresh step: reads the first tokens back, launches the next
    mx.eval(batch._pending)
    return batch


def count_ops(*outs: mx.array) -> dict[str, int]:
    """Primitives in the graph behind `outs` (not yet evaluated), by name."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        text = f.read()
    names = re.findall(r'\[label ="([A-Za-z_]+)', text)
    found: dict[str, int] = {}
    for n in names:
        found[n] = found.get(n, 0) + 1
    return found


def run(opts: Any) -> None:
    dtype = mx.bfloat16 if opts.dtype == "bf16" else mx.float32
    if opts.kernel:
        attention.decode_attention = _stand_in  # type: ignore[assignment]
    if opts.gpu_like:  # a GPU builds each of these as one primitive
        mx.fast.rope = _one_op
        mx.fast.rms_norm = _one_op
    model = build_model(dtype)
    batch = build_batch(model, opts.rows, opts.kernel, dtype, opts.seed)
    for _ in range(5):  # warm
        mx.eval(batch._next_step(batch._pending), *(a for c in batch.cache for a in (c.keys, c.values)))
    if opts.dot:
        out = batch._next_step(batch._pending)
        buffers = [a for layer in batch.cache for a in (layer.keys, layer.values) if a is not None]
        ops = count_ops(out, *buffers)
        print(f"ops {sum(ops.values())} " + " ".join(f"{k}={v}" for k, v in sorted(ops.items())))
        mx.eval(out, *buffers)
    times = []
    profile = cProfile.Profile() if opts.profile else None
    for _ in range(opts.steps):
        pending = batch._pending
        if profile is not None:
            profile.enable()
        began = time.perf_counter()
        out = batch._next_step(pending)
        took = time.perf_counter() - began
        if profile is not None:
            profile.disable()
        times.append(took)
        mx.eval(out, *(a for layer in batch.cache for a in (layer.keys, layer.values)))
    ms = sorted(t * 1e3 for t in times)
    print(
        f"rows={opts.rows} kernel={opts.kernel} gpu_like={opts.gpu_like} dtype={opts.dtype} "
        f"steps={opts.steps} "
        f"build ms median {statistics.median(ms):.3f} p10 {ms[len(ms) // 10]:.3f} min {ms[0]:.3f}"
    )
    if profile is not None:
        s = io.StringIO()
        stats = pstats.Stats(profile, stream=s)
        stats.sort_stats(opts.sort).print_stats(opts.top)
        print(s.getvalue())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kernel", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--gpu-like", action="store_true", help="fast ops as one primitive each")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--dot", action="store_true")
    p.add_argument("--sort", default="tottime")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    run(p.parse_args())


if __name__ == "__main__":
    main()
