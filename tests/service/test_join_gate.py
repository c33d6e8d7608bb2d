"""`JoinGate`: when a running generation batch fills its free rows with queued jobs."""

from __future__ import annotations

from dataclasses import dataclass

from mlxq.worker.generation_jobs import JoinGate


@dataclass
class _Batch:
    """What the gate reads of a `GenerationBatch`."""

    live: int
    max_sequences: int = 64
    steps: int = 0

    def __len__(self) -> int:
        return self.live

    @property
    def free_slots(self) -> int:
        return self.max_sequences - self.live


def test_min_join_one_fills_every_free_row_at_once() -> None:
    gate = JoinGate(1, 64)
    assert gate.free_rows(_Batch(live=63)) == 1
    assert gate.free_rows(_Batch(live=64)) == 0


def test_a_batch_at_least_half_full_waits_for_min_join_free_rows() -> None:
    gate = JoinGate(8, 64, patience=16)
    batch = _Batch(live=61)  # 3 free
    assert gate.free_rows(batch) == 0
    batch.steps, batch.live = 4, 58  # 6 free
    assert gate.free_rows(batch) == 0
    batch.steps, batch.live = 8, 56  # 8 free: all of them
    assert gate.free_rows(batch) == 8


def test_free_rows_wait_no_longer_than_patience() -> None:
    gate = JoinGate(8, 64, patience=16)
    batch = _Batch(live=62, steps=100)
    assert gate.free_rows(batch) == 0  # waiting since step 100
    batch.steps = 112
    assert gate.free_rows(batch) == 0
    batch.steps = 116
    assert gate.free_rows(batch) == 2
    batch.steps, batch.live = 120, 63  # claimed (or nothing queued): a new wait starts
    assert gate.free_rows(batch) == 0
    batch.steps = 136
    assert gate.free_rows(batch) == 1


def test_a_batch_less_than_half_full_fills_at_once() -> None:
    gate = JoinGate(8, 64)
    assert gate.free_rows(_Batch(live=31)) == 33
    assert gate.free_rows(_Batch(live=0)) == 64


def test_a_full_batch_resets_the_wait() -> None:
    gate = JoinGate(8, 64, patience=16)
    batch = _Batch(live=63, steps=0)
    assert gate.free_rows(batch) == 0
    batch.steps, batch.live = 8, 64  # full again: nothing waits
    assert gate.free_rows(batch) == 0
    batch.steps, batch.live = 20, 63  # free again from step 20, not from step 0
    assert gate.free_rows(batch) == 0
    batch.steps = 36
    assert gate.free_rows(batch) == 1
