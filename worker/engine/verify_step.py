"""A decode batch's verify steps (speculative decoding): the shapes they meet, what they keep, their time.

`DecodeBatch.verify_with` runs a verify step: one forward feeds every row its pending token and its
drafts, each row keeps the drafts the target agrees with, and its cache is cut back to them. The batch
keeps its rows and pending tokens and sequences the step; a `VerifyStep` it composes owns what is the
verify step's alone: the width of its forward, the forward itself and its verification (`forward`), the
key columns its attention reads, the shapes met so far (a new one may have built kernels), whether the
last step verified drafts at all, the caches cut back to the drafts kept and whether the holes this
leaves are squeezed out at once, and its timing (`clock`).
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.worker.engine.batch_forward import BatchForward
from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.forward_pieces import ForwardPieces
from mlxq.worker.engine.sampler_rows import SamplerRows
from mlxq.worker.engine.shapes import padded_size
from mlxq.worker.engine.speculation.verify_clock import VerifyClock

# Key and value bytes of a batch below which a verify step's holes are squeezed out at once (one copy)
_SQUEEZE_BYTES = 256 << 20


class VerifyStep:
    """The verify steps of one decode batch: their shapes met, their drafts' acceptance, their time.

    `pad_shapes`: the batch pads shapes (a GPU); `window`: the model's smallest sliding window (None
    where no layer slides); `shapes_met`: the shapes (rows, width, key columns) met so far, shared by
    the batches of one engine (the kernels a shape builds outlive the batch); None: this batch's own."""

    def __init__(
        self, pad_shapes: bool, window: int | None, shapes_met: set[tuple[int, int, int]] | None = None
    ) -> None:
        self.pad_shapes = pad_shapes
        self._window = window
        self.clock = VerifyClock()  # where the verify steps' time goes
        self._shapes = shapes_met if shapes_met is not None else set()  # (rows, width, key columns) met
        self.new_shape = False  # the last verify step's shape was met for the first time
        self.verified = False  # the last `verify_with` verified drafts (else it took a plain step)

    def width(self, drafts: list[list[int]]) -> int:
        """Columns the forward feeds each row: its pending token and the longest row's drafts; with
        `pad_shapes` a power of two (a GPU meets few widths; the columns past the drafts: never kept)."""
        width = 1 + max(len(d) for d in drafts)
        if self.pad_shapes and width > 1:
            width = padded_size(width, smallest=1)
        return width

    def read_columns(self, cache: list[BatchKVCache], width: int) -> int | None:
        """The key columns the forward of `width` columns reads: with `pad_shapes` and a width over 1,
        whole steps of the caches (`BatchKVCache.read_whole_steps`: the key lengths a GPU meets change
        once per 256 columns, not at every step; the layers then read so until `read_exactly`), except
        in a model with windowed layers; else None (exactly what they hold). Notes whether, with
        `pad_shapes` (a GPU), the step's shape (rows, width, key columns) is one met before
        (`new_shape`: a new one may have built kernels, so its time says nothing of the next; without
        padding shapes cost nothing to meet)."""
        first = cache[0]
        columns = None
        if self.pad_shapes and width > 1 and self._window is None:
            columns = first.read_whole_steps(width)
            for layer in cache[1:]:
                layer.read_whole_steps(width)
        shape = (first.batch, width, columns if columns is not None else first.end + width)
        self.new_shape = self.pad_shapes and shape not in self._shapes
        if self.pad_shapes:  # unpadded, every step's shape is new: nothing worth keeping
            self._shapes.add(shape)
        return columns

    def forward(
        self,
        rows: SamplerRows,
        forward: BatchForward,
        tokens: list[int],
        drafts: list[list[int]],
        width: int,
        allowed: mx.array | None,
        pieces: ForwardPieces,
    ) -> tuple[mx.array, mx.array]:
        """A verify step's forward and its verification (lazy): each row's pending token and drafts
        (`tokens`, `drafts`) fed in `width` columns (padded with columns no row keeps), its layers
        launched in `pieces` as they are built (`forward_pieces.py`), its attention reading the key
        columns the verify step says (`VerifyStep.read_columns`: whole steps of the caches on a GPU);
        returns the drafts each row keeps (`allowed`: the constrained rows' masks) and its next token."""
        cache = forward.cache
        fed = [[t, *d, *([0] * (width - 1 - len(d)))] for t, d in zip(tokens, drafts, strict=True)]
        columns = self.read_columns(cache, width)
        try:
            logits = forward.logits(mx.array(fed, dtype=mx.int32), cache[0].mask(width, columns), pieces)
        finally:
            for layer in cache:
                layer.read_exactly()
        if width == 1:
            return mx.zeros((len(tokens),), dtype=mx.int32), rows.sample(logits[:, 0])
        depth = mx.array([len(d) for d in drafts], dtype=mx.int32)
        ids = mx.array([row[1:] for row in fed], dtype=mx.int32)
        return rows.verify(logits, ids, depth, allowed)

    def keep(self, cache: list[BatchKVCache], slots: list[int], kept: list[int], width: int) -> bool:
        """Cut each live row's caches (its buffer row in `slots`) back to its pending token and the
        `kept` drafts of the `width` columns fed (idle rows keep all: nobody reads them); returns
        whether to copy the buffers now to squeeze the holes out (`squeeze_holes`)."""
        columns = [width] * cache[0].batch
        for slot, k in zip(slots, kept, strict=True):
            columns[slot] = 1 + k
        for layer in cache:
            layer.trim_rows(width, columns)
        return self.squeeze_holes(cache)

    def squeeze_holes(self, cache: list[BatchKVCache]) -> bool:
        """Whether to copy the buffers after a verify step to squeeze its holes out: always once a
        step's worth of columns is wasted; with `pad_shapes` (a GPU) at once while the buffers are
        small (`_SQUEEZE_BYTES`), since a row with holes needs a mask at every step until it leaves (no
        ragged kernel: `BatchForward._step_mask`), dearer over the steps that follow than one small copy."""
        first = cache[0]
        if not first.has_holes:
            return False
        if max(first.holes) >= BatchKVCache.step:
            return True
        return self.pad_shapes and sum(layer.nbytes for layer in cache) <= _SQUEEZE_BYTES
