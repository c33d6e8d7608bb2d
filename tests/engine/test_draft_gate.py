"""The draft gate: a batch drafts only where its verify steps give tokens faster than its plain steps
(measured per batch size), pauses drafting with a growing backoff where they do not, and measures plain
steps when a batch size has none. Driven with a fake clock: each step's cost is what the test says."""

from __future__ import annotations

import pytest

from mlxq.worker.engine.speculation.draft_gate import DraftGate, StepKind, size_class


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
    tokens: int,
    seconds: float,
    new_shape: bool = False,
) -> None:
    gate.begin(rows)
    clock.now += seconds
    gate.end(kind, tokens, new_shape=new_shape)


def _run(
    gate: DraftGate, clock: Clock, rows: int, steps: int, plain_s: float, verify_s: float, per_row: int
) -> list[StepKind]:
    """`steps` steps of `rows` rows: a verify step (giving `per_row` tokens a row) whenever the gate
    allows, else a plain one; returns the kinds taken."""
    kinds: list[StepKind] = []
    for _ in range(steps):
        if gate.allows(rows):
            _step(gate, clock, rows, "verify", rows * per_row, verify_s)
            kinds.append("verify")
        else:
            _step(gate, clock, rows, "plain", rows, plain_s)
            kinds.append("plain")
    return kinds


def test_size_classes_are_powers_of_two() -> None:
    assert [size_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_drafting_that_pays_is_never_paused() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock)
    for _ in range(4):  # plain steps first (rows with nothing to copy)
        _step(gate, clock, 1, "plain", 1, 0.010)
    # a verify step costs 1.5 plain ones and gives 2.5 tokens: drafting pays
    kinds = _run(gate, clock, 1, 200, plain_s=0.010, verify_s=0.015, per_row=3)
    assert kinds.count("verify") == 200 and gate.paused == 0
    plain, verify = gate.cost(1)
    assert plain == pytest.approx(0.010) and verify is not None and verify < plain


def test_drafting_that_loses_pauses_with_a_growing_backoff() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, min_samples=3, backoff=8, max_backoff=64)
    for _ in range(4):
        _step(gate, clock, 8, "plain", 8, 0.010)
    # a verify step costs 4 plain ones and gives 2 tokens a row: drafting loses
    kinds = _run(gate, clock, 8, 1000, plain_s=0.010, verify_s=0.040, per_row=2)
    verify = kinds.count("verify")
    # three measured verify steps each time drafting is allowed again; pauses of 8, 16, 32, 64, 64, ...
    assert 3 * 4 < verify < 3 * 25
    assert verify < 0.1 * len(kinds)
    assert gate.paused == len(kinds) - verify
    # the pauses grew: the last stretch of plain steps is the longest pause
    stretches, run = [], 0
    for kind in kinds:
        if kind == "plain":
            run += 1
        elif run:
            stretches.append(run)
            run = 0
    assert stretches[0] < stretches[-1] == 64


def test_the_first_plain_step_after_a_verify_is_the_verify_steps_cost() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, min_samples=10)
    _step(gate, clock, 1, "plain", 1, 0.010)
    _step(gate, clock, 1, "verify", 3, 0.015)
    _step(gate, clock, 1, "plain", 1, 0.030)  # read back with nothing in flight
    plain, verify = gate.cost(1)
    assert plain == pytest.approx(0.010)
    assert verify is not None and verify > 0.015 / 3


def test_verify_steps_of_new_shapes_and_the_plain_steps_after_them_give_no_sample() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, min_samples=2, backoff=8)
    for _ in range(4):
        _step(gate, clock, 1, "plain", 1, 0.010)
    # each verify step meets a new shape (kernels built: 50 ms), then a plain step reads it back; were
    # they measured, drafting would look 10x dearer than plain decoding and pause
    for _ in range(6):
        assert gate.allows(1)
        _step(gate, clock, 1, "verify", 6, 0.050, new_shape=True)
        _step(gate, clock, 1, "plain", 1, 0.030)
    assert gate.cost(1) == (pytest.approx(0.010), None) and gate.paused == 0
    # the same shapes again: cheap verify steps, measured, and drafting keeps paying
    for _ in range(4):
        assert gate.allows(1)
        _step(gate, clock, 1, "verify", 6, 0.012)
    plain, verify = gate.cost(1)
    assert plain == pytest.approx(0.010) and verify == pytest.approx(0.002) and gate.paused == 0


def test_a_size_with_only_verify_steps_measures_plain_ones() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, min_samples=3, probe=2)
    kinds = []
    for _ in range(3):
        assert gate.allows(4)
        _step(gate, clock, 4, "verify", 8, 0.020)
    # no plain step of this size yet: the next ones are plain (one counted as the verify's, two measured)
    for _ in range(3):
        assert not gate.allows(4)
        _step(gate, clock, 4, "plain", 4, 0.008)
        kinds.append("plain")
    assert gate.cost(4)[0] == pytest.approx(0.008 / 4)
    assert gate.allows(4)  # verify (0.0025 s a token, with the step after) vs plain (0.002): judged next
    _step(gate, clock, 4, "verify", 8, 0.020)
    assert not gate.allows(4)  # drafting lost here
    assert gate.allows(1)  # another batch size is judged on its own


def test_sizes_are_judged_apart() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock, min_samples=2, backoff=16)
    for rows in (1, 64):
        _step(gate, clock, rows, "plain", rows, 0.005)
    _run(gate, clock, 64, 20, plain_s=0.005, verify_s=0.030, per_row=2)  # loses at 64 rows
    _run(gate, clock, 1, 20, plain_s=0.005, verify_s=0.006, per_row=3)  # pays alone
    assert not gate.allows(64)
    assert gate.allows(1)


def test_a_step_that_gave_nothing_is_not_measured() -> None:
    clock = Clock()
    gate = DraftGate(clock=clock)
    _step(gate, clock, 2, "plain", 0, 5.0)  # a failed step
    assert gate.cost(2) == (None, None)


def test_a_plain_step_slowed_once_does_not_make_drafting_look_cheap() -> None:
    """The first plain step of a shape builds its kernels on a GPU (far dearer than a step), and plain
    steps are rare where rows draft: plain steps are judged by their least cost, not an average."""
    clock = Clock()
    gate = DraftGate(clock=clock, min_samples=3, backoff=16)
    _step(gate, clock, 8, "plain", 8, 2.0)  # a new shape's kernels
    _step(gate, clock, 8, "plain", 8, 0.010)
    # a verify step costs 4 plain ones and gives 2 tokens a row: drafting loses
    kinds = _run(gate, clock, 8, 100, plain_s=0.010, verify_s=0.040, per_row=2)
    assert kinds[:3] == ["verify"] * 3 and kinds[3:19] == ["plain"] * 16
    assert gate.cost(8)[0] == pytest.approx(0.010 / 8)


def test_plain_steps_are_measured_again_when_their_latest_sample_is_old() -> None:
    """Drafting that pays keeps every step a verify step; now and then a few plain steps check the
    comparison still holds (contexts grow, batch-mates change)."""
    clock = Clock()
    gate = DraftGate(clock=clock, min_samples=2, probe=2, refresh=50)
    _step(gate, clock, 1, "plain", 1, 0.010)
    kinds = _run(gate, clock, 1, 200, plain_s=0.010, verify_s=0.015, per_row=3)
    plain_runs = [i for i, k in enumerate(kinds) if k == "plain"]
    assert 3 * 2 <= len(plain_runs) <= 5 * 3  # a probe every ~50 steps, a few steps each
    assert kinds.count("verify") > 180


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        DraftGate(window=0)
    with pytest.raises(ValueError, match="backoff"):
        DraftGate(backoff=64, max_backoff=32)
