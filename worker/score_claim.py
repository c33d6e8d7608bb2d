"""Claiming more queued score jobs for one score batch, up to a row budget (see `job_claim.py`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue
from rq.job import Job

from mlxq.jobs import keys
from mlxq.worker.dead_letters import DeadLetters
from mlxq.worker.job_claim import JobClaimer, QueuedJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimBudget:
    max_rows: int = 256  # rows of all jobs in one batch
    max_jobs: int = 64
    scan: int = 128  # queued ids looked at


def score_rows(queued: QueuedJob) -> int | None:
    """Rows of a queued `jobs.score` job whose payload has a list of rows, else None."""
    if queued.func != keys.SCORE_FUNC or not isinstance(queued.payload, dict):
        return None
    rows = queued.payload.get("rows")
    return len(rows) if isinstance(rows, list) else None


class ScoreClaimer:
    """Moves queued score jobs from a queue into RQ's intermediate list for this worker."""

    def __init__(
        self, conn: redis.Redis, serializer: Any, budget: ClaimBudget, dead_letters: DeadLetters | None = None
    ) -> None:
        self.budget = budget
        self.claimer = JobClaimer(conn, serializer, scan=budget.scan, dead_letters=dead_letters)

    def claim(self, queue: Queue, rows_taken: int) -> list[Job]:
        """Score jobs claimed from `queue` to join a batch that already has one job of `rows_taken` rows."""
        pick = ScorePicker(self.budget, rows_taken, jobs_taken=1)
        jobs = self.claimer.claim(queue, pick, limit=pick.jobs_left)
        if jobs:
            log.info("score batch claimed=%d rows=%d", len(jobs), pick.rows)
        return jobs

    def claim_batch(self, queue: Queue) -> tuple[list[Job], bool]:
        """A whole next batch claimed from `queue` (no job handed over by RQ in it), and whether a queued
        job was passed over for a later one (a generation job, a score job over the row budget): then
        the worker goes back to RQ's dequeue, which takes the queue in order, before claiming again."""
        pick = ScorePicker(self.budget)
        jobs = self.claimer.claim(queue, pick, limit=pick.jobs_left)
        if jobs:
            log.info("score batch claimed ahead=%d rows=%d", len(jobs), pick.rows)
        return jobs, pick.passed_over


class ScorePicker:
    """Says yes to well-formed score jobs while the batch's row and job budget allows (a `pick`)."""

    def __init__(self, budget: ClaimBudget, rows_taken: int = 0, jobs_taken: int = 0) -> None:
        self.budget = budget
        self.rows = rows_taken
        self.jobs = jobs_taken
        self.passed_over = False  # a job was refused and a later one taken
        self._refused = False

    @property
    def jobs_left(self) -> int:
        return self.budget.max_jobs - self.jobs

    def __call__(self, queued: QueuedJob) -> bool:
        n = score_rows(queued)
        if n is None or self.rows + n > self.budget.max_rows or self.jobs_left <= 0:
            self._refused = True
            return False
        self.rows += n
        self.jobs += 1
        self.passed_over = self.passed_over or self._refused
        return True
