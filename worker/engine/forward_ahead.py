"""A constrained decode batch's forward ahead: the draw, the masks on the mask thread, the forward behind.

A batch holding a constrained row keeps one forward ahead (`DecodeBatch.step_with`): its pending tokens
are already being fed while they are read back, so the draw that needs their grammars' masks and the
forward after it are launched one right after the other. The batch keeps its rows and pending tokens
(`pending_tokens.py`: their launch) and sequences the step (`DecodeBatch._step_ahead`); a `ForwardAhead`
it composes owns what is the forward ahead's alone: its logits (`logits`), dropping it (its column
trimmed), building the next draw from it and the forward fed by that draw (with the masks computed on
the mask thread meanwhile), and the host's time on the critical path between a step's read-back and
that launch (`critical`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.critical_path import CriticalPath
from mlxq.worker.engine.launcher import Launcher
from mlxq.worker.engine.sampler_rows import SamplerRows


class ForwardAhead:
    """The forward ahead of one decode batch: its logits, the next draw and forward, their time.

    `launcher`: the batch's (the forward is launched behind each draw on its thread); `masks_in_place`:
    the draw reads the rows' mask buffer (`mask_buffer.host_writes_seen`), written on the mask thread;
    `build_ahead` (with `masks_in_place`): the draw and the forward are built before the step's tokens
    are read back (`prepare`), the masks alone computed after (`fill`), rather than beside the build
    after the read-back (`build`)."""

    def __init__(self, launcher: Launcher | None, masks_in_place: bool, build_ahead: bool = False) -> None:
        self.launcher = launcher
        self.masks_in_place = masks_in_place
        self.build_ahead = build_ahead and masks_in_place
        self._prepared: mx.array | None = None  # the forward `prepare` built, until `fill`
        # With a constrained row: the logits of the forward that feeds the batch's pending tokens, launched
        self.logits: mx.array | None = None
        self._then_seen = launcher.then_s if launcher is not None else 0.0  # `critical.forward_launch_s`
        self.critical = CriticalPath()  # the host's time on the constrained steps' critical path

    def drop(self, cache: list[BatchKVCache]) -> None:
        """Forget the forward launched ahead: every row's cache loses the column it wrote, and the
        pending tokens are again fed by nothing (before rows join, or a verify step)."""
        if self.logits is None:
            return
        self.logits = None
        for layer in cache:
            layer.trim_rows(1, [0] * layer.batch)

    def build(
        self,
        rows: SamplerRows,
        draw: Callable[[mx.array, bool], mx.array],
        forward: Callable[[mx.array], mx.array],
    ) -> tuple[mx.array, tuple[float, float, float]]:
        """The next draw from the forward ahead's logits (`draw(logits, masks_later)`) and the forward
        fed by it (`forward`), the new forward ahead; returns the draw and when the draw, the forward
        and the wait for the masks ended (for `note`). A batch whose constrained rows all left draws
        from the forward ahead once more and is a free batch again (no forward ahead).

        With `masks_in_place` the masks are computed on the mask thread into the buffer the draw reads
        while this thread builds the graphs (building reads no data; the rows are those of this step:
        rows join and leave between steps), so they cost the step nothing while they take less than
        the build; else they are computed as the draw is built. (Built before the read-back, while the
        device computes, the graphs would leave the critical path but the masks would join the host's
        serial work a step, which bounds a GPU batch of many constrained rows: `bench/README.md`.) A
        grammar that fails computing its mask (found at the join) ends its row with the error at this
        token (`GenerationBatch`), as one found while taking the token does."""
        assert self.logits is not None
        in_place = self.masks_in_place and rows.constrained
        masks = rows.start_masks() if in_place else None
        try:
            following = draw(self.logits, in_place)
            drawn = time.perf_counter()
            ahead = forward(following) if rows.constrained else None
            formed = time.perf_counter()
        except BaseException:
            if masks is not None:
                with contextlib.suppress(Exception):  # no thread may be left on the grammars
                    masks.join()
            raise
        joined = formed
        if masks is not None:
            masks.join()
            self.critical.masks_s += masks.seconds
            joined = time.perf_counter()
        self.logits = ahead
        return following, (drawn, formed, joined)

    def prepare(
        self,
        rows: SamplerRows,
        draw: Callable[[mx.array, bool], mx.array],
        forward: Callable[[mx.array], mx.array],
    ) -> mx.array | None:
        """With `build_ahead` and a constrained row, before the step's tokens are read back: the next
        draw, reading the masks from the rows' buffer (written by `fill` once the grammars took the
        tokens), and the forward fed by it, built while the device computes; returns the draw. Else
        None (`build` after the read-back). Building reads no data, and the draw before, which reads
        the same buffer, is computed once its tokens are read back, before `fill` writes it."""
        if not (self.build_ahead and rows.constrained):
            return None
        assert self.logits is not None
        began = time.perf_counter()
        following = draw(self.logits, True)
        drawn = time.perf_counter()
        self._prepared = forward(following)
        self.critical.draw_s += drawn - began
        self.critical.forward_s += time.perf_counter() - drawn
        return following

    def fill(self, rows: SamplerRows) -> tuple[float, float, float]:
        """After `prepare` and the grammars' `take`: the masks computed (on the mask thread) into the
        buffer the prepared draw reads, and the prepared forward the new forward ahead; returns the
        marks `build` returns (the graphs counted by `prepare`)."""
        assert self._prepared is not None
        now = time.perf_counter()
        masks = rows.start_masks()
        masks.join()
        self.critical.masks_s += masks.seconds
        self.logits, self._prepared = self._prepared, None
        return now, now, time.perf_counter()

    def note(self, marks: Sequence[float]) -> None:
        """One constrained step's time: `marks`, when it began (before the read-back), then when the
        tokens were read back, taken by the grammars, drawn, fed, the masks joined and the step
        launched; the tokens were handled since."""
        began, got, taken, drawn, formed, joined, launched = marks
        clock = self.critical
        clock.steps += 1
        if self.launcher is not None:  # the forwards launched behind a draw since the last step (ended:
            then_s = self.launcher.then_s  # `PendingTokens.launch` waited for every launch before its own)
            clock.forward_launch_s += then_s - self._then_seen
            self._then_seen = then_s
        clock.read_s += got - began
        clock.take_s += taken - got
        clock.draw_s += drawn - taken
        clock.forward_s += formed - drawn
        clock.join_s += joined - formed
        clock.launch_s += launched - joined
        clock.handle_s += time.perf_counter() - launched
        clock.critical_s += launched - got
