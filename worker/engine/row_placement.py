"""Which row of a decode batch's buffers holds each of its live rows, and the copies that change it.

A decode batch's caches (`BatchKVCache`, one a layer) hold a row per sequence and, with `pad_shapes`,
padding rows after them (`DecodeBatch`). A row that leaves a padded batch becomes an idle row where it
is, and a row that joins takes an idle row when one is free, so the batch's live rows (in row order:
its samplers, pending tokens and results) are not always the buffers' first rows in that order. A
`RowPlacement` the batch composes owns that map (`slots`; `index`, the same as an array, for a
forward's scatter and gather), the idle rows, and the copies of the buffers that change it: writing
newcomers into idle rows or appending them, compacting the live rows to the front, padding to a
power of two. Each verb that places rows (`join`, `adopt`, `keep`) fits the buffers to them after.

The placement counts the rows it has placed (`placed`), not the batch's rows: rows joining are placed
first (`join`), and the batch takes their samplers and pending tokens after, so within
`DecodeBatch.add` the placement counts them before the batch does; everywhere else the two agree.
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.shapes import padded_size


class RowPlacement:
    """The buffer row of each live row of a decode batch whose layers are `cache` (the batch's own list:
    every copy changes all its layers alike); `pad_shapes`: the buffers hold a power-of-two number of
    rows (a GPU)."""

    def __init__(self, cache: list[BatchKVCache], pad_shapes: bool) -> None:
        self.cache = cache
        self.pad_shapes = pad_shapes
        self.slots: list[int] = []  # each live row's row of the buffers, in row order
        self.index: mx.array | None = None  # `slots` as an array; None while slots are 0..B-1

    @property
    def placed(self) -> int:
        """Live rows placed in the buffers (`slots`): ahead of the batch's own count while rows join."""
        return len(self.slots)

    @property
    def idle(self) -> int:
        """Rows of the buffers that hold no live row: padding, and rows whose request left."""
        return self.cache[0].batch - len(self.slots)

    def idle_rows(self) -> list[int]:
        """Those rows, in buffer order."""
        taken = set(self.slots)
        return [r for r in range(self.cache[0].batch) if r not in taken]

    def spread(self, fed: mx.array) -> mx.array:
        """A forward's input (live rows, W), or (live rows,), as the buffers' rows: each live row at its
        buffer row, idle rows fed zeros."""
        if self.index is not None:  # live rows scattered among idle ones
            scattered = mx.zeros((self.cache[0].batch, *fed.shape[1:]), dtype=fed.dtype)
            scattered[self.index] = fed
            return scattered
        idle = self.idle
        if idle:
            return mx.concatenate([fed, mx.zeros((idle, *fed.shape[1:]), dtype=fed.dtype)])
        return fed

    def live(self, rows: mx.array) -> mx.array:
        """The live rows of a forward's output (buffer rows first), in row order."""
        return rows[: len(self.slots)] if self.index is None else rows[self.index]

    def join(self, caches: list[list[KVCache]]) -> None:
        """Place joining rows, last in row order, from their prefilled batch-1 `caches` (each a list of
        layers): into idle buffer rows where those suffice (`_join_in_place`: no copy of the buffers),
        else by one copy of the buffers for all of them, after the live rows (compacted first where
        idle rows or a scatter lie among them); then fit the buffers. The placement counts them from
        here (`placed`): the batch takes their samplers after."""
        if not self._join_in_place(caches):
            if self.idle or self.index is not None:  # live rows first, in row order
                self.compact([])
            for n, layer in enumerate(self.cache):
                layer.add([cache[n] for cache in caches])
            self._set_slots(list(range(len(self.slots) + len(caches))))
        self._pad()

    def adopt(self, rows: int) -> None:
        """The buffers' first `rows` rows hold the live rows, in row order (a batch started on a rows
        prefill's buffers: `BatchKVCache.adopt`); then fit the buffers."""
        self._set_slots(list(range(rows)))
        self._pad()

    def keep(self, rows: list[int]) -> None:
        """Only the live rows `rows` (their places in row order) stay, in that order; the others'
        buffer rows become idle rows; then fit the buffers (compacted only when the batch can shrink)."""
        self._set_slots([self.slots[i] for i in rows])
        self._pad()

    def compact(self, idle: list[int]) -> None:
        """One copy of the buffers: the live rows first (in row order), then the buffer rows `idle`."""
        first = self.cache[0]
        for layer in self.cache:
            layer.keep(self.slots, idle, like=None if layer is first else first)
        self._set_slots(list(range(len(self.slots))))

    def _join_in_place(self, caches: list[list[KVCache]]) -> bool:
        """Put joining rows into idle buffer rows (padding, or rows that left) when there are enough
        and none is longer than the batch's rows: each layer writes the newcomers' columns, and the
        buffers are not copied. False when they must be added by copying the buffers."""
        idle = self.idle_rows()
        if len(idle) < len(caches):
            return False
        targets = idle[: len(caches)]
        if not all(layer.can_put([cache[n] for cache in caches]) for n, layer in enumerate(self.cache)):
            return False  # longer than the batch's rows, or (windowed layers) holding too few columns
        for n, layer in enumerate(self.cache):
            taken = layer.put(targets, [cache[n] for cache in caches])
            assert taken, "the layers of a batch took the same rows"
        self._set_slots([*self.slots, *targets])
        return True

    def _set_slots(self, slots: list[int]) -> None:
        self.slots = slots
        contiguous = slots == list(range(len(slots)))
        self.index = None if contiguous else mx.array(slots, dtype=mx.int32)

    def _pad(self) -> None:
        """Fit the buffers to the live rows: with `pad_shapes` a power-of-two number of rows, idle rows
        kept until the live ones fit a smaller power of two; without, exactly the live rows."""
        live, rows = len(self.slots), self.cache[0].batch
        want = padded_size(live, smallest=1) if self.pad_shapes and live else live
        if rows > want:
            self.compact(self.idle_rows()[: want - live])
        elif rows < want:
            for layer in self.cache:
                layer.add_padding(want - rows)
