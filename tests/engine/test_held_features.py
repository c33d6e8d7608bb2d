"""`HeldFeatures`: a drafter's features not used yet, held in order, folded as they pile up."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxq.worker.engine.speculation.held_features import HeldFeatures


def _steps(n: int, start: int = 0) -> list[mx.array]:
    """One position's features a step, (1, 1, 2), their values the position."""
    return [mx.full((1, 1, 2), float(start + i)) for i in range(n)]


def _positions(x: mx.array | None) -> list[float]:
    assert x is not None
    return np.array(x)[0, :, 0].tolist()


def test_features_come_back_in_order_whatever_was_folded() -> None:
    held = HeldFeatures(fold_every=4)
    handed = [held.add(f) for f in _steps(10)]
    # every fourth step's pieces are folded into one array, to be computed with that step
    assert [len(h) for h in handed] == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert _positions(handed[3][0]) == [0, 1, 2, 3]
    assert len(held) == 10
    assert _positions(held.take(3)) == [0, 1, 2]
    assert len(held) == 7
    held.add(mx.full((1, 2, 2), 10.0))  # a verify step's two columns
    assert _positions(held.take(100)) == [3, 4, 5, 6, 7, 8, 9, 10, 10]
    assert len(held) == 0 and held.take(1) is None


def test_keep_drops_the_newest_and_clear_all() -> None:
    held = HeldFeatures(fold_every=3)
    for f in _steps(7):
        held.add(f)
    held.keep(5)
    assert len(held) == 5
    held.keep(9)  # more than held: nothing changes
    for f in _steps(2, start=5):
        held.add(f)
    assert _positions(held.take(7)) == [0, 1, 2, 3, 4, 5, 6]
    held.add(mx.zeros((1, 3, 2)))
    held.clear()
    assert len(held) == 0 and held.take(1) is None


def test_features_put_first_come_before_those_held() -> None:
    """A row's prompt features, computed when a proposal first needs them, go before the decode
    steps' features held since."""
    held = HeldFeatures(fold_every=2)
    for f in _steps(3, start=4):
        held.add(f)
    held.put_first(mx.concatenate(_steps(4), axis=1))
    assert len(held) == 7
    held.add(mx.full((1, 1, 2), 7.0))
    assert _positions(held.take(8)) == [0, 1, 2, 3, 4, 5, 6, 7]
