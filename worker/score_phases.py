"""Where a worker's score batches spend their time: the phases of every batch, added up.

A score batch goes through the same steps whatever its size: claim the queued score jobs beside the
first (`ScoreClaimer`), start them in RQ (`RqBatches.start`), validate and tokenize their rows, score
them on the engine (prefix tree, forwards, unembedding), write results and `done` events
(`JobResults`), end them in RQ. The engine's time (`score`) is split into its parts as the engine
times them (`PrefixScorer`): `tree`, `forward` and `unembed` are host time building the prefix tree,
the forwards and the LM head's work; `device_wait` is the time spent waiting for the device, which
runs forwards and heads lazily (so it holds the device time of both). No wait is added to split them;
the engine's debug setting `MLXQ_SYNC_SCORE_PHASES` waits for each forward and head, so that their
device time counts as `forward` and `unembed` (and the batch is slower).

Which of these dominates decides what to tune: the queue's round trips
(more rows per job, more workers) or the model (a larger batch, a faster device). `ScoreJobs` times each
phase here; the worker publishes the sums in its stats hash (`fields`), so `mlxq status` shows the mean
per batch and Prometheus the totals. Sums, not a history: a worker lives for days and the hash is read
by whoever asks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

from mlxq.jobs.keys import SCORE_PHASES as PHASES


class ScorePhases:
    """Seconds spent in each phase of score batches since the worker started, and how many batches,
    jobs and rows went through. Main thread only (the worker runs one batch at a time)."""

    def __init__(self, clock: Callable[[], float] = perf_counter) -> None:
        self._clock = clock
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.batches = 0
        self.jobs = 0
        self.rows = 0

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the time the block takes to `phase` (also when it raises: a failed write took its time)."""
        if phase not in self.seconds:
            raise ValueError(f"unknown score phase {phase!r}; phases: {', '.join(PHASES)}")
        started = self._clock()
        try:
            yield
        finally:
            self.seconds[phase] += self._clock() - started

    @contextmanager
    def parts(self, seconds: dict[str, float]) -> Iterator[None]:
        """Add what the block adds to `seconds` (the engine's running sums of its parts of scoring:
        tree, forward, unembed, device_wait) to those phases."""
        before = dict(seconds)
        try:
            yield
        finally:
            for phase, s in seconds.items():
                if phase in self.seconds:
                    self.seconds[phase] += s - before.get(phase, 0.0)

    def batch_done(self, jobs: int, rows: int) -> None:
        self.batches += 1
        self.jobs += jobs
        self.rows += rows

    def fields(self) -> dict[str, str]:
        """The worker stats hash's score fields (docs/operations.md): counts, and seconds per phase."""
        if not self.batches:
            return {}
        out = {
            "score_batches": str(self.batches),
            "score_jobs": str(self.jobs),
            "score_rows": str(self.rows),
        }
        out.update({f"score_{phase}_s": f"{s:.6f}" for phase, s in self.seconds.items()})
        return out
