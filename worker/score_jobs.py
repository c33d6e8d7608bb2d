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
from collections.abc import Sequence
from typing import Any, Protocol

from rq import Queue
from rq.job import Job

from jobs import parse_score
from jobs.errors import InvalidRequest
from jobs.schema import ScoreRequest, ScoreResult
from worker.engine.scoring import RowTokens
from worker.job_host import JobHost
from worker.job_results import JobResults
from worker.job_watch import JobWatch
from worker.rq_batches import Run
from worker.score_claim import ClaimBudget, ScoreClaimer
from worker.stream_writer import REDIS_TRANSIENT

log = logging.getLogger(__name__)

Prepared = list[RowTokens]  # one job's rows: prompt tokens and candidate token ids


class ScoringEngine(Protocol):
    """What scoring needs of the engine."""

    def score_tokens_many(
        self, requests: Sequence[ScoreRequest]
    ) -> list[list[RowTokens] | InvalidRequest]: ...

    def score_many(self, jobs: list[list[RowTokens]]) -> list[ScoreResult]: ...


class ScoreJobs:
    """Runs score jobs in batches on the engine; built once per worker."""

    def __init__(
        self, engine: ScoringEngine, host: JobHost, results: JobResults, claimer: ScoreClaimer | None
    ) -> None:
        self.engine = engine
        self.host = host
        self.results = results
        self.claimer = claimer

    @property
    def budget(self) -> ClaimBudget | None:
        """How many score jobs a batch may claim (None: one job at a time)."""
        return self.claimer.budget if self.claimer is not None else None

    def run(self, first: Job, queue: Queue) -> None:
        """Score `first` together with the score jobs claimed from its queue; each job ends on its own."""
        claimed: list[Job] = []
        if self.claimer is not None:
            try:
                claimed = self.claimer.claim(queue, rows_taken=_rows_of(first))
            except REDIS_TRANSIENT as e:  # Redis restarting: score `first` alone; the rest stay queued
                log.warning("score batch could not claim jobs error=%s", e)
        runs = self.host.start([first, *claimed], queue)
        with self.host.watching(runs):
            self.score(runs)

    def score_between_steps(self, jobs: list[Job], queue: Queue, watch: JobWatch) -> None:
        """Score jobs a generation batch claimed, watched by that batch's watch while they run."""
        runs = self.host.start(jobs, queue)
        watch.add(runs)
        try:
            self.score(runs)
        finally:
            for run in runs:
                watch.remove(run.job.id)

    def score(self, runs: list[Run]) -> None:
        """Score started jobs together; each one ends (finished or failed) through RQ."""
        batches = self.host.batches
        ready: list[tuple[Run, Prepared]] = []
        for run, rows in zip(runs, self._prepare(runs), strict=True):
            if isinstance(rows, Exception):  # a bad job fails alone; its batch-mates go on
                batches.fail_with(run, rows)
            else:
                ready.append((run, rows))
        if not ready:
            return
        try:
            results: list[ScoreResult] | None = self.engine.score_many([rows for _, rows in ready])
        except Exception:
            log.exception("score batch failed; scoring its jobs one by one jobs=%d", len(ready))
            results = None
        scored: list[tuple[Run, ScoreResult]] = []
        for i, (run, rows) in enumerate(ready):
            try:
                scored.append((run, results[i] if results is not None else self.engine.score_many([rows])[0]))
            except Exception:
                batches.fail(run, sys.exc_info())
        try:  # every job's result and `done` in one go; a failed write fails them all (RQ may retry)
            self.results.finish_scores([(run.job, result) for run, result in scored])
        except Exception:
            for run, _ in scored:
                batches.fail(run, sys.exc_info())
            return
        batches.succeed_many([(run, result.model_dump(mode="json")) for run, result in scored])

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
                parsed.append(parse_score(payload))
            except Exception as e:
                parsed.append(e)
        prepared = iter(self.engine.score_tokens_many([p for p in parsed if isinstance(p, ScoreRequest)]))
        return [p if isinstance(p, Exception) else next(prepared) for p in parsed]


def _rows_of(job: Job) -> int:
    payload = job.args[0]
    rows = payload.get("rows") if isinstance(payload, dict) else None
    return len(rows) if isinstance(rows, list) else 0
