"""Score rows on one shared prefix that read the prefix's keys and values where they are.

A suffix batch of the scorer (`scoring.PrefixScorer`) is B rows of up to W own tokens each on top of one
batch-1 prefix cache of P positions. Copying the prefix into every row (`kv_cache.broadcast_batch`)
holds B x P columns a layer at once; here each layer's `SharedPrefixRows` keeps the rows' own keys and
values and reads the prefix's from its batch-1 cache, in one of two exact ways chosen by the device.

Where attention has a fused kernel (a GPU), packing: the rows go side by side into a few long query
blocks ("packs" of `RowPacks.per_pack` rows); a pack's queries attend to [the prefix's columns | the
pack's own columns] under a mask that shows row r's token i every prefix column (within the window,
for a windowed layer) and row r's own tokens 0..i. One fused attention call a layer, and exact: a
hidden column adds exp(-inf) = 0 to its query's softmax. A pack pays for its own
block's hidden columns (another row's tokens), so a pack's own columns are kept within about the
prefix's length (attention reads at most about twice the columns its rows need), and each pack's keys
are the prefix's joined with its own, a transient copy of one layer's prefix per pack (about one
layer's worth of the rows' own keys over all packs), never B copies held together. Cascade attention
(the prefix part and the own part apart, merged by their log-sum-exps) would need no hidden columns,
but MLX's fused attention does not return the log-sum-exp, and by hand the prefix part materialises a
(heads, B x W, P) block of scores a layer, which a fused kernel never does. On the CPU, MLX's attention
has no fused kernel and materialises its scores anyway, so there the cascade by hand is the cheaper
way (`_cascade`): every row's queries stacked into one block against the prefix's keys (one matmul, no
copy), the rows' own part apart, both under one softmax (a shared maximum), a bounded number of rows
at a time.

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
        self.fused = fused_attention()
        self.per_pack = rows_per_pack(rows, width, prefix, bucket)
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


def fused_attention() -> bool:
    """Whether MLX's attention runs as a fused kernel here (a GPU): packs; else the cascade by hand."""
    return bool(mx.default_device() == mx.gpu)


def rows_per_pack(rows: int, width: int, prefix: int, bucket: bool = False) -> int:
    """Rows a pack takes: as many as keep its own columns within the prefix's length (so the other rows'
    columns a query reads but may not see cost at most what the prefix costs), at least one; with
    `bucket`, a power of two (a GPU pads a batch's rows to one), so prefixes of many lengths make few
    query shapes."""
    n = max(1, min(rows, prefix // max(width, 1)))
    return 1 << (n.bit_length() - 1) if bucket else n


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
        if not self.packs.fused:
            return _cascade(queries, keys, values, self.prefix, scale)
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


SCORE_BLOCK_BYTES = 1 << 22  # the float32 scores `_cascade` holds at once, rows permitting


@mx.compile
def _shifted_exp(scores: mx.array, top: mx.array) -> mx.array:
    """exp(scores - top) in one pass over a block of scores, not two."""
    return mx.exp(scores - top)


def _cascade(q: mx.array, k: mx.array, v: mx.array, prefix: KVCache, scale: float) -> mx.array:
    """Attention of rows (B, heads, W, head_dim) over the prefix's columns and their own, in float32:
    per KV head, every row's queries (and the query heads sharing it) stacked against the prefix's keys
    in one matmul, the own part (B x W x W) apart; one softmax over both (`SCORE_BLOCK_BYTES`)."""
    b, h, w, d = q.shape
    kv_heads = k.shape[1]
    pk, pv = prefix.state
    held = pk.shape[2]
    own_pos = mx.arange(w)
    own = own_pos[None, :] <= own_pos[:, None]
    far = None
    if prefix.window is not None:  # a windowed layer: the band over the prefix's positions too
        own = own & (own_pos[:, None] - own_pos[None, :] < prefix.window)
        far = (prefix.offset + own_pos)[:, None] - (prefix.base + mx.arange(held))[None, :] >= prefix.window
    step = max(1, SCORE_BLOCK_BYTES // (4 * h * w * (held + w)))
    parts = [
        _cascade_rows(q[r : r + step], k[r : r + step], v[r : r + step], pk, pv, scale, own, far)
        for r in range(0, b, step)
    ]
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    return out.reshape(b, kv_heads, h // kv_heads, w, d).reshape(b, h, w, d).astype(q.dtype)


def _cascade_rows(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    pk: mx.array,
    pv: mx.array,
    scale: float,
    own: mx.array,
    far: mx.array | None,
) -> mx.array:
    """`_cascade` for a few rows: (B, kv_heads, group, W, head_dim) float32."""
    b, h, w, d = q.shape
    kv, held = k.shape[1], pk.shape[2]
    g = h // kv
    f32 = mx.float32
    qs = (q.astype(f32) * scale).reshape(b, kv, g, w, d).transpose(1, 2, 0, 3, 4)  # (kv, g, B, W, d)
    s_prefix = (qs.reshape(kv, g * b * w, d) @ pk[0].astype(f32).swapaxes(-1, -2)).reshape(kv, g, b, w, held)
    if far is not None:
        s_prefix = mx.where(far, -mx.inf, s_prefix)
    own_k = k.astype(f32).transpose(1, 0, 2, 3)[:, None]  # (kv, 1, B, W, d)
    s_own = mx.where(own, qs @ own_k.swapaxes(-1, -2), -mx.inf)  # (kv, g, B, W, W)
    top = mx.maximum(s_prefix.max(axis=-1, keepdims=True), s_own.max(axis=-1, keepdims=True))
    e_prefix, e_own = _shifted_exp(s_prefix, top), _shifted_exp(s_own, top)
    total = e_prefix.sum(axis=-1, keepdims=True) + e_own.sum(axis=-1, keepdims=True)
    from_prefix = (e_prefix.reshape(kv, g * b * w, held) @ pv[0].astype(f32)).reshape(kv, g, b, w, d)
    from_own = e_own @ v.astype(f32).transpose(1, 0, 2, 3)[:, None]
    return ((from_prefix + from_own) / total).transpose(2, 0, 1, 3, 4)  # (B, kv, g, W, d)
