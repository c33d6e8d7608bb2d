"""Score jobs: each one scored in a batch with the queued score jobs claimed beside it.

RQ hands the worker one score job; this claims more queued score jobs up to a row budget
(`ScoreClaimer`), starts them together, tokenizes every job's rows together, puts all rows in one prefix
tree (the engine computes each shared prefix once, across jobs) and ends each job on its own: a bad job
fails alone, its batch-mates go on. A generation batch hands over the score jobs it claims between two
decode steps (`score_between_steps`). With no claimer (`MLXQ_SCORE_BATCH_ROWS=0`) a job is a batch of one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rq import Queue
from rq.job import Job
from rq.timeouts import JobTimeoutException

from mlxq.jobs import MAX_NESTING_DEPTH, parse_score
from mlxq.jobs.errors import InvalidRequest
from mlxq.jobs.schema import ScoreRequest, ScoreResult
from mlxq.worker.engine.engine import PreparedRow
from mlxq.worker.job_deadline import JobDeadline
from mlxq.worker.job_host import JobHost
from mlxq.worker.job_results import JobResults
from mlxq.worker.job_watch import JobWatch
from mlxq.worker.rq_batches import Run
from mlxq.worker.score_claim import ClaimBudget, ScoreClaimer
from mlxq.worker.score_phases import ScorePhases
from mlxq.worker.stream_writer import REDIS_TRANSIENT

log = logging.getLogger(__name__)

Prepared = list[PreparedRow]  # one job's rows: tokens of candidates, continuations, windows, prompts


class ScoringEngine(Protocol):
    """What scoring needs of the engine: tokenizing and scoring, and the seconds scoring spent in each
    of its parts so far (`score_seconds`: tree, forward, unembed, device_wait)."""

    score_seconds: dict[str, float]

    def score_tokens_many(
        self, requests: Sequence[ScoreRequest]
    ) -> list[list[PreparedRow] | InvalidRequest]: ...

    def score_many(
        self, jobs: list[list[PreparedRow]], interrupt: Callable[[], None] | None = None
    ) -> list[ScoreResult]: ...


class ScoreJobs:
    """Runs score jobs in batches on the engine; built once per worker."""

    def __init__(
        self,
        engine: ScoringEngine,
        host: JobHost,
        results: JobResults,
        claimer: ScoreClaimer | None,
        max_depth: int = MAX_NESTING_DEPTH,
    ) -> None:
        self.engine = engine
        self.host = host
        self.results = results
        self.claimer = claimer
        self.max_depth = max_depth  # a request's nesting, checked before it is validated
        self.phases = ScorePhases()  # where batches spend their time, for the worker's stats

    @property
    def budget(self) -> ClaimBudget | None:
        """How many score jobs a batch may claim (None: one job at a time)."""
        return self.claimer.budget if self.claimer is not None else None

    def run(self, first: Job, queue: Queue) -> None:
        """Score `first` together with the score jobs claimed from its queue; each job ends on its own."""
        claimed: list[Job] = []
        if self.claimer is not None:
            try:
                with self.phases.timed("claim"):
                    claimed = self.claimer.claim(queue, rows_taken=_rows_of(first))
            except REDIS_TRANSIENT as e:  # Redis restarting: score `first` alone; the rest stay queued
                log.warning("score batch could not claim jobs error=%s", e)
        with self.phases.timed("start"):
            runs = self.host.start([first, *claimed], queue)
        with self.host.watching(runs):
            self.score(runs)

    def score_between_steps(self, jobs: list[Job], queue: Queue, watch: JobWatch) -> None:
        """Score jobs a generation batch claimed, watched by that batch's watch while they run."""
        with self.phases.timed("start"):
            runs = self.host.start(jobs, queue)
        watch.add(runs)
        try:
            self.score(runs)
        finally:
            for run in runs:
                watch.remove(run.job.id)

    def score(self, runs: list[Run]) -> None:
        """Score started jobs together; each one ends (finished or failed) through RQ. Each job's
        deadline runs from here: tokenizing its rows counts, and it is checked before every forward."""
        batches = self.host.batches
        deadlines = {run.job.id: JobDeadline.of(run.job) for run in runs}
        ready: list[tuple[Run, Prepared]] = []
        with self.phases.timed("tokenize"):
            prepared = self._prepare(runs)
        for run, rows in zip(runs, prepared, strict=True):
            if not isinstance(rows, Exception) and deadlines[run.job.id].passed():
                rows = deadlines[run.job.id].exceeded()
            if isinstance(rows, Exception):  # a bad job fails alone; its batch-mates go on
                batches.fail_with(run, rows)
            else:
                ready.append((run, rows))
        if not ready:
            return
        with self.phases.timed("score"), self.phases.parts(self.engine.score_seconds):
            results, timed_out = self._score_together(ready, deadlines)
            scored: list[tuple[Run, ScoreResult]] = []
            for i, (run, rows) in enumerate(ready):
                if i in timed_out:
                    continue
                try:
                    result = results.get(i)
                    if result is None:  # the batch failed: this job alone, still within its deadline
                        result = self.engine.score_many([rows], deadlines[run.job.id].check)[0]
                    scored.append((run, result))
                except Exception:
                    batches.fail(run, sys.exc_info())
        try:  # every job's result and `done` in one go; a failed write fails them all (RQ may retry)
            with self.phases.timed("write"):
                self.results.finish_scores([(run.job, result) for run, result in scored])
        except Exception:
            for run, _ in scored:
                batches.fail(run, sys.exc_info())
            return
        with self.phases.timed("end"):
            batches.succeed_many([(run, result.model_dump(mode="json")) for run, result in scored])
        self.phases.batch_done(len(scored), sum(_rows_of(run.job) for run, _ in scored))

    def _score_together(
        self, ready: list[tuple[Run, Prepared]], deadlines: dict[str, JobDeadline]
    ) -> tuple[dict[int, ScoreResult], set[int]]:
        """Score the jobs in one batch: their results by index in `ready`, and the indices of jobs that
        failed because their deadline passed meanwhile (each fails alone; the others are scored again
        without it, what was computed staying in the prefix cache). Should the batch fail otherwise,
        the jobs left have no result: the caller scores them one by one."""
        results: dict[int, ScoreResult] = {}
        timed_out: set[int] = set()
        left = list(range(len(ready)))
        while left:

            def interrupt() -> None:
                for i in left:
                    try:
                        deadlines[ready[i][0].job.id].check()
                    except JobTimeoutException as e:
                        raise _PastDeadline(i, e) from None

            try:
                done = self.engine.score_many([ready[i][1] for i in left], interrupt)
            except _PastDeadline as past:
                self.host.batches.fail_with(ready[past.index][0], past.error)
                left.remove(past.index)
                timed_out.add(past.index)
                continue
            except Exception:
                log.exception("score batch failed; scoring its jobs one by one jobs=%d", len(left))
                break
            results.update(zip(left, done, strict=True))
            break
        return results, timed_out

    def _prepare(self, runs: list[Run]) -> list[Prepared | Exception]:
        """Each run's tokenized rows, or its own error (validation, limits, a bad candidate)."""
        try:
            return self._prepare_together([run.job.args[0] for run in runs])
        except Exception:  # not a job's own error (those come back in its place): each job alone
            log.exception("preparing a score batch failed; preparing its jobs one by one jobs=%d", len(runs))
        out: list[Prepared | Exception] = []
        for run in runs:
            try:
                out.extend(self._prepare_together([run.job.args[0]]))
            except Exception as e:
                out.append(e)
        return out

    def _prepare_together(self, payloads: list[Any]) -> list[Prepared | Exception]:
        """Validate score jobs' payloads and tokenize their rows together; a bad job's own error stands
        in its place."""
        parsed: list[ScoreRequest | Exception] = []
        for payload in payloads:
            try:
                parsed.append(parse_score(payload, self.max_depth))
            except Exception as e:
                parsed.append(e)
        prepared = iter(self.engine.score_tokens_many([p for p in parsed if isinstance(p, ScoreRequest)]))
        return [p if isinstance(p, Exception) else next(prepared) for p in parsed]


class _PastDeadline(Exception):
    """A job of a score batch is past its deadline (`error`): the batch stops for it to fail alone."""

    def __init__(self, index: int, error: JobTimeoutException) -> None:
        super().__init__(str(error))
        self.index = index
        self.error = error


def _rows_of(job: Job) -> int:
    payload = job.args[0]
    rows = payload.get("rows") if isinstance(payload, dict) else None
    return len(rows) if isinstance(rows, list) else 0
