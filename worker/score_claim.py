"""Claiming more queued score jobs for one batch, safely, beside RQ's own dequeue.

RQ hands a worker one job at a time. After it hands us a score job, we look at the next ids waiting in
the same queue, pick score jobs up to a row budget, and move each from the queue to RQ's intermediate
list in one Lua call (exactly where RQ's own dequeue puts a job it pops). A job another worker took in
the meantime is simply not there to move; a job we moved but never started (we were killed) is put
back by RQ's intermediate-queue cleanup. So nothing is run twice and nothing is lost.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue
from rq.job import Job

from jobs import keys

log = logging.getLogger(__name__)

_MOVE = """
local moved = {}
for i, id in ipairs(ARGV) do
  if redis.call('LREM', KEYS[1], 1, id) == 1 then
    redis.call('RPUSH', KEYS[2], id)
    moved[#moved + 1] = id
  end
end
return moved
"""


@dataclass(frozen=True)
class ClaimBudget:
    max_rows: int = 256  # rows of all jobs in one batch
    max_jobs: int = 64
    scan: int = 128  # queued ids looked at


def _score_rows(data: bytes | None) -> int | None:
    """Rows in a queued job's payload if it is a well-formed `jobs.score` job, else None."""
    if not data:
        return None
    try:
        raw = zlib.decompress(data)
    except zlib.error:
        raw = data
    try:
        func, _instance, args, kwargs = json.loads(raw)
        rows = args[0]["rows"]
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    if func != keys.SCORE_FUNC or kwargs or len(args) != 1 or not isinstance(rows, list):
        return None
    return len(rows)


class ScoreClaimer:
    """Moves queued score jobs from a queue into RQ's intermediate list for this worker."""

    def __init__(self, conn: redis.Redis, serializer: Any, budget: ClaimBudget) -> None:
        self.conn = conn
        self.serializer = serializer
        self.budget = budget
        self._move = conn.register_script(_MOVE)

    def claim(self, queue: Queue, rows_taken: int) -> list[Job]:
        """Score jobs claimed from `queue` to join a batch that already has `rows_taken` rows."""
        ids = [i.decode() for i in self.conn.lrange(queue.key, 0, self.budget.scan - 1)]
        if not ids:
            return []
        pipe = self.conn.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(keys.rq_job_key(job_id), "data")
        chosen, rows = [], rows_taken
        for job_id, data in zip(ids, pipe.execute(), strict=True):
            n = _score_rows(data)
            if n is None or rows + n > self.budget.max_rows:
                continue
            chosen.append(job_id)
            rows += n
            if len(chosen) + 1 >= self.budget.max_jobs:
                break
        if not chosen:
            return []
        moved = self._move(keys=[queue.key, queue.intermediate_queue_key], args=chosen)
        jobs = []
        for job_id in (m.decode() for m in moved):
            try:
                jobs.append(Job.fetch(job_id, connection=self.conn, serializer=self.serializer))
            except Exception as e:  # deleted meanwhile: nothing to run; leave it to RQ's cleanup
                log.warning("claimed job vanished job=%s error=%s", job_id, e)
        if jobs:
            log.info("score batch claimed=%d rows=%d", len(jobs), rows)
        return jobs
