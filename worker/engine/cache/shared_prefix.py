"""Score rows on one shared prefix that read the prefix's keys and values where they are.

A suffix batch of the scorer (`scoring.PrefixScorer`) is B rows of up to W own tokens each on top of one
batch-1 prefix cache of P positions. Copying the prefix into every row (`kv_cache.broadcast_batch`)
holds B x P columns a layer at once; here each layer's `SharedPrefixRows` keeps the rows' own keys and
values and reads the prefix's from its batch-1 cache. The rows are packed side by side into a few
long query blocks ("packs" of `RowPacks.per_pack` rows): a pack's queries attend to [the prefix's
columns | the pack's own columns] under a mask that shows row r's token i every prefix column (within
the window, for a windowed layer) and row r's own tokens 0..i. One fused attention call a layer, and
exact: a hidden column adds exp(-inf) = 0 to its query's softmax.

Why packs and not cascade attention (the prefix part and the own part apart, merged by their
log-sum-exps)? MLX's fused attention does not return the log-sum-exp, and computing the prefix part by
hand materialises a (heads, B x W, P) block of scores a layer, which the fused kernel never does. A pack
pays instead for its own block's hidden columns (another row's tokens): a pack's own columns are kept
within about the prefix's length, so attention reads at most about twice the columns its rows need,
and each pack's keys are the prefix's joined with its own, a transient copy of one layer's prefix per
pack (about one layer's worth of the rows' own keys over all packs), never B copies held together.

Positions: every row's own tokens start at P (`offset`), so RoPE rotates the rows' queries and keys
exactly as a row on its own copy of the prefix would (the model's attention does that before `attend`).
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache, key_columns


class RowPacks:
    """How one suffix batch's rows are packed, and each window's mask over a pack's key columns (made
    once a forward, shared by the layers): `rows` rows of `width` positions on a `prefix`-position
    cache; with `bucket`, a pack's key columns are a whole number of cache steps (`key_columns`)."""

    def __init__(self, rows: int, width: int, prefix: int, bucket: bool = False) -> None:
        self.rows, self.width, self.prefix, self.bucket = rows, width, prefix, bucket
        self.per_pack = rows_per_pack(rows, width, prefix)
        self.packs = -(-rows // self.per_pack)
        self._masks: dict[tuple[int | None, int, mx.Dtype], mx.array] = {}

    def columns(self, held: int) -> int:
        """Key columns a pack's attention reads over `held` prefix columns."""
        n = held + self.per_pack * self.width
        return key_columns(n) if self.bucket else n

    def mask(self, window: int | None, base: int, dtype: mx.Dtype) -> mx.array:
        """The additive (1, 1, per_pack x width, columns) mask of a layer whose cache holds the prefix's
        positions `base`..`prefix` (a windowed layer's cache drops older ones)."""
        key = (window, base, dtype)
        if key not in self._masks:
            self._masks[key] = self._make_mask(window, base, dtype)
        return self._masks[key]

    def _make_mask(self, window: int | None, base: int, dtype: mx.Dtype) -> mx.array:
        held, k, w = self.prefix - base, self.per_pack, self.width
        own = mx.arange(k * w, dtype=mx.int32)
        q_row, q_pos = own // w, self.prefix + own % w  # each query's row in the pack, and position
        cols = self.columns(held)
        col = mx.arange(cols, dtype=mx.int32)
        in_prefix = col < held
        mine = col - held  # an own column's index in the pack (past the end: bucket padding)
        k_row = mx.where(in_prefix, -1, mine // w)
        k_pos = mx.where(in_prefix, base + col, self.prefix + mine % w)
        real = in_prefix | (mine < k * w)
        same = in_prefix[None, :] | (k_row[None, :] == q_row[:, None])
        visible = real[None, :] & same & (k_pos[None, :] <= q_pos[:, None])
        if window is not None:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
        zero, hidden = mx.array(0, dtype), mx.array(-mx.inf, dtype)
        return mx.where(visible, zero, hidden)[None, None]


def rows_per_pack(rows: int, width: int, prefix: int) -> int:
    """Rows a pack takes: as many as keep its own columns within the prefix's length (so the other rows'
    columns a query reads but may not see cost at most what the prefix costs), at least one."""
    return max(1, min(rows, prefix // max(width, 1)))


class SharedPrefixRows:
    """One layer's cache for a suffix batch over a shared batch-1 prefix (see the module docstring):
    `offset` is the prefix's length (where the rows' own positions start), and `attend` replaces the
    write-then-attend of a plain cache; nothing is written into the prefix's cache."""

    def __init__(self, prefix: KVCache, packs: RowPacks) -> None:
        if prefix.keys is None or prefix.offset != packs.prefix:
            raise ValueError(f"a shared prefix of {packs.prefix} positions needs a cache holding them")
        self.prefix, self.packs = prefix, packs

    @property
    def offset(self) -> int:
        return self.prefix.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Not how these rows attend: the model's attention calls `attend` for this cache."""
        raise TypeError("SharedPrefixRows is read through attend(), not update_and_fetch()")

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        """Attention output (B, heads, W, head_dim) of the rows' queries (B, heads, W, head_dim) over the
        prefix and their own keys and values (B, kv_heads, W, head_dim), all rotated already."""
        packs, b = self.packs, queries.shape[0]
        k, n = packs.per_pack, packs.packs
        prefix_k, prefix_v = self.prefix.state
        held = prefix_k.shape[2]
        spare = packs.columns(held) - held - k * packs.width

        def packed(a: mx.array) -> mx.array:  # (B, h, W, d) -> (packs, h, k x W, d), pad rows as zeros
            if n * k > b:
                a = mx.concatenate([a, mx.zeros((n * k - b, *a.shape[1:]), a.dtype)])
            h, w, d = a.shape[1:]
            return a.reshape(n, k, h, w, d).transpose(0, 2, 1, 3, 4).reshape(n, h, k * w, d)

        def joined(prefix: mx.array, own: mx.array) -> mx.array:
            parts = [mx.broadcast_to(prefix, (n, *prefix.shape[1:])), packed(own)]
            if spare:
                parts.append(mx.zeros((n, own.shape[1], spare, own.shape[3]), own.dtype))
            return mx.concatenate(parts, axis=2)

        mask = packs.mask(self.prefix.window, self.prefix.base, queries.dtype)
        out = mx.fast.scaled_dot_product_attention(
            packed(queries), joined(prefix_k, keys), joined(prefix_v, values), scale=scale, mask=mask
        )
        h, w, d = queries.shape[1], queries.shape[2], out.shape[3]
        out = out.reshape(n, h, k, w, d).transpose(0, 2, 1, 3, 4).reshape(n * k, h, w, d)
        return out[:b] if n * k > b else out
