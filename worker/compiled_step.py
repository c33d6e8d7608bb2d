"""A batch's decode step compiled with `mx.compile`: traced once per shape, then replayed.

A batched decode step on a GPU is bound by the host, not the device: at 64 rows of the 1B shape on an
H200, ~1.8 ms of Python building the step's graph and ~2.4 ms of MLX launching its kernels, against
~1 ms of device work (`bench/batch_step.py`). A compiled step skips the Python (the traced graph is
replayed) and fuses elementwise ops into fewer kernels (fewer launches).

A compiled function must meet the same input shapes every step, so the step takes a `BatchKVCache`'s
whole buffers (its capacity: a whole number of `BatchKVCache.step` columns) and the column to write as
an array, not as a Python int: the new keys and values are written there with `mx.slice_update`, RoPE
takes each row's position (`end - start`) as an array, and attention reads each row's columns
`start .. end` of the buffers: the ragged kernel (`ragged_attention`) reads just those, MLX's attention
elsewhere reads the whole capacity with the rest masked. A new trace (tens of milliseconds) is made
when the number of rows or the capacity changes; `pad_shapes` keeps the row counts to a few, and the
capacity grows by whole steps.

The result is the uncompiled step's (the same ops on the same values), up to the order of floating-
point sums in the kernels MLX fuses (on the CPU in float32: identical, tested).

Off by default (`MLXQ_COMPILE_DECODE`): measured on the H200 (MLX 0.32.4, 1B shape, 64 rows,
`bench.batch_step`, 2026-12-01) the compiled step builds its graph faster (0.77 against 1.13 ms) but
MLX launches it slower (3.67 against 2.46 ms) and the device works longer (2.12 against 1.14 ms after
the launch): 7.2 against 6.1 ms per step. Kept as a setting for MLX builds and devices where compiled
kernels launch cheaply (Metal; not measured here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .batch_cache import BatchKVCache
from .ragged_attention import RaggedRows


class _BufferCache:
    """One layer's fixed-capacity buffers inside the traced step: what the model's attention asks of a
    cache (`offset`, `update_and_fetch`, `keys`, `values`)."""

    def __init__(self, keys: mx.array, values: mx.array, end: mx.array, offset: mx.array) -> None:
        self.keys, self.values = keys, values
        self.end = end  # (1,) the column this step writes
        self.offset = offset  # (B,) each row's position of the new token

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.end, axes=[2])
        self.values = mx.slice_update(self.values, values, self.end, axes=[2])
        return self.keys, self.values


class CompiledStep:
    """`step(tokens, caches) -> logits`: one decode step of `model` for every row of the left-padded
    `BatchKVCache`s (one per layer), through a compiled function; the caches advance one column."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._fn: Callable[..., Any] = mx.compile(self._forward)

    def _forward(
        self, tokens: mx.array, end: mx.array, starts: mx.array, *buffers: mx.array
    ) -> list[mx.array]:
        capacity = buffers[0].shape[2]
        offset = end - starts
        caches = [_BufferCache(buffers[i], buffers[i + 1], end, offset) for i in range(0, len(buffers), 2)]
        rows = RaggedRows(starts, end + 1, capacity)
        logits = self.model(tokens[:, None], cache=caches, mask=rows)[:, -1, :]
        return [logits, *(a for c in caches for a in (c.keys, c.values))]

    def __call__(self, tokens: mx.array, caches: list[BatchKVCache]) -> mx.array:
        """(B, vocab) logits for (B,) `tokens` fed at column `end` of every row."""
        for layer in caches:
            layer.reserve(1)
        first = caches[0]
        end = mx.array([first.end], dtype=mx.int32)
        buffers: list[mx.array] = []
        for layer in caches:
            assert layer.keys is not None and layer.values is not None
            buffers += [layer.keys, layer.values]
        logits, *buffers = self._fn(tokens, end, first._starts, *buffers)
        for n, layer in enumerate(caches):
            layer.keys, layer.values = buffers[2 * n], buffers[2 * n + 1]
            layer.end += 1
        return logits
