"""Sliding-window attention: the keys a query of a windowed layer sees, for every mask a layer is given.

A query at position p of a layer with window W sees the keys at positions j <= p with p - j < W (as
transformers' `sliding_window_overlay` has it: kv_idx > q_idx - window). A windowed layer's cache
drops the columns no query can see any more (`kv_cache.py`: its buffers start at a later column,
`base`; the same layout as a global layer's otherwise), so the masks here are built over every column
as for a global layer and attention right-aligns them to the keys the cache returns
(`attention.Attention`); the ragged decode step's rows move down by `base` (`RaggedRows.placed`).

Every mask the engine hands a layer says which cache columns each query sees, and those are exactly
its own sequence's positions 0..p, in column order: padding, holes of a verify step and bucketed spare
columns are hidden (`batch_cache.py`, `masks.bucketed_keys`). So the window needs no positions: a
visible key's distance to the query is the count of visible columns from it to the query, minus one,
and the window keeps the visible columns where that count is at most W. One rule for rows prefills,
decode masks, verify masks and the scorer's masks; plain causal attention (no mask) gets the band
built explicitly over the columns some query sees (the older keys are not read at all: a long
context's windowed layers cost their window), and the ragged decode kernel's rows move their first
column (`RaggedRows.window`).
`WindowMasks` makes each window's mask once per forward, not once per layer.
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.worker.engine.cache.prefill_rows_cache import PrefillRowsCache
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.ragged_attention import RaggedRows

Mask = mx.array | str | RaggedRows | None


def window_mask(mask: Mask, n: int, total: int, window: int) -> Mask:
    """`mask` (what a global layer gets for `n` new queries: None or "causal" for plain causal
    attention over `total` key columns, a boolean or additive array, or a decode step's `RaggedRows`)
    narrowed to the last `window` positions before and at each query."""
    if isinstance(mask, RaggedRows):
        return mask.window(window)
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask {mask!r} is not 'causal'")
    if mask is None or isinstance(mask, str):
        if total <= window:
            return mask  # no query is further than the window from any key
        # Only the last n + window - 1 columns are seen by any query: the band covers those alone,
        # and attention reads only as many keys as its mask has columns (`attention.Attention`).
        width = min(total, n + window - 1)
        columns = mx.arange(total - width, total, dtype=mx.int32)[None, :]
        queries = mx.arange(total - n, total, dtype=mx.int32)[:, None]
        return (columns <= queries) & (queries - columns < window)
    if mask.shape[-1] <= window:
        return mask
    visible = mask if mask.dtype == mx.bool_ else mask > -mx.inf
    seen = mx.cumsum(visible.astype(mx.int32), axis=-1, reverse=True)  # visible columns from here on
    keep = visible & (seen <= window)
    if mask.dtype == mx.bool_:
        return keep
    return mx.where(keep, mask, mx.array(-mx.inf, mask.dtype))


def keys_read(cache: LayerCache | None, n: int) -> int:
    """Key columns a layer's attention reads when `n` new positions go through it with no explicit
    mask (plain causal attention: the cache's rows all end at the same position)."""
    if cache is None:
        return n
    if isinstance(cache, PrefillRowsCache):
        return cache.end + cache.width
    offset = cache.offset
    if not isinstance(offset, int):
        raise ValueError("plain causal attention over rows of different lengths: a mask is needed")
    return offset + n


class WindowMasks:
    """One forward's masks by layer window: the global mask as given, each window's made on first use.
    Made before the first layer runs: the key count of plain causal attention is read off the cache
    then, before any layer has written this forward's keys into it."""

    def __init__(self, mask: Mask, n: int, cache: LayerCache | None, windows: list[int | None]) -> None:
        self.mask, self.n = mask, n
        causal = mask is None or isinstance(mask, str)
        self.total = keys_read(cache, n) if causal and any(w is not None for w in windows) else 0
        self._made: dict[int, Mask] = {}

    def __call__(self, window: int | None) -> Mask:
        if window is None:
            return self.mask
        if window not in self._made:
            self._made[window] = window_mask(self.mask, self.n, self.total, window)
        return self._made[window]
