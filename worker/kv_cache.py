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

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (B, n_kv_heads, L, head_dim) keys/values; return all of them so far (up to offset + L)."""
        start, n = self.offset, keys.shape[2]
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if start + n > capacity:
            self._grow(keys, values, start + n)
        assert self.keys is not None and self.values is not None
        self.offset = start + n
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

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


def copy_cache(caches: list[KVCache]) -> list[KVCache]:
    """Independent copies holding the same positions; writing to one never changes the other.

    Cheap: MLX arrays are immutable underneath, the copy only takes fresh array objects (sliced to
    offset, so its first write allocates a new buffer instead of touching the shared one).
    """
    return [KVCache.from_state(*c.state) if c.keys is not None else KVCache() for c in caches]


def broadcast_batch(caches: list[KVCache], batch: int) -> list[KVCache]:
    """Turn a batch-1 cache (e.g. a shared prompt prefix) into a batch of `batch` identical rows.

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
        out.append(KVCache.from_state(mx.repeat(keys, batch, axis=0), mx.repeat(values, batch, axis=0)))
    return out
