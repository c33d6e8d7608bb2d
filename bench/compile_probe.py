"""Probe: would `mx.compile` take the graph building out of a batched decode step?

    python -m bench.compile_probe [--model tiny|llama-1b|PATH] [--rows 64] [--context 128] [--steps 64]

A batched decode step on a GPU is bound by the host (`bench.batch_step`): ~1.2-1.8 ms of Python graph
building and ~2.4 ms of MLX's launch at 64 rows of the 1B shape. A compiled step replays a traced graph
instead of building it in Python, and fuses elementwise ops (fewer launches). Compiling needs a step
whose shapes stay fixed: here the keys and values live in buffers of a fixed capacity, written at a
position passed as an array (`mx.slice_update`), RoPE takes that position as an array, and attention
reads the whole buffer with the columns past the position masked. Rows of equal length only (what the
hand loop of `bench.batch_step` does): this measures the mechanism, not the worker's ragged batches.

Prints, per path (the model in a plain hand loop, and the compiled step): milliseconds per step
stepping freely, the host time to produce one step's (unevaluated) outputs, and whether the two paths
pick the same greedy tokens. Writes nothing.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from .batch_step import _time_steps
from .checkpoints import checkpoint


def _compiled_step(model: Any) -> Callable[..., Any]:
    """`step(tokens (B,), position (1,), *buffers) -> (next tokens, *buffers)`: one decode step of the
    engine's (fused) Llama model on fixed-capacity key/value buffers, compiled."""
    inner = model.model

    def step(tokens: mx.array, position: mx.array, *buffers: mx.array) -> tuple[mx.array, ...]:
        b = tokens.shape[0]
        h = inner.embed_tokens(tokens[:, None])
        visible = (mx.arange(buffers[0].shape[2]) <= position)[None, None, None, :]
        out: list[mx.array] = []
        for n, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            nq, nkv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
            qkv = attn.qkv_proj(x)
            q = qkv[..., :nq].reshape(b, 1, attn.n_heads, attn.head_dim)
            k = qkv[..., nq : nq + nkv].reshape(b, 1, attn.n_kv_heads, attn.head_dim)
            v = qkv[..., nq + nkv :].reshape(b, 1, attn.n_kv_heads, attn.head_dim).transpose(0, 2, 1, 3)
            if attn.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = attn.rope(q.transpose(0, 2, 1, 3), offset=position)
            k = attn.rope(k.transpose(0, 2, 1, 3), offset=position)
            keys = mx.slice_update(buffers[2 * n], k, position, axes=[2])
            values = mx.slice_update(buffers[2 * n + 1], v, position, axes=[2])
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=visible)
            h = h + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            out += [keys, values]
        logits = model.logits(inner.norm(h))[:, -1, :]
        return (mx.argmax(logits, axis=-1), *out)

    return mx.compile(step)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compile_probe")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args(argv)
    from worker.engine import Engine

    engine = Engine.load(str(checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models")))
    model, b, n, steps = engine.model, args.rows, args.context, args.steps
    if model.layers[0].self_attn.qkv_proj is None or model.layers[0].mlp.gate_up_proj is None:
        raise SystemExit("the compiled step is written for fused projections (a quantized model is not)")
    random.seed(0)
    ids = mx.array([[random.randrange(100, 300) for _ in range(n)] for _ in range(b)], dtype=mx.int32)
    capacity = -(-(n + 16 + steps) // 256) * 256  # room for all the compiled path's steps

    # The hand loop: the model with its own batch KVCache (exact key lengths), one step in flight.
    cache = model.make_cache()
    first = mx.argmax(model(ids, cache=cache)[:, -1, :], axis=-1)
    mx.eval(first)
    prefix = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]
    hand = {"tok": first}

    def hand_step() -> list[int]:
        nxt = mx.argmax(model(hand["tok"][:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        out = hand["tok"].tolist()
        hand["tok"] = nxt
        return out

    # The compiled step on buffers holding the same prefix.
    step = _compiled_step(model)
    buffers: list[mx.array] = []
    for keys, values in prefix:
        for part in (keys, values):
            pad = mx.zeros((*part.shape[:2], capacity - n, part.shape[3]), dtype=part.dtype)
            buffers.append(mx.concatenate([part, pad], axis=2))
    mx.eval(buffers)
    state: dict[str, Any] = {"tok": first, "pos": n, "buf": buffers}

    def compiled_step() -> list[int]:
        nxt, *state["buf"] = step(state["tok"], mx.array([state["pos"]], dtype=mx.int32), *state["buf"])
        state["pos"] += 1
        mx.async_eval(nxt, state["buf"])
        out = state["tok"].tolist()
        state["tok"] = nxt
        return out

    same = sum(hand_step() == compiled_step() for _ in range(8))
    rows = [("hand loop, model + KVCache", hand_step), ("compiled step, fixed buffers", compiled_step)]
    print(f"model={args.model} rows={b} context={n} capacity={capacity} device={mx.default_device()}")
    print(f"same greedy tokens, first 8 steps: {same}/8\n")
    print("| path | ms/step | host ms to build the step (no eval) |\n| --- | --- | --- |")
    for name, fn in rows:
        ms = _time_steps(fn, steps)
        mx.synchronize()
        t0 = time.perf_counter()
        if fn is hand_step:  # build the graph only; the cache's column is taken back
            model(hand["tok"][:, None], cache=cache)
            built = time.perf_counter() - t0
            for c in cache:
                c.offset -= 1
        else:
            step(state["tok"], mx.array([state["pos"]], dtype=mx.int32), *state["buf"])
            built = time.perf_counter() - t0
        print(f"| {name} | {ms:.2f} | {built * 1000:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
