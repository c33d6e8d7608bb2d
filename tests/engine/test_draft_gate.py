"""The draft gate: a batch drafts only while what it gains against plain decoding (measured per batch
size, by the sum of its steps' seconds against its progress) pays for what drafting costs, pauses with
a growing backoff where it does not, and measures plain steps before it judges and again while
drafting pays. Driven with a fake clock: each step's cost is what the test's model of a batch says."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from mlxq.worker.engine.speculation.draft_gate import DraftGate, StepKind, size_class

# what a modelled batch does at a step, given whether the gate allows drafting: its kind, seconds, progress
Batch = Callable[[bool], tuple[StepKind, float, int]]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step(
    gate: DraftGate,
    clock: Clock,
    rows: int,
    kind: StepKind,
    progress: int,
    seconds: float,
    new_shape: bool = False,
) -> None:
    gate.begin(rows)
    clock.now += seconds
    gate.end(kind, progress, new_shape=new_shape)


def _drive(gate: DraftGate, clock: Clock, rows: int, steps: int, batch: Batch) -> list[bool]:
    """`steps` steps of `rows` rows, each as `batch` takes it; returns whether each step was allowed to
    draft."""
    allowed: list[bool] = []
    for _ in range(steps):
        allowed.append(gate.allows(rows))
        kind, seconds, progress = batch(allowed[-1])
        _step(gate, clock, rows, kind, progress, seconds)
    return allowed


def _always(rows: int, plain_s: float, verify_s: float, per_row: int) -> Batch:
    """A batch that verifies at every step it may, each row taking `per_row` tokens a verify step."""

    def step(allowed: bool) -> tuple[StepKind, float, int]:
        return ("verify", verify_s, rows * per_row) if allowed else ("plain", plain_s, rows)

    return step


def _speed(clock: Clock, progress: int, plain_s_per_unit: float) -> float:
    """Throughput against plain decoding of the same progress."""
    return progress * plain_s_per_unit / clock.now


def test_size_classes_are_powers_of_two() -> None:
    assert [size_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_a_size_measures_a_stretch_of_plain_steps_before_it_drafts() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, window=8)
    allowed = _drive(gate, clock, 2, 12, _always(2, plain_s=0.010, verify_s=0.012, per_row=3))
    assert allowed == [False] * 8 + [True] * 4
    assert gate.plain_cost(2) == pytest.approx(0.005) and gate.paused == 8
    assert gate.plain_cost(4) is None and gate.allows(4) is False  # another size starts on its own


def test_drafting_that_pays_goes_on_nearly_all_the_time_and_plain_steps_are_measured_again_apart() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, window=16, refresh=256, max_refresh=1024)
    # a verify step costs 1.5 plain ones and gives 3 tokens: drafting pays
    allowed = _drive(gate, clock, 1, 4000, _always(1, plain_s=0.010, verify_s=0.015, per_row=3))
    plain_runs = [i for i, (a, b) in enumerate(itertools.pairwise([True, *allowed])) if a and not b]
    gaps = [b - a for a, b in itertools.pairwise(plain_runs)]
    # 256, 512, then every 1024 drafting steps; each plain stretch 16 steps, after the plain step that
    # reads the last verify step back (the first stretch has none before it)
    assert gaps[:3] == [16 + 256, 17 + 512, 17 + 1024] and set(gaps[3:]) == {17 + 1024}
    assert allowed.count(True) > 0.97 * len(allowed)
    assert gate.drafting(1)


def test_verify_steps_cheap_per_token_at_the_median_but_dear_by_the_sum_stop_drafting() -> None:
    """Three verify steps in five give 3 tokens for 25 ms (8.3 ms a token, cheaper than a plain step's
    10), two give one (25 ms): the median says drafting pays, the sum (125 ms for 11 tokens) says it
    loses, and the batch must not go slower than plain decoding by more than the probes cost."""
    clock = Clock()
    gate = DraftGate(clock=clock)
    pattern = [3, 1, 3, 1, 3]
    verified = [0]

    def step(allowed: bool) -> tuple[StepKind, float, int]:
        if not allowed:
            return "plain", 0.010, 1
        verified[0] += 1
        return "verify", 0.025, pattern[verified[0] % len(pattern)]

    allowed = _drive(gate, clock, 1, 10_000, step)
    progress = allowed.count(False) + sum(pattern[i % len(pattern)] for i in range(1, verified[0] + 1))
    assert verified[0] < 0.01 * len(allowed)
    assert _speed(clock, progress, 0.010) > 0.98


def test_drafting_that_makes_the_plain_steps_between_verify_steps_dearer_stops() -> None:
    """Eight rows: a verify step gives 3 tokens a row for 20 ms (0.83 ms a token, cheaper than a plain
    step's 0.86 without drafting), but the plain steps taken while rows have holes from a verify step
    cost 9 ms instead of 6.9 (masks instead of the ragged kernel): drafting, taken as a whole, loses."""
    clock = Clock()
    gate = DraftGate(clock=clock)
    since_verify = [99]
    verified = [0]

    def step(allowed: bool) -> tuple[StepKind, float, int]:
        since_verify[0] += 1
        if allowed and since_verify[0] >= 2:  # the rows' drafts match every other step
            since_verify[0], verified[0] = 0, verified[0] + 1
            return "verify", 0.020, 8 * 3
        return "plain", 0.009 if since_verify[0] <= 4 else 0.0069, 8

    allowed = _drive(gate, clock, 8, 10_000, step)
    progress = 8 * (len(allowed) - verified[0]) + 24 * verified[0]
    assert verified[0] < 0.01 * len(allowed)
    assert _speed(clock, progress, 0.0069 / 8) > 0.98
    assert gate.plain_cost(8) == pytest.approx(0.0069 / 8)


def test_prose_where_drafts_are_rarely_kept_keeps_drafting_off_and_explores_little() -> None:
    """One row of open prose: a verify step now and then (a short n-gram match) gives 1.4 tokens for
    18 ms against a plain step's 6 ms, and the plain step after it reads it back (9 ms)."""
    clock = Clock()
    gate = DraftGate(clock=clock)
    count, last = [0], ["plain"]
    progress = [0]

    def step(allowed: bool) -> tuple[StepKind, float, int]:
        count[0] += 1
        if allowed and count[0] % 12 == 0:
            kind, seconds, gained = "verify", 0.018, 1 + (count[0] // 12) % 2
        else:
            kind, seconds, gained = "plain", 0.009 if last[0] == "verify" else 0.006, 1
        last[0] = kind
        progress[0] += gained
        return kind, seconds, gained  # type: ignore[return-value]

    allowed = _drive(gate, clock, 1, 20_000, step)
    assert allowed.count(True) < 0.05 * len(allowed)  # steps spent exploring
    assert _speed(clock, progress[0], 0.006) > 0.99
    later = allowed[10_000:]
    assert later.count(True) < 0.02 * len(later)  # the pauses grew


def test_a_run_that_pays_goes_on_through_text_where_drafting_loses_a_little() -> None:
    """Copied passages (a verify step gives 4 tokens for 15 ms against plain steps of 10) between short
    stretches of free text where every verify step fails (15 ms for one token): what the copies gained
    pays for the failures, so drafting never stops."""
    clock = Clock()
    gate = DraftGate(clock=clock, refresh=4096, max_refresh=4096)
    count = [0]

    def step(allowed: bool) -> tuple[StepKind, float, int]:
        count[0] += 1
        if not allowed:
            return "plain", 0.010, 1
        return "verify", 0.015, 4 if count[0] % 40 < 30 else 1

    allowed = _drive(gate, clock, 1, 3000, step)
    assert allowed == [False] * gate.window + [True] * (3000 - gate.window)


def test_a_step_slowed_once_by_the_host_does_not_stop_drafting_that_pays() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock)
    pays = _always(1, plain_s=0.010, verify_s=0.015, per_row=3)
    _drive(gate, clock, 1, 64, pays)
    gate.begin(1)
    clock.now += 1.0  # a verify step that waited for the host: 100 plain steps
    gate.end("verify", 3)
    allowed = _drive(gate, clock, 1, 64, pays)
    assert all(allowed)  # it counted as 4 of its kind's recent steps: the credit paid for it


def test_text_that_starts_being_copied_later_is_found() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, backoff=64, max_backoff=256)
    _drive(gate, clock, 1, 3000, _always(1, plain_s=0.010, verify_s=0.030, per_row=1))  # loses
    assert not gate.drafting(1)
    allowed = _drive(gate, clock, 1, 3000, _always(1, plain_s=0.010, verify_s=0.015, per_row=4))
    assert allowed[256 + 2 * gate.window :].count(False) < 0.05 * len(allowed)


def test_drafting_that_loses_pauses_with_a_growing_backoff() -> None:
    clock = Clock()
    # a share this large never lengthens a pause: the doubling alone (next test: the share)
    gate = DraftGate(clock=clock, window=8, backoff=32, max_backoff=256, share=0.5)
    # a verify step costs 4 plain ones and gives 2 tokens a row: drafting loses
    allowed = _drive(gate, clock, 8, 3000, _always(8, plain_s=0.010, verify_s=0.040, per_row=2))
    assert gate.paused == allowed.count(False)
    pauses, run = [], 0
    for a in allowed:
        if not a:
            run += 1
        elif run:
            pauses.append(run)
            run = 0
    assert pauses[0] == 8  # the first plain stretch
    # whole stretches of 8 steps, after the plain step that reads the last verify step back
    assert pauses[1:4] == [1 + 32, 1 + 64, 1 + 128] and set(pauses[4:]) == {1 + 256}
    # a probe costs a few verify steps: each loses 2 plain steps, the run stops past 2 lost
    assert allowed.count(True) <= 2 * (len(pauses) - 1)


def test_a_probe_dearer_than_the_loss_limit_pauses_long_enough_to_cost_at_most_the_share() -> None:
    """A draft model (or MTP layer) that never pays, whose one verify step costs 35 plain steps (it
    enters the row's prompt before its first proposal), over 1,500 steps (a dozen short jobs): each
    probe loses far more than `loss_limit`, so its pause grows with that loss and what the probes cost
    stays near `share` of the time, where the doubling alone (64, 128, 256 ... steps) lost ~10%."""

    def dear(allowed: bool) -> tuple[StepKind, float, int]:
        return ("verify", 0.35, 1) if allowed else ("plain", 0.010, 1)

    for share in (0.02, 0.05):
        clock = Clock()
        allowed = _drive(DraftGate(clock=clock, share=share), clock, 1, 1500, dear)
        assert allowed.count(True) >= 1  # it did look
        assert _speed(clock, 1500, 0.010) > 1.0 - 1.5 * share
    clock = Clock()
    _drive(DraftGate(clock=clock, share=0.9), clock, 1, 1500, dear)  # the share never binds
    assert _speed(clock, 1500, 0.010) < 0.92


def test_the_first_plain_step_after_a_verify_is_drafting_s_cost() -> None:
    """Verify steps that would pay alone, each read back by a plain step costing 5 plain ones (nothing
    was in flight): drafting loses, and plain decoding's own cost is not the dearer step's."""
    clock = Clock()
    gate = DraftGate(clock=clock)
    last: list[StepKind] = ["plain"]

    def step(allowed: bool) -> tuple[StepKind, float, int]:
        kind: StepKind = "verify" if allowed and last[0] == "plain" else "plain"
        seconds = {"verify": 0.015, "plain": 0.050 if last[0] == "verify" else 0.010}[kind]
        last[0] = kind
        return kind, seconds, 3 if kind == "verify" else 1

    allowed = _drive(gate, clock, 1, 2000, step)
    assert allowed.count(True) < 0.02 * len(allowed)
    assert gate.plain_cost(1) == pytest.approx(0.010)


def test_verify_steps_of_new_shapes_and_the_plain_steps_after_them_count_for_nothing() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, window=4)
    for _ in range(4):
        _step(gate, clock, 1, "plain", 1, 0.010)
    # each verify step meets a new shape (kernels built: 50 ms), then a plain step reads it back; were
    # they counted, drafting would lose 10 plain steps each time and stop
    for _ in range(6):
        assert gate.allows(1)
        _step(gate, clock, 1, "verify", 6, 0.050, new_shape=True)
        _step(gate, clock, 1, "plain", 1, 0.030)
    assert gate.drafting(1) and gate.paused == 0
    # the same shapes again, slow: counted, and drafting stops
    for _ in range(4):
        if gate.allows(1):
            _step(gate, clock, 1, "verify", 2, 0.050)
    assert not gate.drafting(1)


def test_a_plain_step_slowed_once_does_not_make_drafting_look_cheap() -> None:
    """The first plain step of a shape builds its kernels on a GPU (far dearer than a step): a stretch
    of plain steps costs its median step, the reference the least stretch."""
    clock = Clock()
    gate = DraftGate(clock=clock, window=8)
    _step(gate, clock, 8, "plain", 8, 2.0)  # a new shape's kernels
    allowed = _drive(gate, clock, 8, 200, _always(8, plain_s=0.010, verify_s=0.040, per_row=2))
    assert gate.plain_cost(8) == pytest.approx(0.010 / 8)
    # drafting starts after the stretch and stops at its first verify step (it loses 2 plain steps)
    assert allowed[:7] == [False] * 7 and allowed[7:9] == [True, False] and not gate.drafting(8)


def test_sizes_are_judged_apart() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock)
    _drive(gate, clock, 64, 200, _always(64, plain_s=0.005, verify_s=0.030, per_row=2))  # loses at 64 rows
    _drive(gate, clock, 1, 200, _always(1, plain_s=0.005, verify_s=0.006, per_row=3))  # pays alone
    assert not gate.allows(64)
    assert gate.allows(1)


def test_a_step_that_gave_nothing_is_not_measured() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, window=1)
    _step(gate, clock, 2, "plain", 0, 5.0)  # a failed step
    assert gate.plain_cost(2) is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        DraftGate(window=0)
    with pytest.raises(ValueError, match="backoff"):
        DraftGate(backoff=64, max_backoff=32)
    with pytest.raises(ValueError, match="margin"):
        DraftGate(margin=1.0)
