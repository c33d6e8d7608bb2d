"""The decode loop: many sequences decoded in one forward per step, one step in flight.

Yields token ids only; text, stop strings, streaming and Redis live one layer up (`text_run.py`,
`generation_batch.py`); prompts come in through `prefill.py`. `DecodeBatch` decodes many sequences in
one forward per step, each row with its own sampler; its cache layout (left padding, per-row RoPE
offsets) is explained in `batch_cache.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import mlx.core as mx

from mlxq.worker.engine import ragged_attention
from mlxq.worker.engine.batch_forward import BatchForward, FeatureSink
from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.cache.prefill_rows_cache import PrefillRowsCache
from mlxq.worker.engine.forward_ahead import ForwardAhead
from mlxq.worker.engine.forward_pieces import ForwardPieces
from mlxq.worker.engine.launcher import Launcher
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.pending_tokens import PendingTokens
from mlxq.worker.engine.row_placement import RowPlacement
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.sampler_rows import SamplerRows
from mlxq.worker.engine.token_logprobs import TokenLogprob
from mlxq.worker.engine.verify_step import VerifyStep

# Release MLX's buffer cache at intervals, not every token: freeing is cheap, reallocating is not.
_CLEAR_CACHE_EVERY = 256

T = TypeVar("T")


class DecodeBatch:
    """Sequences decoded together: one forward per step for every row, each row sampled on its own.

    Rows join with their prefilled batch-1 cache and last logits (`add`) and leave with their cache (`remove`)
    between steps; the others never recompute anything. One step stays in flight: a step's tokens are handled
    while the next one computes, except right after rows join (see `step_with`).

    With `pad_shapes` the forward runs on a power-of-two number of rows: padding rows (no tokens, all masked)
    follow the real ones, so a GPU meets 7 batch shapes up to 64 rows instead of 64 (a new shape builds its
    kernels, far dearer than a step). A row that leaves then becomes an idle row where it is, like a padding
    row, and a row that joins takes an idle row when one is free (no longer than the batch's rows): the
    buffers are copied only when the live rows fit a smaller power of two or newcomers find no room, not at
    every departure and arrival. Which buffer row holds each live row is the `placement`'s
    (`row_placement.py`).

    The forward itself (the step's mask or the ragged kernel's rows, the buffer rows, the tapped layers'
    outputs handed to `features`) is the `forward`'s (`batch_forward.py`). The tokens a step hands the
    next (sampled, not fed yet), their logprobs, their launch and their read-back are the `pending`
    tokens' (`pending_tokens.py`).

    With `launcher` (`launcher.py`: a GPU's default) each step is launched on a thread of its own while this
    thread reads the step before back, handles its tokens and builds the next step: on a GPU a batched step is
    bound by the host (graph building and MLX's launch, C++ that releases the GIL, each take longer than the
    device's work), so the Python (building, text, stop strings, streams) runs in time that was lost, and a
    step costs about its launch; a verify step's forward is launched in pieces as it is built
    (`forward_pieces.py`). This thread calls `quiet()` before it evaluates anything else. Either way, the
    first step after rows joined reads their first tokens back before it builds the next step (see
    `step_with`).

    A batch holding a constrained row keeps one forward ahead instead (`ahead`, `forward_ahead.py`): its
    pending tokens are already being fed while they are read back, so the draw that needs their
    grammars' masks and the forward after it are launched one right after the other (two evaluations:
    see `PendingTokens.launch`), and the tokens are read back and handled while that forward computes
    (`_step_ahead`). The cache then holds one token past those handled: a leaving row's cache is cut
    back to its own (`remove`), and the forward ahead is dropped (its column trimmed) before rows join
    or a verify step.

    With `masks_in_place` (where the backend lets the host write an evaluated array's memory:
    `mask_buffer.host_writes_seen`) the draw reads the rows' mask buffer, which the masks are written
    into on a thread of their own while this thread builds that draw and forward (`ForwardAhead.build`)."""

    def __init__(
        self,
        model: Model,
        pad_shapes: bool = False,
        ragged_kernel: bool | None = None,
        launcher: Launcher | None = None,
        masks_in_place: bool = False,
        build_ahead: bool = False,
        taps: Sequence[int] = (),
        features: FeatureSink | None = None,
        verify_shapes: set[tuple[int, int, int]] | None = None,
    ) -> None:
        self.taps = tuple(taps) if features is not None else ()
        self.pad_shapes = pad_shapes
        self.launcher = launcher
        kernel = ragged_attention.available() if ragged_kernel is None else ragged_kernel
        self._window = min((w for w in model.model.windows if w is not None), default=None)
        self.cache = [BatchKVCache(window) for window in model.model.windows]
        self.rows: SamplerRows | None = None  # the live rows' samplers, in row order
        self.logprobs: dict[int, TokenLogprob] = {}  # row -> logprob of the token last handed out
        self.placement = RowPlacement(self.cache, pad_shapes)  # which buffer row holds each live row
        # The forwards over the caches (the step's mask, the buffer rows, the taps)
        self.forward = BatchForward(
            model, self.cache, self.placement, kernel, self._window, self.taps, features
        )
        # The live rows' sampled tokens not fed yet, their logprobs, their launch and read-back
        self.pending = PendingTokens(launcher, self.forward)
        self._steps = 0
        # With a constrained row: the forward that feeds the pending tokens, launched, and its time
        # (see `step_with`)
        self.ahead = ForwardAhead(launcher, masks_in_place, build_ahead)
        # The verify steps' shapes met (`verify_shapes`: an engine's, shared by its batches; None: this
        # batch's own), their drafts' acceptance and their time (`verify_with`)
        self.verify_step = VerifyStep(pad_shapes, self._window, verify_shapes)

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else 0

    def add(self, caches: list[list[KVCache]], logits: mx.array, samplers: list[Sampler]) -> None:
        """New last rows: their prefilled batch-1 caches, the (k, V) logits their first tokens are sampled
        from, and their samplers. They go into idle buffer rows where those suffice (no copy of the
        buffers), else the buffers are copied once for all of them (`RowPlacement.join`)."""
        if not caches:
            return
        self.ahead.drop(self.cache)
        joining = SamplerRows(samplers, logits.shape[-1])
        tokens = joining.sample(logits)
        self.placement.join(caches)  # placed first: counted there before `rows` takes their samplers
        pending = self.pending.join(tokens, joining)
        if self.rows is None:
            self.rows = joining
        else:
            self.rows.extend(joining)
        assert len(self.rows) == self.placement.placed, "one prefilled cache for each sampler"
        self.pending.launch(pending)

    def start(self, layers: list[PrefillRowsCache], logits: mx.array, samplers: list[Sampler]) -> bool:
        """An empty batch's rows straight from a rows prefill's buffers (`prefill_rows_layers`, one row
        per sampler, then its padding rows): no copy, where `add` would copy every row into new
        buffers. False (nothing changed) where `BatchKVCache.adopt` cannot take them."""
        if len(self) or not self.cache[0].adopt(layers[0], len(samplers)):
            return False
        for layer, prefilled in zip(self.cache[1:], layers[1:], strict=True):
            taken = layer.adopt(prefilled, len(samplers))
            assert taken, "the layers of a batch hold the same columns"
        self.rows = SamplerRows(samplers, logits.shape[-1])
        pending = self.pending.join(self.rows.sample(logits), self.rows)  # the first: none is live
        self.placement.adopt(len(samplers))
        self.pending.launch(pending)
        return True

    def step(self) -> list[int]:
        """Feed every row's pending token, queue the next ones, and return the fed tokens (one per row)."""
        return self.step_with(lambda tokens: tokens)

    def step_with(
        self,
        handle: Callable[[list[int]], T],
        ends_all: Callable[[T], bool] | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> T:
        """`step`, then `handle(tokens)`; returns what `handle` returns. `ends_all(result)` says whether
        every row ends with these tokens (the caller then removes them all). `meanwhile` (host work
        that touches no MLX array) runs once, while the device finishes the step the tokens come from.

        As a rule the next step is launched before the tokens are read back and handled, so the device
        computes it meanwhile (with a launcher, the launch itself runs meanwhile, and the step after it
        is built while this one launches: `handle` runs on this thread either way); `meanwhile` runs
        right after that launch, before the read-back would wait for the device. The first step after
        rows joined reads the tokens back and handles them at once instead (`meanwhile` after them):
        the prefill the rows joined from was waited for, so nothing is in flight, and their first
        tokens reach readers without waiting for the next step's graph (on the CPU, where `async_eval`
        returns only once a lone row's step is nearly computed, for the whole next step). That step
        takes no next step when `ends_all` says every row ends with them (a 1-token job).

        With a constrained row the forward that feeds the pending tokens is already launched (`ahead`):
        see `_step_ahead`."""
        if self.pending.tokens is None:
            raise ValueError("an empty batch has no step to take")
        pending, fresh = self.pending.tokens, self.pending.fresh
        self.pending.fresh = False
        if fresh:
            return self._step_fresh(pending, handle, ends_all, meanwhile)
        if self.ahead.logits is not None:
            result = self._step_ahead(pending, handle, meanwhile)
        else:
            result = self._step_plain(pending, handle, meanwhile)
        self._stepped()
        return result

    def _step_fresh(
        self,
        pending: mx.array,
        handle: Callable[[list[int]], T],
        ends_all: Callable[[T], bool] | None,
        meanwhile: Callable[[], None] | None,
    ) -> T:
        """The first step after rows joined (see `step_with`): nothing is in flight, so the tokens are
        read back and handled at once, then the next step is launched unless every row ends."""
        self.quiet()  # then nothing is in flight: `pending` itself may be read
        # `tolist` of a 1-D int32 array gives ints (MLX's stub allows any nesting of any scalar)
        tokens = [int(t) for t in cast("list[int]", pending.tolist())]
        self._take(tokens)
        self.logprobs = self.pending.logprobs.read(tokens)
        result = handle(tokens)
        if meanwhile is not None:
            meanwhile()
        if ends_all is not None and ends_all(result):
            self.pending.tokens = None  # nothing more to feed: every row leaves
            return result
        self._launch_next(pending)
        self._stepped()
        return result

    def _step_plain(
        self, pending: mx.array, handle: Callable[[list[int]], T], meanwhile: Callable[[], None] | None
    ) -> T:
        """A step with the one before it in flight (see `step_with`): the next step is launched, then
        `meanwhile` runs and the tokens are read back and handled while the device computes it."""
        read, logprobs = self.pending.readable(pending), self.pending.logprobs
        self.pending.launch(self._next_step(pending))  # a launcher waits for `pending`'s launch first
        if meanwhile is not None:
            meanwhile()
        tokens = read()
        self.logprobs = logprobs.read(tokens)
        return handle(tokens)

    def _step_ahead(
        self, pending: mx.array, handle: Callable[[list[int]], T], meanwhile: Callable[[], None] | None
    ) -> T:
        """A step of a batch with a constrained row. A row's next draw waits for its mask, which waits
        for its token of this step; the forward that feeds that token does not: it was launched right
        after the draw (`ahead`). So the tokens are read back while that forward computes (with a
        launcher, while it is still being launched), the grammars take them, the next draw and the
        forward fed by it are built and launched (`ForwardAhead.build`: with `masks_in_place` the
        masks on the mask thread meanwhile), and then the tokens are handled (text, stop strings,
        sinks) and `meanwhile` runs, while the device computes. With `build_ahead` the draw and the
        forward are built before the read-back instead, and only the masks are computed after the
        grammars took the tokens (`ForwardAhead.prepare`, `fill`). Between the read-back and that
        launch the device may wait on the host: that stretch is timed (`ForwardAhead.critical`)."""
        # rows join only through `add`/`start` (a fresh step follows, which launches the forward ahead)
        assert self.rows is not None and self.ahead.logits is not None
        ahead, rows = self.ahead, self.rows
        read, logprobs = self.pending.readable(pending), self.pending.logprobs
        prepared = ahead.prepare(rows, self._draw, self.forward.logits)  # None: built after the read
        began = time.perf_counter()
        tokens = read()  # with a launcher: once the draw's own launch ended
        got = time.perf_counter()
        self._take(tokens)
        self.logprobs = logprobs.read(tokens)
        taken = time.perf_counter()
        if prepared is not None:
            following, built = prepared, ahead.fill(rows)
        else:
            following, built = ahead.build(rows, self._draw, self.forward.logits)
        self.pending.tokens = following
        self.pending.launch(following, ahead.logits)
        launched = time.perf_counter()
        result = handle(tokens)
        ahead.note((began, got, taken, *built, launched))
        if meanwhile is not None:
            meanwhile()
        return result

    def _draw(self, logits: mx.array, masks_later: bool) -> mx.array:
        """Build the next draw from the forward ahead's `logits`, with its logprobs (`PendingTokens.logprobs`
        from now on); `masks_later`: see `SamplerRows.sample`."""
        assert self.rows is not None
        following = self.rows.sample(logits, masks_later=masks_later)
        self.pending.new_logprobs(self.rows)
        return following

    def verify_with(
        self,
        drafts_for: Callable[[list[int]], list[list[int]]],
        handle: Callable[[list[list[int]]], T],
        meanwhile: Callable[[], None] | None = None,
    ) -> T:
        """A verify step of speculative decoding: the pending tokens are read back, `drafts_for(tokens)`
        gives each row's draft tokens (any number, [] for a plain step), and one forward feeds every row
        its pending token and drafts (rows padded to the longest with columns they do not keep). Each
        row keeps the drafts the target agrees with (`SamplerRows.verify`), its cache trimmed to them
        (`VerifyStep.keep`), and the token after them is its next pending one. `handle` gets each
        row's tokens of the step, in row order: its pending token, then the drafts it kept; returns what
        `handle` returns. `meanwhile` runs while the forward computes.

        Constrained rows take their pending token first; their drafts are cut before the first their
        grammar does not allow (`SamplerRows.cut`), each position is masked with the grammar after the
        drafts before it (`SamplerRows.draft_masks`), and the grammar takes the drafts kept.

        Unlike a plain step nothing stays in flight: the drafts of the next step depend on what this
        one kept. So the next step (plain or verify) starts from tokens already read back. Where no row
        proposes anything after all (a drafter that expected to: `Drafter.may_propose`), the step is a
        plain one instead, the next launched before the tokens are handled (`verify_step.verified` says
        which). The verify step's own parts (the forward's width, the key columns it reads, the caches
        cut back to the drafts kept, its shapes met and its time) are the `VerifyStep`'s."""
        if self.pending.tokens is None or self.rows is None:
            raise ValueError("an empty batch has no step to take")
        self.ahead.drop(self.cache)
        step = self.verify_step
        began = time.perf_counter()
        self.quiet()
        self.pending.fresh = False
        tokens = [int(t) for t in cast("list[int]", self.pending.tokens.tolist())]
        self._take(tokens)
        self.logprobs = self.pending.logprobs.read(tokens)  # rows asking logprobs draft nothing
        read = time.perf_counter()
        drafts = self.rows.cut(drafts_for(tokens))
        step.verified = any(drafts)
        if not step.verified:  # nothing proposed after all: a plain step, launched before the handling
            return self._step_undrafted(self.pending.tokens, tokens, handle, meanwhile)
        return self._verify_drafts(tokens, drafts, handle, meanwhile, began, read)

    def _step_undrafted(
        self,
        pending: mx.array,
        tokens: list[int],
        handle: Callable[[list[list[int]]], T],
        meanwhile: Callable[[], None] | None,
    ) -> T:
        """A verify step where no row drafted after all (`verify_with`): the step that feeds `pending`
        (`tokens`, read back) is launched before the tokens are handled, as a plain step's."""
        self._launch_next(pending)
        self._stepped()
        result = handle([[t] for t in tokens])
        if meanwhile is not None:
            meanwhile()
        return result

    def _verify_drafts(
        self,
        tokens: list[int],
        drafts: list[list[int]],
        handle: Callable[[list[list[int]]], T],
        meanwhile: Callable[[], None] | None,
        began: float,
        read: float,
    ) -> T:
        """The forward of a verify step that feeds every row its pending token (`tokens`, read back at
        `read`) and its `drafts` (`verify_with`, which `began` then), launched in pieces as it is built;
        the drafts kept read back, the caches cut back to them, the rows' tokens handled."""
        assert self.rows is not None
        step = self.verify_step
        width = step.width(drafts)
        allowed = self.rows.draft_masks(drafts, width) if width > 1 else None
        drafted = time.perf_counter()
        pieces = ForwardPieces(self.launcher, len(self.cache))  # launched as it is built, with a launcher
        kept_drafts, following = step.forward(self.rows, self.forward, tokens, drafts, width, allowed, pieces)
        self.pending.new_logprobs(self.rows)
        built = time.perf_counter()
        pieces.launch(
            kept_drafts, following, *self.pending.logprobs.arrays(), *self.forward.taken_with_step()
        )
        if meanwhile is not None:
            meanwhile()
        pieces.wait()
        launched = time.perf_counter()
        kept = [int(k) for k in cast("list[int]", kept_drafts.tolist())]
        waited = time.perf_counter()
        if step.keep(self.cache, self.placement.slots, kept, width):  # holes squeezed out
            self.placement.compact(self.placement.idle_rows())
        self.pending.tokens, self.pending.copy, self.pending.fresh = following, None, True
        self._stepped()
        if self.rows.constrained:
            self.rows.take_drafts([d[:k] for d, k in zip(drafts, kept, strict=True)])
        trimmed = time.perf_counter()
        result = handle([[t, *d[:k]] for t, d, k in zip(tokens, drafts, kept, strict=True)])
        marks = (began, read, drafted, built, launched, waited, trimmed, time.perf_counter())
        step.clock.note(len(tokens) * width, len(tokens) + sum(kept), marks)
        return result

    def quiet(self) -> None:
        """Wait until no step is being launched (with a launcher: before evaluating anything else)."""
        if self.launcher is not None:
            self.launcher.wait()

    def _launch_next(self, pending: mx.array) -> None:
        """Build and launch the step that feeds `pending` (read back already: nothing in flight), with
        the forward ahead of it where a row is constrained."""
        following = self._next_step(pending)
        if self.rows is not None and self.rows.constrained:
            self._launch_ahead(following)
        else:
            self.pending.launch(following)

    def _launch_ahead(self, tokens: mx.array) -> None:
        """Launch a constrained batch's drawn `tokens`, then the forward that feeds them (`ahead`)."""
        self.ahead.logits = self.forward.logits(tokens)
        self.pending.launch(tokens, self.ahead.logits)

    def _take(self, tokens: list[int]) -> None:
        """Constrained rows take this step's tokens (before they are handled: a row whose grammar is
        complete or broken ends with them)."""
        if self.rows is not None and self.rows.constrained:
            self.rows.take(tokens)

    def _next_step(self, pending: mx.array) -> mx.array:
        """Build the step that feeds `pending` (one token per live row); returns the tokens it samples,
        which become the pending ones (not evaluated yet)."""
        logits = self.forward.logits(pending)
        assert self.rows is not None
        self.pending.tokens = self.rows.sample(logits)
        self.pending.new_logprobs(self.rows)  # the old one is still read by the step in hand
        return self.pending.tokens

    def _stepped(self) -> None:
        self._steps += 1
        if self._steps % _CLEAR_CACHE_EVERY == 0:
            self.quiet()
            mx.clear_cache()

    def remove(self, rows: list[int]) -> list[list[KVCache]]:
        """Drop `rows`; return each one's batch-1 cache (exactly its tokens), in the order given. Their
        buffer rows become idle rows; the buffers are compacted only when the batch can shrink.

        With holes (a verify step's) a row's own columns are read back, an evaluation: the launch in
        flight (a plain step may follow a verify step) ends first, as for any evaluation between steps."""
        if self.cache[0].has_holes:
            self.quiet()
        slots = self.placement.slots
        caches = [[layer.row(slots[i]) for layer in self.cache] for i in rows]
        if self.ahead.logits is not None:  # the forward ahead fed a token they never handled
            for cache in caches:
                for layer_cache in cache:
                    layer_cache.trim(1)
        gone = set(rows)
        keep = [i for i in range(len(self)) if i not in gone]
        if self.rows is not None:
            self.rows.select(keep)
        index = self.pending.select(keep)
        if index is None:
            self.ahead.logits = None
        elif self.ahead.logits is not None:
            self.ahead.logits = self.ahead.logits[index]
        self.placement.keep(keep)
        return caches
