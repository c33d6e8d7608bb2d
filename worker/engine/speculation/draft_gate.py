"""Whether drafting pays, judged by what a batch gains with it against what plain decoding costs.

The acceptance policy (`policy.py`) knows how often a row's drafts are kept, not what drafting costs the
batch: that depends on the device, the model, the number of rows and the drafter (a GPU's plain steps
keep one step in flight and cost about their launch, a verify step is built, launched and read back
before the next; a CPU's forward of k tokens costs k times one; a draft model costs a forward a
drafted token), and drafting costs more than its verify steps: the plain steps between them start from
tokens read back, rows with holes in their caches may need masks, rows that copied at other times drift
apart. So the engine's generation batches measure what they gain as they decode (one gate an engine,
learnt across its batches, one after another), per batch size (rows rounded up to a power of two: a
64-row step and a one-row step cost differently).

Progress is what the batch's slowest row gained, times its rows (`GenerationBatch` counts it): a batch
of jobs that started together ends with its slowest one, so a verify step where one row copies a long
run and the others keep nothing advances the batch by one token a row at a verify step's cost. A plain
step's progress is its rows.

Plain decoding's cost is measured over stretches of `window` plain steps taken while drafting is off:
a stretch's cost is the median of its steps' seconds per unit of progress (plain steps are alike; the
first of a shape, which builds kernels on a GPU, or one on a busy host, is far dearer and would make
drafting look cheap), and the reference is the least of the last `history` stretches', so the
comparison leans towards plain decoding.

While drafting is allowed every step counts, plain or verify, by its whole time: the batch's balance
against plain decoding is the sum, step by step, of the seconds a step took less what plain decoding
would have taken for its progress (at the reference made `margin` cheaper), in plain steps of the batch
(a ratio of sums: a few verify steps that gain little weigh by their time, not as one sample among many;
a step more than `spike` times as slow as the median of the recent ones of its kind, a busy host or a
collection, counts as that much). Drafting runs on that balance: what it gains banks credit, up to
`credit` plain steps; it stops once it has lost `loss_limit` plain steps more than it gained. So a run
of drafting where it loses costs at most about `loss_limit` plain steps, whatever the reason it loses,
and a run where it pays goes on through stretches of text where it loses a little (nothing to copy
between copied passages). After a run that stops, drafting pauses for `backoff` steps of that size, then
is allowed again with no credit; each time a run ends without having gained anything in all the pause
doubles (up to `max_backoff`), so a batch where drafting never pays spends a vanishing share of its
steps finding that out, and one where the text starts being copied later is still found. A run's loss
is bounded by `loss_limit` only between steps: one verify step may cost far more (a draft model or an
MTP layer entering a new row's prompt before its first proposal costs tens of plain steps), so the pause
after a run that gained nothing is also at least its loss over `share`: what such runs lose is at most
about that share of the steps, however dear their steps are. While drafting
pays, a stretch of plain steps is measured after `refresh` steps of drafting, then after twice as many,
up to `max_refresh` (the reference of a long run goes stale: contexts grow, batch-mates change). A size
starts with a stretch of plain steps: nothing is judged without a reference.

The first plain step after a verify step reads its tokens back before the next step is built (nothing
was in flight): that cost is the verify step's, and it is counted as drafting's. A verify step whose
shape the batch meets for the first time (a GPU may build kernels for it, many times a step's cost)
counts for nothing, nor does the plain step after it: it says nothing of the steps of that shape to
come. Nor does a step that failed.

Output never changes with the gate: greedy speculation is lossless, and a row's text does not depend on
which steps drafted.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

StepKind = Literal["plain", "verify"]


def size_class(rows: int) -> int:
    """The batch sizes whose steps are judged together: rows rounded up to a power of two."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class _Run:
    """A run of drafting: its balance against plain decoding (plain steps lost; negative: gained,
    bounded by the credit) and its net result (unbounded)."""

    balance: float = 0.0
    net: float = 0.0
    steps: int = 0  # steps since plain steps were last measured


@dataclass
class _SizeGate:
    """One batch size: plain decoding's measured cost, the run of drafting under way (None: drafting
    is off) and when drafting may resume."""

    history: int
    window: int
    stretches: deque[float] = field(init=False)  # recent plain stretches' cost a unit of progress
    recent: dict[StepKind, deque[float]] = field(init=False)  # seconds of recent drafting steps, by kind
    stretch: list[float] = field(default_factory=list)  # the plain stretch being measured
    run: _Run | None = None
    steps: int = 0  # steps of this size
    resume_at: int = 0  # while drafting is off: the step from which it may resume
    checking: bool = False  # drafting is off for one plain stretch only (its run goes on after it)
    backoff: int = 0  # the next pause (0: the gate's first)
    refresh: int = 0  # the drafting steps before the next plain stretch (0: the gate's first)

    def __post_init__(self) -> None:
        self.stretches = deque(maxlen=self.history)
        self.recent = {"plain": deque(maxlen=self.window), "verify": deque(maxlen=self.window)}

    def reference(self) -> float | None:
        return min(self.stretches) if self.stretches else None


@dataclass
class DraftGate:
    """An engine's measure of what drafting gains against plain decoding, and whether the next step may
    draft; see the module docstring.

    `window`: plain steps a measured stretch; `history`: stretches the reference is the least of;
    `margin`: how much cheaper than measured plain decoding is taken to be when drafting is judged;
    `loss_limit`/`credit`: plain steps a run of drafting may lose beyond what it gained, and the most
    it banks; `backoff`/`max_backoff`: the first and the longest pause (in steps of a size) after a run
    that gained nothing; `refresh`/`max_refresh`: the first and the longest run of drafting steps
    between two plain stretches; `spike`: the most a drafting step counts, in medians of the recent
    ones of its kind; `share`: the most of a size's steps that runs of drafting which gained nothing
    may lose (their pause is at least their loss over it)."""

    window: int = 16
    history: int = 4
    margin: float = 0.03
    loss_limit: float = 2.0
    credit: float = 16.0
    backoff: int = 64
    max_backoff: int = 4096
    refresh: int = 256
    max_refresh: int = 2048
    spike: float = 4.0
    share: float = 0.02
    clock: Callable[[], float] = time.perf_counter
    _sizes: dict[int, _SizeGate] = field(default_factory=dict, repr=False)
    _last: tuple[StepKind, int] | None = field(default=None, repr=False)  # the last step's kind, size
    _began: float | None = field(default=None, repr=False)
    _began_rows: int = field(default=0, repr=False)
    _unmeasured: bool = field(default=False, repr=False)  # the step before gave no sample (new shape)
    paused: int = 0  # steps at which drafting was refused (reported)

    def __post_init__(self) -> None:
        if self.window < 1 or self.history < 1:
            raise ValueError(f"a draft gate needs window and history >= 1: {self}")
        if (
            not 0.0 <= self.margin < 1.0
            or self.loss_limit <= 0.0
            or self.credit < 0.0
            or self.spike < 1.0
            or not 0.0 < self.share < 1.0
        ):
            raise ValueError(
                "a draft gate needs 0 <= margin < 1, loss_limit > 0, credit >= 0, spike >= 1, "
                f"0 < share < 1: {self}"
            )
        if not 1 <= self.backoff <= self.max_backoff or not 1 <= self.refresh <= self.max_refresh:
            raise ValueError(
                f"a draft gate needs 1 <= backoff <= max_backoff, 1 <= refresh <= max_refresh: {self}"
            )

    def allows(self, rows: int) -> bool:
        """Whether a step of `rows` decoding rows may verify drafts (asked before each step that
        would)."""
        size = self._size(rows)
        if size.run is None or size.checking:
            self.paused += 1
            return False
        return True

    def begin(self, rows: int) -> None:
        """A decode step of `rows` rows starts now."""
        self._began, self._began_rows = self.clock(), rows

    def end(self, kind: StepKind, progress: int, new_shape: bool = False) -> None:
        """The step begun last ended: a `kind` step that advanced the batch by `progress` (its rows
        times what its slowest row gained; 0: nothing measured, e.g. it failed); `new_shape`: a verify
        step of a shape met for the first time."""
        began, self._began = self._began, None
        rows = self._began_rows
        size = self._size(rows)
        size.steps += 1
        last, self._last = self._last, (kind, size_class(rows))
        unmeasured, self._unmeasured = self._unmeasured, new_shape and kind == "verify"
        if began is None or progress <= 0 or self._unmeasured or (unmeasured and kind == "plain"):
            return
        seconds = max(self.clock() - began, 0.0)
        if kind == "plain" and last is not None and last[0] == "verify":
            # this step paid for the verify step before it (nothing was in flight): drafting's cost, at
            # the verify step's size, whether or not drafting goes on
            size = self._size_of(last[1])
            if size.run is not None:
                self._charge(size, kind, seconds, progress, rows)
                if not size.checking:
                    self._judge(size)
            return
        if size.run is not None and not size.checking:
            self._charge(size, kind, seconds, progress, rows)
            self._judge(size)
        elif kind == "plain":
            self._measure_plain(size, seconds / progress)

    def plain_cost(self, rows: int) -> float | None:
        """Plain decoding's seconds a unit of progress at this batch size, as judged now (None: not
        measured yet)."""
        size = self._sizes.get(size_class(rows))
        return None if size is None else size.reference()

    def drafting(self, rows: int) -> bool:
        """Whether a run of drafting is under way at this batch size (paused for a plain stretch or
        not)."""
        size = self._sizes.get(size_class(rows))
        return size is not None and size.run is not None

    def _charge(self, size: _SizeGate, kind: StepKind, seconds: float, progress: int, rows: int) -> None:
        """A step of drafting: its seconds less plain decoding's for its progress, in plain steps; a
        step far slower than the recent ones of its kind counts as `spike` times their median."""
        reference = size.reference()
        run = size.run
        if reference is None or run is None:
            return
        recent = size.recent[kind]
        counted = min(seconds, self.spike * statistics.median(recent)) if len(recent) >= 3 else seconds
        recent.append(seconds)
        lost = (counted - (1.0 - self.margin) * reference * progress) / (reference * rows)
        run.net += lost
        run.balance = max(-self.credit, run.balance + lost)

    def _judge(self, size: _SizeGate) -> None:
        """After a step of drafting: stop where it lost too much, or measure plain steps anew."""
        run = size.run
        assert run is not None
        run.steps += 1
        if run.balance > self.loss_limit:
            paid = run.net < 0.0
            size.backoff = (
                self.backoff if paid or not size.backoff else min(self.max_backoff, 2 * size.backoff)
            )
            # a run that lost more than `share` of the pause would make up for pauses that much longer
            pause = size.backoff if paid else max(size.backoff, math.ceil(run.net / self.share))
            size.run, size.resume_at, size.refresh = None, size.steps + pause, 0
            size.stretch.clear()
            return
        size.refresh = size.refresh or self.refresh
        if run.steps >= size.refresh:
            size.checking, run.steps = True, 0
            size.refresh = min(self.max_refresh, 2 * size.refresh)
            size.stretch.clear()

    def _measure_plain(self, size: _SizeGate, cost: float) -> None:
        """A plain step while drafting is off; a whole stretch may end the pause."""
        size.stretch.append(cost)
        if len(size.stretch) < self.window:
            return
        size.stretches.append(statistics.median(size.stretch))
        size.stretch.clear()
        if size.checking:
            size.checking = False
        elif size.run is None and size.steps >= size.resume_at:
            size.run = _Run()

    def _size(self, rows: int) -> _SizeGate:
        return self._size_of(size_class(rows))

    def _size_of(self, size: int) -> _SizeGate:
        if size not in self._sizes:
            self._sizes[size] = _SizeGate(self.history, self.window)
        return self._sizes[size]
