"""Per-layer key/value caches for incremental decoding.

A model's cache is a list with one `KVCache` per layer (`model.make_cache()`). Keys and values are
stored as (B, n_kv_heads, capacity, head_dim) buffers that grow `step` positions at a time, so decoding
one token writes into spare room instead of concatenating the whole history every step.

MLX arrays assigned into (`a[...] = b`) are updated through their Python object, so two caches must
never share one buffer object: `copy_cache` and `broadcast_batch` always give fresh ones.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values of one attention layer, written at `offset` and read back up to it."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(
        self, keys: mx.array, values: mx.array, columns: int | None = None
    ) -> tuple[mx.array, mx.array]:
        """Append (B, n_kv_heads, L, head_dim) keys/values; return all of them so far (up to offset + L).

        `columns`: return that many columns instead (at least offset + L): the ones past the written
        positions hold zeros or stale keys, which the caller's mask must hide (see `key_columns`).
        """
        start, n = self.offset, keys.shape[2]
        end = max(start + n, columns or 0)
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if end > capacity:
            self._grow(keys, values, end)
        assert self.keys is not None and self.values is not None
        self.offset = start + n
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        end = columns or self.offset
        return self.keys[..., :end, :], self.values[..., :end, :]

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
        """The (keys, values) written so far, each (B, n_kv_heads, offset, head_dim); empty: zero-size."""
        if self.keys is None or self.values is None:
            empty = mx.zeros((0,), mx.float32)
            return empty, empty
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, kv: tuple[mx.array, mx.array]) -> None:
        keys, values = kv
        self.keys, self.values = keys, values
        self.offset = keys.shape[2]

    @classmethod
    def from_state(cls, keys: mx.array, values: mx.array) -> KVCache:
        """A cache holding exactly these (B, n_kv_heads, T, head_dim) keys/values, offset T."""
        cache = cls()
        cache.state = (keys, values)
        return cache

    def trim(self, n: int) -> int:
        """Forget the last `n` positions (at most offset); return how many were forgotten."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

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


def copy_cache(caches: list[KVCache]) -> list[KVCache]:
    """Independent copies holding the same positions; writing to one never changes the other.

    Cheap: MLX arrays are immutable underneath, the copy only takes fresh array objects (sliced to
    offset, so its first write allocates a new buffer instead of touching the shared one).
    """
    return [KVCache.from_state(*c.state) if c.keys is not None else KVCache() for c in caches]


def broadcast_batch(caches: list[KVCache], batch: int, room: int = 0) -> list[KVCache]:
    """Turn a batch-1 cache (e.g. a shared prompt prefix) into a batch of `batch` identical rows, with
    buffers holding `room` more positions (rounded up to whole steps) so the next forward writes in place.

    The rows are materialised (not a stride-0 view) because each row is then written independently.
    """
    out = []
    for c in caches:
        if c.keys is None:
            out.append(KVCache())
            continue
        keys, values = c.state
        if keys.shape[0] != 1:
            raise ValueError(f"broadcast_batch needs a batch-1 cache, got batch {keys.shape[0]}")
        n = keys.shape[2]
        spare = key_columns(n + room) - n if room else 0

        def rows(a: mx.array, spare: int = spare) -> mx.array:
            if spare:
                a = mx.concatenate([a, mx.zeros((1, a.shape[1], spare, a.shape[3]), a.dtype)], axis=2)
            return mx.repeat(a, batch, axis=0)

        cache = KVCache()
        cache.keys, cache.values, cache.offset = rows(keys), rows(values), n
        out.append(cache)
    return out
