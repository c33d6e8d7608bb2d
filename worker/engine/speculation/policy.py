"""How many tokens each row drafts at a step: from its observed acceptance and the batch's size.

A verify step costs more than a plain one: it reads the pending tokens back before it is built (no step
stays in flight) and its forward computes every row's drafts, kept or not. It pays where a forward is
bound by reading the weights (few rows: a few more tokens per row cost almost nothing) and the drafts are
often right. So a row drafts nothing when the batch is large (`max_batch`: the step is bound by
arithmetic there, every drafted token costs as much as a generated one), and its depth follows an
exponentially weighted average of the share of its drafted tokens the target kept: a row whose drafts
keep failing (or that finds nothing to propose, prompt lookup on open prose) drops to 0 and the batch
goes back to plain steps with one step in flight; such a row tries again with one token every
`retry_every` steps, so a row that starts copying later is found. A row whose last proposal was kept
whole is likely inside a long copied run: its next proposal may be twice as long, up to the row's cap
(`max_run` for a cheap drafter such as prompt lookup), so a copied passage costs few verify steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxq.worker.engine.speculation.drafter import Drafter


@dataclass(frozen=True)
class DraftPolicy:
    """The thresholds of the policy (worker settings, `MLXQ_DRAFT_*`).

    `max_depth`: most tokens a row drafts per step; `max_batch`: above this many decoding rows nobody
    drafts; `min_acceptance`: below this average share kept a row stops drafting; `smoothing`: the
    weight of the latest step in the average; `retry_every`: steps between a stopped row's retries;
    `only_likely`: a row drafts only at steps where its drafter expects a proposal
    (`Drafter.may_propose`), so a batch whose rows have nothing to copy keeps taking plain steps, one
    in flight (off: every row the policy lets draft takes verify steps, as the verify step's tests
    want); `max_run`: most tokens a cheap drafter (prompt lookup) proposes while its proposals keep
    being kept whole (its row's cap; `max_depth` still bounds a row's first and partly kept proposals);
    `gate`: a batch also measures what drafting gains it against plain decoding and drafts only while
    that pays (`draft_gate.py`; the worker's default, off here so the verify step's tests see the
    steps they ask for whatever the machine's speed)."""

    max_depth: int = 8
    max_batch: int = 8
    min_acceptance: float = 0.3
    smoothing: float = 0.3
    retry_every: int = 16
    only_likely: bool = True
    max_run: int = 31
    gate: bool = False

    def __post_init__(self) -> None:
        if self.max_depth < 0 or self.max_batch < 0 or self.retry_every < 1 or self.max_run < 0:
            raise ValueError(
                "draft policy needs max_depth >= 0, max_batch >= 0, retry_every >= 1, max_run >= 0, "
                f"got {self}"
            )
        if not 0.0 <= self.min_acceptance <= 1.0 or not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"draft policy needs min_acceptance in [0, 1], smoothing in (0, 1], got {self}")


@dataclass(eq=False)
class RowSpeculation:
    """One row's drafter, its depth cap (the job's own, within the policy's: `max_depth`, or `max_run`
    for a cheap drafter), its average acceptance, the length of its last proposal if it was kept whole
    (a run being copied: the next may be longer) and its counts of drafted and kept tokens (reported in
    the job's usage)."""

    drafter: Drafter
    policy: DraftPolicy
    cap: int
    acceptance: float = 1.0  # optimistic: a new row drafts at once
    drafted: int = 0
    kept: int = 0
    _idle_steps: int = field(default=0, repr=False)
    _run: int = field(default=0, repr=False)

    def depth(self, batch: int, budget: int) -> int:
        """Tokens to draft this step in a batch of `batch` rows with `budget` tokens left to generate
        after the pending one (drafts past the budget would be thrown away)."""
        ceiling = min(self.cap, budget)
        cap = min(ceiling, self.policy.max_depth)
        if cap <= 0 or batch > self.policy.max_batch:
            return 0
        if self._run:  # the last proposal was kept whole: the copied run likely goes on
            return min(ceiling, max(cap, 2 * self._run))
        if self.acceptance < self.policy.min_acceptance:
            return 1 if self._idle_steps >= self.policy.retry_every else 0
        return max(1, min(cap, round(cap * self.acceptance)))

    def wants(self, batch: int, budget: int) -> bool:
        """Whether this row drafts this step; counts the steps of a stopped row towards its retry."""
        if self.depth(batch, budget) > 0:
            return True
        self._idle_steps += 1
        return False

    def observe(self, proposed: int, kept: int) -> None:
        """A verify step's outcome: `kept` of `proposed` drafted tokens (an empty proposal counts as
        none kept, so a drafter with nothing to say is turned down like a wrong one)."""
        share = kept / proposed if proposed else 0.0
        self.acceptance += self.policy.smoothing * (share - self.acceptance)
        self.drafted += proposed
        self.kept += kept
        self._idle_steps = 0
        self._run = proposed if proposed and kept == proposed else 0
        self.drafter.accepted(proposed, kept)
