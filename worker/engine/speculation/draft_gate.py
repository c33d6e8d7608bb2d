"""Whether drafting pays, judged by what an engine's decode steps cost on this machine.

The acceptance policy (`policy.py`) knows how often a row's drafts are kept, not what a verify step
costs against a plain one: that depends on the device, the model, the number of rows and the drafter
(a GPU's plain steps keep one step in flight and cost about their launch, a verify step is built,
launched and read back before the next; a CPU's forward of k tokens costs k times one; a draft model
costs a forward a drafted token). So the engine's generation batches measure both kinds as they decode
(one gate an engine, learnt across its batches, one after another): the seconds a step took per token
of progress (a plain step one token a row; a verify step as many a row as the row that took fewest:
its pending token and the drafts it kept). A batch is as far along as its slowest row: a verify step
where one row copies a long run and the others keep nothing advances the batch by one token a row at
a verify step's cost, and a batch of jobs that started together ends with its longest one; crediting
each row's own tokens would let a batch draft where it loses (the rows that copied leave early, the
others decode on at the same step cost): so drafting in a batch pays only where its rows copy together.
Costs are kept per batch size (rows rounded up to a power of two: a 64-row step and a one-row step cost
differently) over the last `window` steps of each kind. A plain step's cost is the least of its
samples, a verify step's the median of its: a step that met a new shape (kernels built on a GPU) or a
busy host is far slower than the others, and plain steps are rare in a batch that drafts, so one such
sample in an average would make plain steps look dear for long and drafting look cheap; the least is
the steady plain step, and the comparison leans towards not drafting. Where verify steps give tokens
more slowly than plain steps, drafting stops for `backoff` steps of that size, then verify steps are
allowed again to measure anew; each time drafting loses again the pause doubles (up to
`max_backoff`), so a batch where drafting never pays spends a vanishing share of its steps finding
that out, and one where the text starts being copied later is still found. While a size has no plain
step to compare with (every step drafts), or its latest is `refresh` steps old, `probe` plain steps
are taken after `min_samples` verify steps.

The first plain step after a verify step reads its tokens back before the next step is built (nothing
was in flight): that cost is the verify step's, and it is counted as such. A verify step whose shape
the batch meets for the first time (a GPU may build kernels for it, many times a step's cost) gives no
sample, nor does the plain step after it: it says nothing of the steps of that shape to come.

Output never changes with the gate: greedy speculation is lossless, and a row's text does not depend on
which steps drafted.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

StepKind = Literal["plain", "verify"]


def size_class(rows: int) -> int:
    """The batch sizes whose steps are compared together: rows rounded up to a power of two."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class _SizeCosts:
    """Seconds a token of each kind of step at one batch size (latest samples), and the pause of
    drafting there."""

    window: int
    plain: deque[float] = field(init=False)
    verify: deque[float] = field(init=False)
    verify_steps: int = 0  # verify steps measured since drafting was last allowed again
    paused_until: int = 0  # the gate's step count from which drafting may resume
    backoff: int = 0  # the pause after the next loss (0: the gate's own first one)
    plain_needed: int = 0  # plain steps still to take to have a comparison
    plain_at: int = 0  # the gate's step count at the latest plain sample

    def __post_init__(self) -> None:
        self.plain = deque(maxlen=self.window)
        self.verify = deque(maxlen=self.window)

    def plain_cost(self) -> float | None:
        return min(self.plain) if self.plain else None

    def verify_cost(self) -> float | None:
        return statistics.median(self.verify) if self.verify else None


@dataclass
class DraftGate:
    """An engine's measured cost of plain and verify steps, and whether the next step may draft.

    `window`: samples of each kind kept per batch size; `min_samples`: verify steps measured before
    drafting is judged; `backoff`/`max_backoff`: the first and the longest pause (in steps) after
    drafting lost; `probe`: plain steps taken to measure them when a batch size has none, or only
    ones older than `refresh` steps."""

    window: int = 16
    min_samples: int = 3
    backoff: int = 32
    max_backoff: int = 2048
    probe: int = 2
    refresh: int = 512
    clock: Callable[[], float] = time.perf_counter
    _sizes: dict[int, _SizeCosts] = field(default_factory=dict, repr=False)
    _steps: int = field(default=0, repr=False)
    _last: StepKind | None = field(default=None, repr=False)
    _began: float | None = field(default=None, repr=False)
    _began_rows: int = field(default=0, repr=False)
    _unmeasured: bool = field(default=False, repr=False)  # the step before gave no sample (new shape)
    paused: int = 0  # steps at which drafting was refused (reported)

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1 or self.probe < 1 or self.refresh < 1:
            raise ValueError(f"a draft gate needs window, min_samples, probe and refresh >= 1: {self}")
        if self.backoff < 1 or self.max_backoff < self.backoff:
            raise ValueError(f"a draft gate needs 1 <= backoff <= max_backoff: {self}")

    def allows(self, rows: int) -> bool:
        """Whether a step of `rows` decoding rows may verify drafts (asked before each step that
        would)."""
        costs = self._costs(rows)
        if costs.paused_until > self._steps or costs.plain_needed > 0:
            self.paused += 1
            return False
        return True

    def begin(self, rows: int) -> None:
        """A decode step of `rows` rows starts now."""
        self._began, self._began_rows = self.clock(), rows

    def end(self, kind: StepKind, tokens: int, new_shape: bool = False) -> None:
        """The step begun last ended, a `kind` step that gave `tokens` tokens in all (0: nothing
        measured, e.g. it failed); `new_shape`: a verify step of a shape met for the first time."""
        began, self._began = self._began, None
        self._steps += 1
        last, self._last = self._last, kind
        unmeasured, self._unmeasured = self._unmeasured, new_shape and kind == "verify"
        if began is None or tokens <= 0 or self._unmeasured or (unmeasured and kind == "plain"):
            return
        cost = max(self.clock() - began, 0.0) / tokens
        costs = self._costs(self._began_rows)
        if kind == "plain" and last == "verify":
            # this step paid for the verify step before it (nothing was in flight): the verify's cost
            costs.verify.append(cost)
            return
        if kind == "plain":
            costs.plain.append(cost)
            costs.plain_at = self._steps
            costs.plain_needed = max(0, costs.plain_needed - 1)
            return
        costs.verify.append(cost)
        costs.verify_steps += 1
        if costs.verify_steps < self.min_samples:
            return
        plain, verify = costs.plain_cost(), costs.verify_cost()
        if plain is None or self._steps - costs.plain_at > self.refresh:
            costs.plain_needed = self.probe  # (the first plain step after a verify counts as the verify's)
            return
        assert verify is not None
        if verify > plain:
            costs.backoff = min(self.max_backoff, 2 * costs.backoff) if costs.backoff else self.backoff
            costs.paused_until = self._steps + costs.backoff
            costs.verify_steps = 0
            costs.verify.clear()  # measured anew when drafting resumes
        else:
            costs.backoff = 0

    def cost(self, rows: int) -> tuple[float | None, float | None]:
        """(plain, verify) seconds a token at this batch size, as judged so far (None: not measured)."""
        costs = self._sizes.get(size_class(rows))
        return (None, None) if costs is None else (costs.plain_cost(), costs.verify_cost())

    def _costs(self, rows: int) -> _SizeCosts:
        size = size_class(rows)
        if size not in self._sizes:
            self._sizes[size] = _SizeCosts(self.window)
        return self._sizes[size]
