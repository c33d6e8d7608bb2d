"""One layer's keys/values while prompts are prefilled together in one forward, and that forward's mask.

`prefill.prefill_rows_layers` builds one `PrefillRowsCache` a layer and hands each row back its own
batch-1 cache (`row_cache`); a decode batch may take the buffers over as they are (`BatchKVCache.adopt`).
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache, pad_columns


class PrefillRowsCache:
    """One layer's keys/values while several prompts are prefilled in one forward (`prefill_rows`).

    Row i arrives with `cached[i]` tokens already in its batch-1 cache and `new[i]` tokens to compute.
    The cached parts are left-padded to a common end column E; the forward appends M = max(new) columns
    for every row, each row's new tokens right-aligned in them (so every row's last token is the last
    column and one slice gives all rows' last logits). Between a row's cached part and its new tokens sit
    M - new[i] padding columns: the mask (`prefill_mask`) hides them from the row's real tokens, and
    `offset` (each row's RoPE position of column E) makes the real tokens' positions continue right
    after the cached part, exactly as when the row is prefilled alone. `row_cache` then gives each row
    back its own tokens only, without the padding.
    A sliding-window layer's cached parts may have dropped their oldest positions (`kv_cache.py`): the
    buffers then start at column `base`, the first any row holds (the mask, over every column, is
    right-aligned to them by attention).
    """

    def __init__(self, rows: list[KVCache], new: list[int], width: int = 0, end: int = 0) -> None:
        self.cached = [r.offset for r in rows]
        self.new = new
        self.end = max(end, *self.cached)  # E
        self.width = max(width, *new)  # M
        self.starts = [self.end - c for c in self.cached]
        self.window = rows[0].window
        self.dropped = [r.base for r in rows]  # each cached part's positions dropped
        held = [s + d for s, d in zip(self.starts, self.dropped, strict=True)]
        self.base = min(held) if any(self.dropped) else 0
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        if self.end:
            like = next(r.state for r in rows if r.offset)

            def stacked(i: int) -> mx.array:  # 0: keys, 1: values; an empty row is all padding
                shape = (1, like[i].shape[1], self.end - self.base, like[i].shape[3])
                empty = mx.zeros(shape, like[i].dtype)
                padded = [
                    pad_columns(r.state[i], h - self.base, 0) if r.offset else empty
                    for r, h in zip(rows, held, strict=True)
                ]
                return mx.concatenate(padded, axis=0)

            self.keys, self.values = stacked(0), stacked(1)
        self.offset = mx.array([c - (self.width - n) for c, n in zip(self.cached, new, strict=True)])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append the (B, n_kv_heads, M, head_dim) new columns; return all columns."""
        if keys.shape[2] != self.width:
            raise ValueError(f"a rows prefill takes its {self.width} columns at once, got {keys.shape[2]}")
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        return self.keys, self.values

    def row_cache(self, i: int) -> KVCache:
        """Row `i`'s batch-1 cache after the forward: its cached tokens, then its new ones."""
        assert self.keys is not None and self.values is not None, "run the forward first"
        first_new = self.end + self.width - self.new[i] - self.base
        held, end = self.starts[i] + self.dropped[i] - self.base, self.end - self.base
        parts = []
        for a in (self.keys, self.values):
            row = a[i : i + 1]
            if self.cached[i]:
                row = mx.concatenate([row[:, :, held:end], row[:, :, first_new:]], axis=2)
            else:
                row = row[:, :, first_new:]
            parts.append(row)
        keys, values = parts
        return KVCache.from_state(
            keys, values, base=self.dropped[i] if self.cached[i] else 0, window=self.window
        )


def prefill_mask(cache: PrefillRowsCache) -> mx.array | None:
    """Boolean (B, 1, M, E + M) mask of a rows prefill; None when plain causal attention is exact (no
    row has padding)."""
    if not any(cache.starts) and all(n == cache.width for n in cache.new):
        return None
    e, m = cache.end, cache.width
    columns = mx.arange(e + m, dtype=mx.int32)[None, None, :]
    query = mx.arange(m, dtype=mx.int32)[None, :, None] + e  # each query's own column
    starts = mx.array(cache.starts, dtype=mx.int32)[:, None, None]
    first_new = mx.array([e + m - n for n in cache.new], dtype=mx.int32)[:, None, None]
    cached = (columns >= starts) & (columns < e)
    own = (columns >= first_new) & (columns <= query)
    # Padding queries see themselves: a query that sees nothing would turn its row into NaNs, and
    # NaN keys/values poison even the rows that mask them (0 * NaN).
    visible = cached | own | (columns == query)
    return visible[:, None, :, :]
