"""Probe (temporary): the primitives of one batched decode step of a Qwen3-MoE-layout model, by name,
counted from the unevaluated graph (`mx.export_to_dot`), ours against mlx-lm's one-row forward.

A random checkpoint of Qwen3-30B-A3B's layout (48 layers, 128 experts, 8 a token) at tiny widths,
drawn and quantized 4-bit group 64 as the bench draws `qwen3-moe-30b-4bit` (`draw_quantized`), loaded
by the engine's path (`load_model`, dense rows as CUDA would take them with `--dense-rows 8`,
`fuse`). Counted: `DecodeBatch._next_step` (forward, draw, cache writes) at each `--rows`, and one
`SparseMoeBlock` call alone. `--gpu-like`: MLX's fast RoPE, RMSNorm and attention as one primitive each
(the CPU build expands them; a GPU does not), and the ragged kernel's path with a one-op stand-in.
`--mlx-lm`: the same counts for mlx-lm's `qwen3_moe` (needs mlx-lm on PYTHONPATH).

    python -m bench.probe_moe_ops --rows 1 32 --gpu-like [--mlx-lm] [--dense-rows 8]
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench.checkpoints import QWEN3_MOE_30B, draw_quantized

CONFIG: dict[str, Any] = {
    **QWEN3_MOE_30B,
    "hidden_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "vocab_size": 512,
}


def count_ops(*outs: mx.array) -> dict[str, int]:
    """Primitives in the graph behind `outs` (not yet evaluated), by name."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        text = f.read()
    found: dict[str, int] = {}
    for n in re.findall(r'\[label ="([A-Za-z_]+)', text):
        found[n] = found.get(n, 0) + 1
    return found


def show(label: str, ops: dict[str, int], per: int = 1) -> None:
    total = sum(ops.values())
    line = " ".join(f"{k}={v}" for k, v in sorted(ops.items()))
    print(f"{label}: ops {total}" + (f" ({total / per:.1f} a layer)" if per > 1 else "") + f"  {line}")


def _one_op(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    return mx.abs(x)


def _sdpa(q: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    return mx.abs(q)


def _stand_in(q: mx.array, *args: Any, heads: int | None = None) -> mx.array:
    return q[:, :heads] if heads is not None else mx.abs(q)


def gpu_like(ours: bool) -> None:
    mx.fast.rope = _one_op
    mx.fast.rms_norm = _one_op
    mx.fast.scaled_dot_product_attention = _sdpa
    if ours:
        from mlxq.worker.engine.models import attention

        attention.decode_attention = _stand_in  # type: ignore[assignment]


def ours(folder: Path, opts: Any) -> None:
    from mlxq.worker.engine.cache.kv_cache import KVCache
    from mlxq.worker.engine.decode_batch import DecodeBatch
    from mlxq.worker.engine.models.loader import load_model
    from mlxq.worker.engine.models.quantized_rows import use_dense_rows
    from mlxq.worker.engine.sampler import Sampler

    model, _ = load_model(folder, dtype="bfloat16")
    if opts.dense_rows:
        use_dense_rows(model, opts.dense_rows, mx.bfloat16)
    model.fuse()
    if opts.gpu_like:
        gpu_like(True)
    args = model.args
    layers = len(model.layers)
    block = model.layers[0].feed_forward
    for rows in opts.rows:
        x = mx.random.normal((rows, 1, args.hidden_size)).astype(mx.bfloat16)
        mx.eval(x, block(x))  # a first call evaluates views kept across calls
        show(f"ours MoE block rows={rows}", count_ops(block(x)))
    for rows in opts.rows:
        rng = np.random.default_rng(0)
        lengths = rng.integers(128, 257, size=rows) if rows > 1 else [200]
        caches = []
        for n in lengths:
            shape = (1, args.n_kv_heads, int(n), args.head_dim)
            arrays = [[mx.random.normal(shape).astype(mx.bfloat16) for _ in range(2)] for _ in range(layers)]
            caches.append([KVCache.from_state(k, v) for k, v in arrays])
        batch = DecodeBatch(model, pad_shapes=True, ragged_kernel=opts.gpu_like)
        logits = mx.random.normal((rows, args.vocab_size))
        batch.add(caches, logits, [Sampler(args.vocab_size, temperature=0) for _ in range(rows)])
        batch.step()
        mx.eval(batch._pending)
        for _ in range(2):
            mx.eval(batch._next_step(batch._pending), *(a for c in batch.cache for a in (c.keys, c.values)))
        out = batch._next_step(batch._pending)
        buffers = [a for c in batch.cache for a in (c.keys, c.values) if a is not None]
        show(f"ours decode step rows={rows}", count_ops(out, *buffers), layers)
        mx.eval(out, *buffers)


def theirs(folder: Path, opts: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as lm_load

    model, _ = lm_load(folder)
    if opts.gpu_like:
        gpu_like(False)
    block = model.model.layers[0].mlp
    x = mx.random.normal((1, 1, CONFIG["hidden_size"])).astype(mx.bfloat16)
    mx.eval(x)
    show("mlx-lm MoE block rows=1", count_ops(block(x)))
    cache = make_prompt_cache(model)
    prompt = mx.array([list(range(1, 200))])
    mx.eval(model(prompt, cache=cache), [a for c in cache for a in (c.keys, c.values)])
    token = mx.array([[3]])
    logits = model(token, cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    out = mx.argmax(logprobs, axis=-1)
    buffers = [a for c in cache for a in (c.keys, c.values)]
    show("mlx-lm decode step rows=1 (generate_step's)", count_ops(out, logprobs, *buffers), len(model.layers))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--gpu-like", action="store_true")
    p.add_argument("--mlx-lm", action="store_true")
    p.add_argument("--dense-rows", type=int, default=0)
    p.add_argument("--dir", default="/tmp/moeops-ckpt")
    opts = p.parse_args()
    folder = draw_quantized(Path(opts.dir), CONFIG, "bfloat16", 4)
    if opts.mlx_lm:
        theirs(folder, opts)
    else:
        ours(folder, opts)


if __name__ == "__main__":
    main()
