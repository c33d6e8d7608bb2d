"""The seam between `PrefixScorer` and the kinds of score row: a `ScoreHead` names each row's model
input and the positions it needs, and takes those positions' next-token logits as `Pick`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx


@dataclass(frozen=True)
class Pick:
    """Row `at` of a block of hidden states (or of logits) is the state after position `position` of
    row `row`'s model input."""

    row: int
    position: int
    at: int


class ScoreHead(Protocol):
    """One kind of score row as `PrefixScorer` sees it: each row's model input, the positions of it
    whose next-token distribution the row needs, and what is kept of those distributions."""

    @property
    def inputs(self) -> Sequence[list[int]]:
        """The rows' model inputs, in order."""
        ...

    def needed(self, row: int) -> range:
        """The positions of row `row`'s input whose next-token distributions it needs (never empty)."""
        ...

    def take(self, logits: mx.array, picks: Sequence[Pick]) -> None:
        """Keep what the picks' rows need: `logits` is (m, vocab) float32, and row `pick.at` of it
        the distribution after position `pick.position` of row `pick.row`'s input."""
        ...
