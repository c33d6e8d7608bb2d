"""The seam between a decode batch and whatever proposes tokens for it to verify.

A `Drafter` serves one request (one row of a decode batch). Before a verify step it is asked for up to
`depth` tokens that may follow the row's tokens so far; after the step it is told how many of them the
target kept, so a drafter with state of its own (a draft model's KV cache, an MTP head's hidden state)
rolls that state back to the kept tokens. Prompt lookup keeps nothing; a draft model or DFlash drafter
implements the same methods; a drafter reading the target's hidden states (DFlash, MTP) is also a
`FeatureReader`.

A drafter whose rows are cheaper drafted together is also a `BatchedDrafter` (a draft model: one
forward per drafted token for all of a batch's rows, where each row alone costs a forward a token; an
MTP layer: one forward and one read of the drafts for all rows, where each row alone costs both):
the generation batch's drafting (`batch_drafts.py`) keeps one `DraftBatch` per `source` and asks it
for the drafts of all that source's rows at once; told what each row kept, the row's drafter passes
it on to the batch it drafts in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import mlx.core as mx


class Drafter(Protocol):
    """Proposes tokens for one row; told what the target kept of them."""

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """At most `depth` tokens that may follow `tokens` (the row's prompt and every token it
        generated, the one about to be fed included); [] when it has no guess (a plain decode step)."""
        ...

    def may_propose(self, tokens: Sequence[int]) -> bool:
        """Before a step, with the row's next token still being computed: whether a proposal after
        `tokens` and that token is likely. False makes the step a plain one (one step stays in flight)
        rather than a verify step whose drafts would be empty. Never changes what is generated."""
        ...

    def accepted(self, proposed: int, kept: int) -> None:
        """Of the `proposed` tokens of the last `propose`, the target kept the first `kept`."""
        ...


class RowToDraft(NamedTuple):
    """One row a `DraftBatch` drafts for at a step: its drafter, its tokens (as `Drafter.propose` takes
    them) and how many tokens it drafts (0: none this step, though the batch may catch it up)."""

    drafter: Drafter
    tokens: Sequence[int]
    depth: int


class DraftBatch(Protocol):
    """The rows of one generation batch that draft with one source, drafting together: it follows each
    row from its first proposal (caught up from its prompt) until it `leave`s."""

    def __len__(self) -> int:
        """Rows it holds."""
        ...

    def propose(self, rows: Sequence[RowToDraft]) -> list[list[int]]:
        """Each row's drafts (at most its depth; [] for depth 0), in the order of `rows`. Rows new to
        the batch join it; its rows not among `rows` draft nothing this step."""
        ...

    def leave(self, drafters: Sequence[Drafter]) -> None:
        """These rows are gone (finished, cancelled, failed): their state leaves the batch."""
        ...


class DraftBatchSource(Protocol):
    """What the rows drafting together share (a loaded draft model, an MTP layer), compared by
    identity."""

    def draft_batch(self) -> DraftBatch:
        """A new, empty batch of this source's rows."""
        ...


@runtime_checkable
class BatchedDrafter(Drafter, Protocol):
    """A drafter whose rows of one generation batch draft together in a `DraftBatch` of its `source`;
    its own `propose` drafts for its row alone (a batch of one)."""

    @property
    def source(self) -> DraftBatchSource: ...


class FeatureReader(Protocol):
    """A drafter that reads the target's hidden states (DFlash, MTP): the batch's prefill hands it the
    tapped layer outputs of its row's prompt (`batch_prefill.py`), the decode batch each later
    forward's (`DecodeBatch.taps`)."""

    def take_features(self, position: int, features: mx.array, tokens: Sequence[int]) -> list[mx.array]:
        """Tapped features (1, W, features) of the row's tokens from `position` on; `tokens`: the row's
        tokens so far. Returns the arrays it made of them (the batch computes them with its step).
        Evaluates nothing: it is called while the forward is built, maybe beside a launch on another
        thread; work that must evaluate waits for a proposal."""
        ...
