"""Whether anyone serves a queue: a job sent where no worker listens waits there silently.

RQ registers each worker in `rq:workers:<queue>` for every queue it serves (and takes a dead one out
within a maintenance round), so an empty set means no live worker serves that queue. A client looks
when it submits to a queue (at most once a minute per queue) and logs a warning on the `producer` logger
when nobody does; a `result()` or `stream()` that times out says so in its `TimeoutError`. A look Redis
refuses (an ACL without the read) is skipped quietly: it is advice, never a reason to fail a submit.
"""

from __future__ import annotations

import logging
import time

import redis
import redis.asyncio
from rq.job import JobStatus

log = logging.getLogger("mlxq.producer")

LOOK_EVERY_S = 60.0


def workers_key(queue: str) -> str:
    """RQ's set of the workers serving `queue` (RQ's own naming, `rq.worker_registration`)."""
    return f"rq:workers:{queue}"


def unserved_warning(queue: str) -> str:
    return (
        f"no worker serves {queue!r}: its jobs wait in that queue until one does "
        f"(start one with `mlxq worker --queue {queue}`, or submit to a queue that is served)"
    )


def waiting_note(job_id: str, status: str, queue: str | None, workers: int) -> str | None:
    """What to add to a timeout of job `job_id` when it is still queued where nobody serves it."""
    if status != JobStatus.QUEUED.value or queue is None or workers > 0:
        return None
    return f"job {job_id} is still queued: {unserved_warning(queue)}"


class QueueCheck:
    """When this client last looked at each queue it submits to."""

    def __init__(self) -> None:
        self._looked: dict[str, float] = {}

    def _due(self, queue: str) -> bool:
        now = time.monotonic()
        if now - self._looked.get(queue, -LOOK_EVERY_S) < LOOK_EVERY_S:
            return False
        self._looked[queue] = now
        return True

    def run(self, conn: redis.Redis, queue: str) -> None:
        """Look at `queue` if due (sync client); never raises."""
        if self._due(queue):
            try:
                self._say(queue, int(conn.scard(workers_key(queue))))
            except redis.RedisError as e:
                log.debug("could not see who serves queue=%s error=%s", queue, e)

    async def arun(self, conn: redis.asyncio.Redis, queue: str) -> None:
        """Look at `queue` if due (asyncio client); never raises."""
        if self._due(queue):
            try:
                self._say(queue, int(await conn.scard(workers_key(queue))))
            except redis.RedisError as e:
                log.debug("could not see who serves queue=%s error=%s", queue, e)

    @staticmethod
    def _say(queue: str, workers: int) -> None:
        if workers == 0:
            log.warning("%s", unserved_warning(queue))
