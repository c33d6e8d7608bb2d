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

A pipelined worker (`ScoreJobs`, `MLXQ_SCORE_PIPELINE`) claims, starts and tokenizes the next batch on
a helper thread while this one is scored and written, and ends finished jobs through RQ on the
finalizer's thread: those phases keep their time here, and are also added to `aside` (time spent beside
the batch, off the main thread). What the main thread spent waiting for them (the next batch not yet
taken when this one was done, the finalizer's last ends before the worker goes back to RQ) is `waited`:
`aside - waited` is how much of the claim, start, tokenize and end was hidden behind the batches' own
work
(the stats fields `score_aside_s` and `score_waited_s`, shown by `mlxq status` and the `queue`
benchmark). Hidden is not free: the helper threads share the interpreter lock with the batch, so the
CPU time of the work aside (`aside_cpu`, the threads' own CPU clock) is what it can still take from
the batch's path, where `aside - aside_cpu` was spent waiting on Redis.

Which of these dominates decides what to tune: the queue's round trips
(more rows per job, more workers) or the model (a larger batch, a faster device). `ScoreJobs` times each
phase here; the worker publishes the sums in its stats hash (`fields`), so `mlxq status` shows the mean
per batch and Prometheus the totals. Sums, not a history: a worker lives for days and the hash is read
by whoever asks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter, thread_time

from mlxq.jobs.keys import SCORE_PHASES as PHASES


class ScorePhases:
    """Seconds spent in each phase of score batches since the worker started (and, of the phases timed
    here, their CPU time on the thread that ran them), and how many batches, jobs and rows went
    through; of the claim, start, tokenize and end, the seconds spent on helper threads beside the
    batches (`aside`, and the CPU time of it, `aside_cpu`) and those the main thread waited for them
    (`waited`). Phases may be timed from the batch's helper threads: the sums are added under a lock."""

    def __init__(
        self, clock: Callable[[], float] = perf_counter, cpu_clock: Callable[[], float] = thread_time
    ) -> None:
        self._clock = clock
        self._cpu_clock = cpu_clock  # the calling thread's CPU time
        self._lock = threading.Lock()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        # The CPU time of each timed phase, on the thread that ran it: what a phase costs the host,
        # apart from its waits on Redis, the device and the interpreter lock (which move with the load).
        self.cpu_seconds: dict[str, float] = {}
        self.aside = 0.0
        self.aside_cpu = 0.0
        self.waited = 0.0
        self.batches = 0
        self.jobs = 0
        self.rows = 0

    @contextmanager
    def timed(self, phase: str, aside: bool = False) -> Iterator[None]:
        """Add the time the block takes to `phase` (also when it raises: a failed write took its time);
        `aside`: the block runs on a helper thread beside a batch, its time counts in `aside` too."""
        if phase not in self.seconds:
            raise ValueError(f"unknown score phase {phase!r}; phases: {', '.join(PHASES)}")
        started, cpu = self._clock(), self._cpu_clock()
        try:
            yield
        finally:
            spent = self._clock() - started
            cpu = self._cpu_clock() - cpu
            with self._lock:
                self.seconds[phase] += spent
                self.cpu_seconds[phase] = self.cpu_seconds.get(phase, 0.0) + cpu
                if aside:
                    self.aside += spent
                    self.aside_cpu += cpu

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Add the time the block takes to `waited`: the main thread blocked on work done aside."""
        started = self._clock()
        try:
            yield
        finally:
            spent = self._clock() - started
            with self._lock:
                self.waited += spent

    @contextmanager
    def parts(self, seconds: dict[str, float]) -> Iterator[None]:
        """Add what the block adds to `seconds` (the engine's running sums of its parts of scoring:
        tree, forward, unembed, device_wait) to those phases."""
        before = dict(seconds)
        try:
            yield
        finally:
            with self._lock:
                for phase, s in seconds.items():
                    if phase in self.seconds:
                        self.seconds[phase] += s - before.get(phase, 0.0)

    def batch_done(self, jobs: int, rows: int) -> None:
        with self._lock:
            self.batches += 1
            self.jobs += jobs
            self.rows += rows

    def fields(self) -> dict[str, str]:
        """The worker stats hash's score fields (docs/operations.md): counts, seconds per phase (and the
        CPU time of each phase timed here), and seconds aside (and their CPU time) and waited for."""
        with self._lock:
            if not self.batches:
                return {}
            out = {
                "score_batches": str(self.batches),
                "score_jobs": str(self.jobs),
                "score_rows": str(self.rows),
            }
            out.update({f"score_{phase}_s": f"{s:.6f}" for phase, s in self.seconds.items()})
            out.update({f"score_{phase}_cpu_s": f"{s:.6f}" for phase, s in self.cpu_seconds.items()})
            out.update(
                {
                    "score_aside_s": f"{self.aside:.6f}",
                    "score_aside_cpu_s": f"{self.aside_cpu:.6f}",
                    "score_waited_s": f"{self.waited:.6f}",
                }
            )
            return out
