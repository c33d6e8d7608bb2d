"""Per-layer key/value caches for incremental decoding.

A model's cache is a list with one `KVCache` per layer (`model.make_cache()`). Keys and values are
stored as (B, n_kv_heads, capacity, head_dim) buffers that grow `step` positions at a time, so decoding
one token writes into spare room instead of concatenating the whole history every step.

MLX arrays assigned into (`a[...] = b`) are updated through their Python object, so two caches must
never share one buffer object: `copy_cache` and `broadcast_batch` always give fresh ones.

A sliding-window layer's cache (`window` set) keeps only the columns a query can still see. Its keys are
stored after RoPE, so a column carries its position and dropping older ones changes nothing for the
rest: the cache's buffers start at position `base` (the count of positions dropped), `offset` stays
the sequence's length, and attention reads the buffers from `base` on (masks are built over positions
0..offset and right-aligned to the keys: `attention.Attention`). Why not a rotating buffer (mlx-lm's
`RotatingKVCache`)? Its columns are out of position order once it wraps, so every mask, the ragged
decode kernel, the batch's left padding and holes, the prefix cache and speculation's rollbacks would
each need a second layout. Here the layout is the same as a global layer's, cut on the left: before a
write, when `rollback` + `window` - 1 + a whole step of columns sit before the write position, the
oldest whole steps go in one copy (`_slide`), so the copy is amortized over a step of tokens and the
buffer keeps its shape (the freed steps become spare room at the end; a buffer a long prefill chunk
left far wider than the held columns shrinks to a step past them). What stays: the window - 1
positions the next query sees, plus `ROLLBACK` positions a verify step, a chunk's padding or a
drafter may take back (`trim`), plus less than a step: a window of W holds at most
W - 1 + ROLLBACK + 2 steps, however long the sequence.
"""

from __future__ import annotations

import mlx.core as mx

# Positions a windowed cache keeps beyond its window before the write position, so a rollback of up to
# this many positions (`trim`: a verify step's rejected drafts, a chunk's right padding, a drafter's
# proposals) finds the keys its next queries see.
ROLLBACK = 256


def slide_base(base: int, first_query: int, window: int | None, step: int) -> int:
    """The first position a windowed cache must still hold before queries from `first_query` on (and
    rollbacks of up to `ROLLBACK` positions) run, moved on from `base` in whole steps only; `base`
    itself where less than a step could go, or for a global layer (`window` None)."""
    if window is None:
        return base
    floor = first_query - (window - 1) - ROLLBACK
    return base + max(0, (floor - base) // step * step)


class KVCache:
    """Keys and values of one attention layer, written at `offset` and read back up to it; with a
    `window`, only positions from `base` on are held (see the module docstring)."""

    step = 256

    def __init__(self, window: int | None = None) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.window = window  # a sliding-window layer's window: older positions are dropped
        self.base = 0  # positions dropped: the buffers' column 0 holds position `base`
        self.pinned: int | None = None  # a windowed cache never drops what a query from here on sees

    def update_and_fetch(
        self, keys: mx.array, values: mx.array, columns: int | None = None
    ) -> tuple[mx.array, mx.array]:
        """Append (B, n_kv_heads, L, head_dim) keys/values; return all of them so far (up to offset + L).

        `columns`: return that many columns instead (at least offset + L): the ones past the written
        positions hold zeros or stale keys, which the caller's mask must hide (see `key_columns`).
        A windowed cache returns its columns from `base` on only (the mask's last ones).
        """
        self._slide()
        start, n = self.offset, keys.shape[2]
        end = max(start + n, columns or 0)
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if end - self.base > capacity:
            self._grow(keys, values, end - self.base)
        assert self.keys is not None and self.values is not None
        self.offset = start + n
        self.keys[..., start - self.base : self.offset - self.base, :] = keys
        self.values[..., start - self.base : self.offset - self.base, :] = values
        end = (columns or self.offset) - self.base
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _slide(self) -> None:
        """A windowed cache: drop the whole steps of oldest columns no query from `offset` on sees (nor
        one after a rollback, nor one from `pinned` on), in one copy; the buffers keep their shape unless
        it is far more than the held columns need."""
        if self.window is None:
            return
        first = self.offset if self.pinned is None else min(self.offset, self.pinned)
        base = slide_base(self.base, first, self.window, self.step)
        if base == self.base or self.keys is None or self.values is None:
            return
        self.keys, self.values = drop_oldest(
            self.keys, self.values, base - self.base, self.offset - self.base, self.step
        )
        self.base = base

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        """Extend the buffers to `needed` rounded up to a whole number of steps."""
        capacity = 0 if self.keys is None else self.keys.shape[2]
        extra = -(-needed // self.step) * self.step - capacity
        b, kv_heads, _, k_dim = keys.shape
        new_k = mx.zeros((b, kv_heads, extra, k_dim), keys.dtype)
        new_v = mx.zeros((b, kv_heads, extra, values.shape[3]), values.dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
        else:
            # Spare room past offset is garbage anyway (after a trim); keep it rather than slicing it off.
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The (keys, values) held, each (B, n_kv_heads, offset - base, head_dim): positions `base` to
        `offset` (all written ones but a windowed cache's dropped ones); empty: zero-size."""
        if self.keys is None or self.values is None:
            empty = mx.zeros((0,), mx.float32)
            return empty, empty
        held = self.offset - self.base
        return self.keys[..., :held, :], self.values[..., :held, :]

    @state.setter
    def state(self, kv: tuple[mx.array, mx.array]) -> None:
        keys, values = kv
        self.keys, self.values = keys, values
        self.offset = self.base + keys.shape[2]

    @classmethod
    def from_state(
        cls, keys: mx.array, values: mx.array, base: int = 0, window: int | None = None
    ) -> KVCache:
        """A cache holding exactly these (B, n_kv_heads, T, head_dim) keys/values of positions
        `base`..`base` + T (a windowed cache's held ones), offset `base` + T."""
        cache = cls(window)
        cache.base = base
        cache.state = (keys, values)
        return cache

    def trim(self, n: int) -> int:
        """Forget the last `n` positions (at most offset); return how many were forgotten. A windowed
        cache refuses to go back so far that a later query would miss keys it dropped (more than
        `ROLLBACK` positions before its last drop)."""
        n = max(0, min(self.offset, n))
        if self.base and self.offset - n < self.base + self.window_reach:
            raise ValueError(
                f"a sliding-window cache holding positions {self.base}..{self.offset} cannot go back "
                f"to {self.offset - n}: its window needs positions it dropped"
            )
        self.offset -= n
        return n

    @property
    def window_reach(self) -> int:
        """Positions before a query that it sees: window - 1 (0 for a global layer, which drops none)."""
        return 0 if self.window is None else self.window - 1

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers, including spare room past `offset`."""
        if self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)

    def __repr__(self) -> str:
        return f"KVCache(offset={self.offset}, nbytes={self.nbytes})"


def key_columns(total: int) -> int:
    """Key columns attention reads for `total` positions when shapes are bucketed: `total` rounded up to
    a whole number of cache steps.

    On MLX's CUDA build attention over many queries goes through cuDNN, whose plans are built per shape
    of the keys: a prefix length met for the first time costs a plan build, many times the attention
    itself (`bench/README.md`, what the engine's defaults rest on). Reading whole steps of the cache
    (the extra columns masked) leaves one shape per 256 positions.
    """
    return -(-total // KVCache.step) * KVCache.step


def pad_columns(a: mx.array, left: int, right: int) -> mx.array:
    """`a` (B, H, T, D) with `left` zero columns before and `right` after."""
    if left == 0 and right == 0:
        return a
    b, h, _, d = a.shape
    parts = [mx.zeros((b, h, left, d), a.dtype)] if left else []
    parts.append(a)
    if right:
        parts.append(mx.zeros((b, h, right, d), a.dtype))
    return mx.concatenate(parts, axis=2)


def drop_oldest(
    keys: mx.array, values: mx.array, drop: int, held: int, step: int
) -> tuple[mx.array, mx.array]:
    """A windowed layer's buffers without their `drop` oldest columns (of the `held` ones written), in one
    copy: the same shape (the dropped steps become spare room), or a step past the held columns where a
    long chunk or a joining row left far more."""
    kept = held - drop
    spare = min(keys.shape[2], key_columns(kept) + step) - kept

    def cut(a: mx.array) -> mx.array:
        return mx.concatenate(
            [a[..., drop:held, :], mx.zeros((*a.shape[:2], spare, a.shape[3]), a.dtype)], axis=2
        )

    return cut(keys), cut(values)


def held_columns(total: int, window: int | None) -> int:
    """Columns a layer's buffers may hold for a sequence of `total` positions (whole steps, spare room
    included): all of them for a global layer; for a windowed one at most its window, what a rollback
    may take back and the whole steps its drops and growth go by (`_slide`, `BatchKVCache`), however
    long the sequence."""
    columns = key_columns(total)
    if window is None:
        return columns
    return min(columns, key_columns(window + ROLLBACK + 2 * KVCache.step) + KVCache.step)


def copy_cache(caches: list[KVCache]) -> list[KVCache]:
    """Independent copies holding the same positions; writing to one never changes the other.

    Cheap: MLX arrays are immutable underneath, the copy only takes fresh array objects (sliced to
    offset, so its first write allocates a new buffer instead of touching the shared one).
    """
    return [
        KVCache.from_state(*c.state, base=c.base, window=c.window)
        if c.keys is not None
        else KVCache(c.window)
        for c in caches
    ]


def broadcast_batch(caches: list[KVCache], batch: int, room: int = 0) -> list[KVCache]:
    """Turn a batch-1 cache (e.g. a shared prompt prefix) into a batch of `batch` identical rows, with
    buffers holding `room` more positions (rounded up to whole steps) so the next forward writes in place.

    The rows are materialised (not a stride-0 view) because each row is then written independently.
    """
    out = []
    for c in caches:
        if c.keys is None:
            out.append(KVCache(c.window))
            continue
        keys, values = c.state
        if keys.shape[0] != 1:
            raise ValueError(f"broadcast_batch needs a batch-1 cache, got batch {keys.shape[0]}")
        spare = key_columns(c.offset + room) - c.offset if room else 0

        def rows(a: mx.array, spare: int = spare) -> mx.array:
            if spare:
                a = mx.concatenate([a, mx.zeros((1, a.shape[1], spare, a.shape[3]), a.dtype)], axis=2)
            return mx.repeat(a, batch, axis=0)

        cache = KVCache(c.window)
        cache.keys, cache.values, cache.offset, cache.base = rows(keys), rows(values), c.offset, c.base
        out.append(cache)
    return out
