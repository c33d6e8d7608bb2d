"""A full Redis, as one worker process sees it: when its writes began to be refused for memory, and
how many were.

Redis at `maxmemory` under `noeviction` answers every write that could grow memory with an OOM error
and keeps answering reads. That is a state of the server, not of a job: the worker keeps its jobs, its
loaded model and its place, and every write waits (the tenacity policy in `stream_writer.retrying`, the
dequeue and registration in `rq_worker.py`) until memory frees. One object per process, shared by every
thread that writes, so the condition is logged once when it starts and once when it ends (not once per
refused write), and the worker's stats and metrics can say it (`redis_full`, `redis_oom_refusals`).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class FullRedis:
    """Whether Redis is refusing this process's writes for want of memory, since when, and how often."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic time of the first refusal in a row
        self.refusals = 0  # OOM replies seen over the process's life

    @property
    def full(self) -> bool:
        return self._since is not None

    def refused(self, error: BaseException, doing: str) -> None:
        """An OOM reply to `doing`: the first in a row is logged as an error, the rest are counted."""
        with self._lock:
            self.refusals += 1
            if self._since is not None:
                return
            self._since = time.monotonic()
        log.error(
            "redis is full: writes refused (OOM), jobs kept, waiting for memory to free doing=%s error=%s",
            doing,
            error,
        )

    def accepted(self) -> None:
        """A write went through: if Redis was full, say for how long."""
        if self._since is None:
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning("redis accepts writes again after=%.1fs", time.monotonic() - since)

    def fields(self) -> dict[str, int]:
        """For the worker's stats hash and metrics."""
        return {"redis_full": int(self.full), "redis_oom_refusals": self.refusals}
