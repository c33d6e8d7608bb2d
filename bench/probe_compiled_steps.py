"""Probe (temporary): the host time to build one flat decode step's graph with `compiled_steps` off and
on (alternating turns on one batch), its primitives, and one row's decode tok/s.

The model is the earlier build probe's (16 layers, fused, tied embeddings, llama3 RoPE, as
Llama-3.2-1B's layout shrunk). `--gpu-like` (the build measure): RoPE and norms one op each and the
ragged kernel a one-op stand-in, as a GPU's step has them; without it the CPU's real ops (the tok/s
sanity run, float32, the mask path the CPU takes).

    PYTHONPATH=. python bench/probe_compiled_steps.py --gpu-like --rows 64 1
    PYTHONPATH=. python bench/probe_compiled_steps.py --dtype f32 --rows 1 --full
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np

from bench.step_ops import count_ops
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.models import attention
from mlxq.worker.engine.models.llama import Model
from mlxq.worker.engine.models.model_args import ModelArgs
from mlxq.worker.engine.sampler import Sampler

_ZERO = mx.zeros((1,), dtype=mx.bfloat16)


def _stand_in(
    q: mx.array, keys: Any, values: Any, rows: Any, scale: float, heads: Any = None, shape: Any = None
) -> mx.array:
    if shape is None:
        return q[:, :heads] if heads is not None else q
    return mx.broadcast_to(_ZERO, shape).astype(q.dtype)


def _one_op(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
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


def build_batch(model: Model, rows: int, kernel: bool, dtype: mx.Dtype) -> DecodeBatch:
    rng = np.random.default_rng(0)
    lengths = rng.integers(128, 257, size=rows) if rows > 1 else [200]
    args = model.args
    caches = []
    for n in lengths:
        shape = (1, args.n_kv_heads, int(n), 64)
        arrays = [[mx.random.normal(shape).astype(dtype) for _ in range(2)] for _ in model.layers]
        caches.append([KVCache.from_state(k, v) for k, v in arrays])
    batch = DecodeBatch(model, pad_shapes=kernel, ragged_kernel=kernel)
    logits = mx.random.normal((rows, args.vocab_size))
    batch.add(caches, logits, [Sampler(args.vocab_size, temperature=0) for _ in range(rows)])
    batch.step()
    mx.eval(batch._pending)
    return batch


def _buffers(batch: DecodeBatch) -> list[mx.array]:
    return [a for c in batch.cache for a in (c.keys, c.values) if a is not None]


def _step(batch: DecodeBatch, full: bool) -> float:
    """Seconds to build one step (`full`: build and evaluate)."""
    pending = batch._pending
    began = time.perf_counter()
    out = batch._next_step(pending)
    built = time.perf_counter()
    mx.eval(out, *_buffers(batch))
    return (time.perf_counter() if full else built) - began


def run(opts: Any) -> None:
    dtype = mx.bfloat16 if opts.dtype == "bf16" else mx.float32
    if opts.gpu_like:
        attention.decode_attention = _stand_in  # type: ignore[assignment]
        mx.fast.rope = _one_op
        mx.fast.rms_norm = _one_op
    model = build_model(dtype)
    assert model.compile_steps()
    compiled = model.model.compiled_step
    modes = {"off": None, "on": compiled}
    print(f"loadavg {os.getloadavg()}")
    for rows in opts.rows:
        batch = build_batch(model, rows, opts.gpu_like, dtype)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for name, step in modes.items():
            model.model.compiled_step = step
            for _ in range(5):
                _step(batch, opts.full)
            out = batch._next_step(batch._pending)
            ops = count_ops(out, *_buffers(batch))
            print(
                f"rows={rows} {name} ops {sum(ops.values())} "
                + " ".join(f"{k}={v}" for k, v in sorted(ops.items()))
            )
            mx.eval(out, *_buffers(batch))
        for _turn in range(opts.turns):
            for name, step in modes.items():
                model.model.compiled_step = step
                times[name].extend(_step(batch, opts.full) for _ in range(opts.steps))
        for name in modes:
            ms = sorted(t * 1e3 for t in times[name])
            turn_medians = [
                statistics.median(times[name][i * opts.steps : (i + 1) * opts.steps]) * 1e3
                for i in range(opts.turns)
            ]
            what = "step ms (build+eval)" if opts.full else "build ms"
            extra = f" tok/s {1e3 / statistics.median(ms):.0f}" if opts.full else ""
            print(
                f"rows={rows} {name} {what} median {statistics.median(ms):.3f} p10 {ms[len(ms) // 10]:.3f} "
                f"p90 {ms[9 * len(ms) // 10]:.3f} turn {min(turn_medians):.3f}-{max(turn_medians):.3f}{extra}"
            )
        print(f"traces {compiled.traces}")
    print(f"loadavg {os.getloadavg()}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[64, 1])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--gpu-like", action="store_true")
    p.add_argument("--full", action="store_true", help="time build and evaluation (tok/s)")
    run(p.parse_args())


if __name__ == "__main__":
    main()
