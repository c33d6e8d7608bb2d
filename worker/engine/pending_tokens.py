"""A decode batch's pending tokens: sampled for the live rows, not fed to the model yet.

`DecodeBatch` sequences its steps; the `PendingTokens` it composes hold what one step hands the next:
each live row's sampled token (`tokens`), their logprobs where rows asked (`logprobs`), whether rows
joined since the last step (`fresh`: their first tokens are read back at once), how those tokens are
launched (`launch`, with the step behind them) and read back (`readable`), and what becomes of them as
rows join (`join`) and leave (`select`). With a launcher they are read back from a copy made in the
same launch (`Launcher.launch_tokens` says why), each live row at its place in it (`copy_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx

from mlxq.worker.engine.batch_forward import BatchForward
from mlxq.worker.engine.launcher import Launcher
from mlxq.worker.engine.sampler_rows import SamplerRows
from mlxq.worker.engine.token_logprobs import PendingLogprobs


class PendingTokens:
    """The pending tokens of one decode batch: `launcher`, the batch's (None: launched on this thread);
    `forward`, the batch's forwards (what their feature sink made is launched with the tokens)."""

    def __init__(self, launcher: Launcher | None, forward: BatchForward) -> None:
        self.launcher = launcher
        self.forward = forward
        self.tokens: mx.array | None = None  # (B,) each row's sampled token, not fed to the model yet
        self.logprobs = PendingLogprobs()  # theirs, where rows asked (`token_logprobs.py`)
        self.fresh = False  # rows joined since the last step: their first tokens are in `tokens`
        # With a launcher: a copy of `tokens` made in the same launch, read back in its stead (see
        # `launch`), and each live row's place in it.
        self.copy: mx.array | None = None
        self.copy_rows: list[int] = []

    def join(self, tokens: mx.array, rows: SamplerRows) -> mx.array:
        """The first tokens of rows that join, sampled by `rows` (their logprobs where asked), after the
        live rows' pending ones (none where the batch is empty); they are fresh. Returns every row's."""
        if self.tokens is None:
            self.logprobs.reset(rows.logprobs, len(rows))
            self.tokens = tokens
        else:
            self.logprobs.extend(rows.logprobs, len(rows))
            self.tokens = mx.concatenate([self.tokens, tokens])
        self.fresh = True
        return self.tokens

    def select(self, keep: list[int]) -> mx.array | None:
        """Keep the live rows `keep` (their indices, in order), the others having left; returns the index
        that selects them, for what else the batch holds by row (None: no token is left)."""
        self.logprobs.select(keep)
        self.copy_rows = [self.copy_rows[i] for i in keep] if self.copy is not None else []
        if not keep or self.tokens is None:
            self.tokens = None
            return None
        index = mx.array(keep, dtype=mx.int32)
        self.tokens = self.tokens[index]
        return index

    def launch(self, tokens: mx.array, ahead: mx.array | None = None) -> None:
        """Start computing `tokens` (and the step behind them), then `ahead` (the forward that feeds
        them, in a constrained batch). `ahead` is always an evaluation of its own: MLX marks every
        array of one `async_eval` ready only once all of them are, so evaluated together the tokens
        could be read back only after the forward ahead had computed, and the grammars' work and the
        next draw's build would wait for it instead of running beside it. With a launcher they are read
        back later from the copy `Launcher.launch_tokens` makes (it says why), each live row at its
        place in it; `ahead` is launched right behind them on the launcher's thread, so this thread goes
        on at once (it does not wait for the draw's launch) and the copy can be read while `ahead` is
        being launched (as a free batch reads its tokens while the next step launches)."""
        logprobs = self.logprobs.arrays()  # read back with the tokens: no sync of their own
        logprobs.extend(self.forward.taken_with_step())
        if self.launcher is None:
            mx.async_eval(tokens, *logprobs)
            if ahead is not None:
                mx.async_eval(ahead)
            return
        self.copy = self.launcher.launch_tokens(tokens, *logprobs, then=ahead)
        self.copy_rows = list(range(tokens.shape[0]))

    def new_logprobs(self, rows: SamplerRows) -> None:
        """The logprobs of the draw just built, for the rows that asked (a new object: the one before may
        still be read by the step in hand)."""
        self.logprobs = PendingLogprobs()
        self.logprobs.reset(rows.logprobs, len(rows))

    def readable(self, pending: mx.array) -> Callable[[], list[int]]:
        """How to read the live rows' `pending` tokens once the next step is launched."""
        copy, rows = self.copy, self.copy_rows
        if self.launcher is None or copy is None:
            return lambda: [int(t) for t in cast("list[int]", pending.tolist())]
        launcher = self.launcher
        launch = launcher.tokens_launch  # the one that made the copy

        def read() -> list[int]:
            error = launch.exception() if launch is not None else None  # no copy read before it ended
            if error is not None:
                launcher.wait()  # raises it where it is still in flight
                raise error
            values = cast("list[int]", copy.tolist())
            return [int(values[i]) for i in rows]

        return read
