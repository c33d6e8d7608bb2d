"""A generation batch's drafting for speculative decoding, step by step.

At every decode step `GenerationBatch` asks its `BatchDrafts` whether the step verifies drafts: some
row drafts (its policy's depth) and its drafter expects to have something to propose, unless the
engine's draft gate says drafting loses at the batch's size now (`speculation/draft_gate.py`). A verify
step (`DecodeBatch.verify_with`) then asks it for each row's drafts after its pending token. After
every step the batch tells it what each row took, and it counts the step's progress as the draft gate
counts it: the rows times what the batch's slowest row gained. The batch keeps its rows, takes their
tokens and tells the gate where a step begins and ends; the drafting keeps each row's depth, proposal
and lead on the row itself (`DraftingRow`).

Rows whose drafters draft together (`BatchedDrafter`: a draft model, an MTP layer) are asked as one:
it keeps a `DraftBatch` per draft source, which holds those rows' state from their first proposal
until the generation batch tells it they left (`leave`); every other drafter proposes for its row
alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.speculation.drafter import BatchedDrafter, DraftBatch, DraftBatchSource, RowToDraft
from mlxq.worker.engine.speculation.policy import RowSpeculation
from mlxq.worker.engine.speculation.row_tokens import RowTokens
from mlxq.worker.engine.text_run import TextRun


class DraftingRow(Protocol):
    """A decoding request as its drafting reads it, and the drafting's notes on it."""

    depth: int  # tokens it may draft at this step
    proposed: int  # tokens its drafter proposed at this step
    ahead: int  # tokens it is ahead of the batch's slowest row (the draft gate's progress)

    @property
    def prompt(self) -> list[int]: ...

    @property
    def run(self) -> TextRun: ...

    @property
    def speculation(self) -> RowSpeculation | None: ...

    @property
    def budget(self) -> int: ...


class BatchDrafts:
    """The drafts of one generation batch's rows, step by step; see the module docstring."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # the last decode step's progress as the draft gate counts it: rows x what the slowest row gained
        self.progress = 0
        self._batches: dict[DraftBatchSource, DraftBatch] = {}  # the rows of each source drafting together

    def speculating(self, rows: Sequence[DraftingRow]) -> bool:
        """Whether this step verifies drafts: some row drafts (its policy's depth, set here for
        `propose`) and its drafter expects to have something to propose (`Drafter.may_propose`, asked
        before the row's pending token is known). A worker without speculation checks nothing, nor does
        a batch larger than the policy lets draft (`DraftPolicy.max_batch`: no row would)."""
        options = self.engine.options
        n, any_depth = len(rows), False
        if options.speculation == "off" or n > options.draft_policy.max_batch:
            return False
        if self.engine.draft_gate is not None and not self.engine.draft_gate.allows(n):
            for seq in rows:  # drafting loses here now: a plain step (acceptances unchanged)
                seq.depth = 0
            return False
        for seq in rows:
            spec = seq.speculation
            seq.depth = spec.depth(n, seq.budget) if spec is not None and spec.wants(n, seq.budget) else 0
            if (
                seq.depth
                and spec is not None
                and spec.policy.only_likely
                and not spec.drafter.may_propose(RowTokens(seq.prompt, seq.run.ids))
            ):
                seq.depth = 0  # nothing to copy now: no verify step for it (its acceptance unchanged)
            any_depth = any_depth or seq.depth > 0
        return any_depth

    def propose(self, rows: Sequence[DraftingRow], tokens: list[int]) -> list[list[int]]:
        """Each row's draft tokens after its pending token (`tokens`, one per row, in row order): the
        rows of a `BatchedDrafter` source together (those drafting nothing this step too: the batch
        may catch them up on the way), every other drafting row alone."""
        drafts: list[list[int]] = [[] for _ in rows]
        groups: dict[DraftBatchSource, list[int]] = {}
        for i, (seq, token) in enumerate(zip(rows, tokens, strict=True)):
            spec = seq.speculation
            if spec is not None and isinstance(spec.drafter, BatchedDrafter):
                groups.setdefault(spec.drafter.source, []).append(i)
            elif seq.depth > 0 and spec is not None:
                drafts[i] = spec.drafter.propose(RowTokens(seq.prompt, seq.run.ids, token), seq.depth)
        for source, members in groups.items():
            if not any(rows[i].depth > 0 for i in members):
                continue
            batch = self._batches.get(source)
            if batch is None:
                batch = self._batches[source] = source.draft_batch()
            asked = [self._row_to_draft(rows[i], tokens[i]) for i in members]
            for i, proposed in zip(members, batch.propose(asked), strict=True):
                drafts[i] = proposed
        for i, seq in enumerate(rows):
            if seq.depth > 0 and seq.speculation is not None:
                drafts[i] = drafts[i][: seq.depth]
                seq.proposed = len(drafts[i])
        return drafts

    @property
    def held(self) -> int:
        """Rows the draft batches hold (each a decoding row that drafted with a `BatchedDrafter`)."""
        return sum(len(batch) for batch in self._batches.values())

    def leave(self, rows: Sequence[DraftingRow]) -> None:
        """`rows` left the generation batch (finished, cancelled, failed): they leave the draft batches
        they draft in, their state with them."""
        gone: dict[DraftBatchSource, list[BatchedDrafter]] = {}
        for seq in rows:
            spec = seq.speculation
            if spec is not None and isinstance(spec.drafter, BatchedDrafter):
                gone.setdefault(spec.drafter.source, []).append(spec.drafter)
        for source, drafters in gone.items():
            batch = self._batches.get(source)
            if batch is not None:
                batch.leave(drafters)

    @staticmethod
    def _row_to_draft(seq: DraftingRow, token: int) -> RowToDraft:
        assert seq.speculation is not None
        return RowToDraft(
            seq.speculation.drafter, RowTokens(seq.prompt, seq.run.ids, token), max(seq.depth, 0)
        )

    def count_progress(self, rows: Sequence[DraftingRow], gains: list[int]) -> None:
        """The step's progress as the draft gate counts it: the rows times what the batch's slowest row
        gained (`gains`: the tokens each row took, in row order). A batch of jobs that started together
        ends with its slowest one, so a row's tokens ahead of it count only once every row has them
        (each row's lead is kept from step to step); a row that joins starts level with the slowest,
        and when the slowest leaves, its batch-mates' leads over it are not counted."""
        if self.engine.draft_gate is None:
            return
        before = min(seq.ahead for seq in rows)
        reached = [seq.ahead + gain for seq, gain in zip(rows, gains, strict=True)]
        after = min(reached)
        for seq, at in zip(rows, reached, strict=True):
            seq.ahead = at - after
        self.progress = len(rows) * (after - before)
