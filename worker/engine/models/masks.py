"""The masks a Llama-family forward hands its layers (`Mask`): a boolean mask made additive once a
forward (`additive_mask`), one query's row of it (`mask_for_one_query`) and bucketed key columns over
a cached prefix (`bucketed_keys`). A sliding window narrows each of them (`window.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache, key_columns
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.ragged_attention import RaggedRows

Mask = mx.array | str | RaggedRows | None


def mask_for_one_query(mask: Mask, last: int, n: int, cache: LayerCache | None) -> Mask:
    """The mask of query `last` alone (of `n` new positions): its row of an explicit mask; for causal
    attention nothing when it is the last position (it sees every key), else the keys up to its own."""
    if isinstance(mask, mx.array):
        return mask[..., last : last + 1, :] if mask.shape[-2] == n else mask
    if last == n - 1:
        return None
    offset = cache.offset if cache is not None else 0
    if not isinstance(offset, int):
        raise ValueError("a causal one-query mask needs one offset for every row")
    return mx.arange(offset + n) <= offset + last


def bucketed_keys(
    inputs: mx.array, caches: Sequence[LayerCache | None], dtype: mx.Dtype
) -> tuple[int, mx.array] | None:
    """For L new positions on top of a cached prefix: the cache columns to read (`key_columns`) and the
    additive (1, 1, L, columns) causal mask hiding the columns past each query; None when the exact
    key count is already a whole number of steps (or there is no cached prefix to bucket)."""
    cache, n = caches[0], inputs.shape[1] if inputs.ndim == 2 else 1
    if n <= 1 or type(cache) is not KVCache or not cache.offset:
        return None
    offset = cache.offset
    columns = key_columns(offset + n)
    if columns == offset + n:
        return None
    visible = mx.arange(columns)[None, :] <= mx.arange(offset, offset + n)[:, None]
    return columns, additive_mask(visible, dtype)[None, None]


def additive_mask(visible: mx.array, dtype: mx.Dtype) -> mx.array:
    """A boolean mask (True: attend) as the additive one attention takes: 0 where it attends, -inf
    elsewhere, in `dtype`. MLX's fused attention on CUDA takes no boolean mask: given one, it converts it
    in every layer (a kernel, and its launch, each), where a forward converts it once here."""
    return mx.where(visible, mx.array(0, dtype), mx.array(-mx.inf, dtype))
