"""One forward of a decode batch: its model over the batch's caches, for the live rows' tokens.

`DecodeBatch` decides what each step feeds and samples, launches and reads back; a `BatchForward` it
composes builds the forward itself (`logits`): what a step's attention needs of the rows' lengths
(nothing, a mask, or the ragged kernel's rows), the tokens spread over the buffer rows that hold the
live rows (`row_placement.py`), the live rows' logits, and the tapped layers' outputs handed on.

With `ragged_kernel` (default: where it runs, MLX's CUDA build) rows of different lengths attend through
`ragged_attention.decode_attention` instead of MLX's attention with a mask.

With `taps` (decoder layer indices) and `features`, every forward the batch builds (plain, ahead
or verify) also collects those layers' outputs (`layer_taps.py`) and hands them to `features`
with each live row's position of the first token it feeds: a drafter reading the target's hidden
states (DFlash) follows its row with them. A forward that is dropped or whose drafts are not kept
is followed by one feeding the same positions again, so a reader keeps, of what it was handed,
what the latest forward at each position gave.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlxq.worker.engine import ragged_attention
from mlxq.worker.engine.cache.batch_cache import BatchKVCache, one_offset
from mlxq.worker.engine.forward_pieces import ForwardPieces
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.layer_taps import LayerTaps
from mlxq.worker.engine.row_placement import RowPlacement

# Where a decode batch hands the tapped layers' outputs of each forward: each live row's position of
# its first fed token, and the features (live rows, W, features), rows in row order (`DecodeBatch.taps`);
# returns the arrays it made of them, computed with the step (nothing lazy piles up over plain steps).
FeatureSink = Callable[[list[int], mx.array], list[mx.array]]


class BatchForward:
    """The forwards of one decode batch over its caches (`cache`, its rows placed by `placement`).

    `window`: the model's smallest sliding window (None where no layer slides); `taps` and `features`:
    see the module docstring."""

    def __init__(
        self,
        model: Model,
        cache: list[BatchKVCache],
        placement: RowPlacement,
        ragged_kernel: bool,
        window: int | None,
        taps: tuple[int, ...],
        features: FeatureSink | None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.placement = placement
        self.ragged_kernel = ragged_kernel
        self._window = window
        self.taps = taps
        self.features = features
        self._with_step: list[mx.array] = []  # what `features` made of the forward being built
        # One position a row goes in as ids (B,) and comes out as logits (B, vocab) (`Model.flat_steps`);
        # not with taps: their sink takes each layer's (B, W, features).
        self._flat = not taps and model.flat_steps

    def logits(
        self,
        pending: mx.array,
        mask: mx.array | ragged_attention.RaggedRows | None = None,
        pieces: ForwardPieces | None = None,
    ) -> mx.array:
        """The logits of the forward that feeds `pending` (not evaluated yet): (live rows, vocab) for one
        token per row (B,) with the step's own mask; (live rows, W, vocab) for W tokens per row (B, W)
        with `mask` (`BatchKVCache.mask(W)`). `pieces`: launches the layers as they are built."""
        one = pending.ndim == 1
        taps = LayerTaps(self.taps) if self.taps else None
        flat = one and self._flat
        fed = pending[:, None] if one and not flat else pending
        if one:
            mask = self._step_mask()
        fed = self.placement.spread(fed)
        lengths = self.cache[0].lengths if taps else []  # before the forward: each row's first position
        sink = taps if pieces is None else pieces.passing(taps)
        with one_offset(self.cache):
            logits = self.model(fed, cache=self.cache, mask=mask, taps=sink)
        if taps is not None:
            assert self.features is not None
            made = self.features(
                [lengths[s] for s in self.placement.slots], self.placement.live(taps.features())
            )
            self._with_step.extend(made)
        if one and not flat:
            logits = logits[:, -1, :]
        return self.placement.live(logits)

    def taken_with_step(self) -> list[mx.array]:
        """What the feature sink made of the forwards built since the last launch (then forgotten)."""
        made, self._with_step = self._with_step, []
        return made

    def _step_mask(self) -> mx.array | ragged_attention.RaggedRows | None:
        """What a step's attention needs of the rows' lengths: nothing when all rows are as long, else
        a mask, or with the ragged kernel each row's first column (the buffers made long enough first,
        so the forward's writes keep them in place). Rows past a sliding window take the kernel even
        when all are as long: a windowed layer would need a mask (`window.py`)."""
        first = self.cache[0]
        slides = self._window is not None and first.end + 1 > self._window
        if not self.ragged_kernel or first.has_holes or not (any(first.starts) or slides):
            return first.mask()
        for layer in self.cache:
            layer.reserve(1)
        return ragged_attention.RaggedRows(first._starts, first.end + 1, first.capacity)
