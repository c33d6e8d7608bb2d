"""How a decode batch's rows are copied without their holes when its membership changes.

Verify steps leave holes (`BatchKVCache.trim_rows`); `BatchKVCache.keep` squeezes them out of the rows
it keeps in one gather a buffer. Working out that gather is host work over host ints, and every layer of
a batch holds the same columns: one `SqueezePlan` serves the batch's global layers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxq.worker.engine.cache.kv_cache import key_columns, pad_columns


class SqueezePlan:
    """How `BatchKVCache._squeezed` copies rows without their holes, worked out on the host from host
    ints: the buffer columns to gather, each row's first column, the buffers' first column and the
    spare room after `end`. The layers of a batch hold the same columns: its global layers share one."""

    def __init__(
        self, hidden: np.ndarray, starts: list[int], end: int, base: int, picked: list[int], live: int
    ) -> None:
        self.made_for = (tuple(picked), live, end, base)
        self.end, self.old_base = end, base
        rows_hidden = np.zeros((len(picked), end), dtype=bool)
        width = min(hidden.shape[1], end)
        rows_hidden[:, :width] = hidden[picked, :width]
        owned: list[np.ndarray] = []
        self.starts: list[int] = []
        first = base  # the new buffers' first column
        for n, row in enumerate(picked):
            first_own = starts[row] if n < live else end  # a padding row owns nothing
            own = np.arange(first_own, end, dtype=np.int32)[~rows_hidden[n, first_own:]]
            held = own[own >= base] - base
            if len(held) < len(own):
                first = max(first, end - len(held))
            owned.append(held)
            self.starts.append(end - len(own))
        self.base = first
        # Buffer columns (from the old `base`) to gather: padding reads column 0, masked.
        columns = np.zeros((len(picked), end - first), dtype=np.int32)
        for n, held in enumerate(owned):
            if len(held) > end - first:
                held = held[len(held) - (end - first) :]
            columns[n, end - first - len(held) :] = held
        self.gather = mx.array(columns)[:, None, :, None]  # (rows, 1, columns, 1)
        self.spare = key_columns(end - first + 1) - (end - first)

    def squeezed(self, buffer: mx.array, index: mx.array) -> mx.array:
        """The rows `index` of `buffer` (keys or values) without their holes, spare room after `end`."""
        rows = buffer[index, :, : self.end - self.old_base, :]
        shape = (*rows.shape[:2], self.end - self.base, rows.shape[3])
        picked_columns = mx.take_along_axis(rows, mx.broadcast_to(self.gather, shape), axis=2)
        return pad_columns(picked_columns, 0, self.spare)
