"""How many primitives one decode step hands MLX to encode: on a GPU each is host time (MLX's CUDA build
encodes an op in some microseconds), which is what a step of few rows is bound by, so the count is the
batch figure's measure of the host's work a step beside its tokens/s.

Counted from the unevaluated graph (`mx.export_to_dot`), each step built after one evaluated step (views
a forward keeps across steps are then leaves, as in a running batch): the engine's `DecodeBatch` step
(forward, the rows' draw and the cache writes) at each batch size, and mlx-lm's `generate_step` step
of one row (its forward, log-softmax and argmax). On the CPU MLX's fast RoPE, norms and attention are
built of their fallbacks' several ops each, a GPU's as one: compare counts of one device only.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.sampler import Sampler

PROMPT = 8  # tokens each row is prefilled with before its step is counted


def count_ops(*outs: mx.array) -> dict[str, int]:
    """Primitives in the graph behind `outs` (not yet evaluated), by name."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        text = f.read()
    found: dict[str, int] = {}
    for name in re.findall(r'\[label ="([A-Za-z_]+)', text):
        found[name] = found.get(name, 0) + 1
    return found


def engine_step_ops(engine: Any, rows: int) -> dict[str, int]:
    """Primitives of one greedy decode step of `rows` rows in the engine's own `DecodeBatch`."""
    model = engine.model
    vocab = model.args.vocab_size
    caches = [model.make_cache() for _ in range(rows)]
    logits = [
        prefill(model, [(7 * r + i) % (vocab - 1) + 1 for i in range(PROMPT + r % 3)], c, chunk=PROMPT + 2)
        for r, c in enumerate(caches)
    ]
    batch = DecodeBatch(model, engine.pad_shapes)
    batch.add(caches, mx.concatenate(logits), [Sampler(vocab, temperature=0) for _ in range(rows)])
    batch.step()  # the fresh step: the first tokens read back, the next step launched
    for last in (False, True):
        assert batch.pending.tokens is not None
        out = batch._next_step(batch.pending.tokens)
        buffers = [a for c in batch.cache for a in (c.keys, c.values) if a is not None]
        if last:
            return count_ops(out, *buffers)
        mx.eval(out, *buffers)
    raise AssertionError("unreachable")


def mlx_lm_step_ops(model: Any) -> dict[str, int]:
    """Primitives of one step of mlx-lm's `generate_step` (one row, greedy) after a short prompt."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    buffers = lambda: [a for c in cache for a in (c.keys, c.values)]  # noqa: E731  # their buffers, unsliced
    mx.eval(model(mx.array([list(range(1, PROMPT + 1))]), cache=cache), buffers())
    token = mx.array([[3]])
    for last in (False, True):
        logits = model(token, cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = mx.argmax(logprobs, axis=-1, keepdims=True)
        if last:
            return count_ops(token, logprobs, *buffers())
        mx.eval(token, logprobs, buffers())
    raise AssertionError("unreachable")


def step_ops(engine: Any, mlx_lm_model: Any, sizes: Sequence[int]) -> dict[str, Any]:
    """The batch figure's counts: the engine's step at each size, mlx-lm's one-row step; totals and,
    for the largest kinds, counts by primitive."""
    layers = len(engine.model.layers)
    ours = {n: engine_step_ops(engine, n) for n in sizes}
    theirs = mlx_lm_step_ops(mlx_lm_model)
    return {
        "layers": layers,
        "mlxq": {str(n): sum(ops.values()) for n, ops in ours.items()},
        "mlx_lm_1": sum(theirs.values()),
        "by_name": {**{f"mlxq {n}": ops for n, ops in ours.items()}, "mlx-lm 1": theirs},
    }
