"""Engines the engine tests load, closed after each test (`_close_engines` in tests/conftest.py): an
engine holds a launcher thread's stream and MLX memory, and a module's engines would otherwise outlive
it."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine
from mlxq.worker.engine.generation_batch import Finished, GenerationBatch

_open: list[Engine] = []


def closed_after_test(engine: Engine) -> Engine:
    """`engine`, to be closed once the running test ends."""
    _open.append(engine)
    return engine


def close_engines() -> None:
    """Close every engine registered since the last call (newest first)."""
    while _open:
        _open.pop().close()


def run_requests(
    engine: Engine, requests: list[GenerateRequest], max_sequences: int, one_per_step: bool = False
) -> list[GenerateResult]:
    """Every request through one generation batch, admitted as seats free up (all that fit at once, or
    `one_per_step`), stepped until all end; their results in order (a failed one fails the test)."""
    batch = GenerationBatch(engine, max_sequences=max_sequences)
    done: dict[int, Finished] = {}
    todo = list(enumerate(requests))
    while todo or len(batch):
        while todo and batch.free_slots > 0:
            i, request = todo.pop(0)
            batch.admit(str(i), request, lambda _t, _ids: None, lambda: False)
            if one_per_step:
                break
        for f in batch.step():
            done[int(f.key)] = f
    batch.close()
    results = []
    for i in range(len(requests)):
        assert done[i].error is None and done[i].result is not None, done[i].error
        results.append(done[i].result)
    return results


def assert_same_draws(runs: list[list[list[int]]], positions: int) -> None:
    """Two ways of drawing the same seeded requests (`runs[0]`, `runs[1]`: each request's tokens) draw
    from one distribution at each of the first `positions` tokens: a chi-square test of independence
    over the first way's three commonest tokens there and the rest, at the 0.1% point."""
    for position in range(positions):
        counts: dict[int, int] = {}
        for r in runs[0]:
            counts[r[position]] = counts.get(r[position], 0) + 1
        common = sorted(counts, key=lambda t: -counts[t])[:3]
        table = np.array(
            [
                [sum(r[position] == t for r in run) for t in common]
                + [sum(r[position] not in common for r in run)]
                for run in runs
            ],
            dtype=np.float64,
        )
        table = table[:, table.sum(0) > 0]
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        stat = float(((table - expected) ** 2 / expected).sum())
        # (columns - 1) degrees of freedom: the 0.1% points of 1..3
        assert stat < {1: 10.8, 2: 13.8, 3: 16.3}[table.shape[1] - 1], (position, table)


def count_calls(obj: Any) -> list[int]:
    """Count the calls of `obj` (a module's `__call__`, every forward through it) from now on: the list's
    one item is the count. `obj` becomes an instance of a subclass of its class that counts."""
    calls = [0]

    class Counted(type(obj)):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return super().__call__(*args, **kwargs)

    obj.__class__ = Counted
    return calls
