"""Whether the worker's Redis may evict mlxq's keys: read at start and again with RQ's maintenance.

An evicting policy loses jobs without an error anywhere (`jobs.redis_memory` says which keys each
policy may take), so the worker says so loudly in its log at start, again whenever the policy changes
(`CONFIG SET` on a live server, a failover to a differently configured replica), and again every
`repeat_s` while it stays evicting, so a log read days later still shows it. The reading is one
`INFO memory` round trip, at most once per `every_s`.
"""

from __future__ import annotations

import logging
import time

import redis

from mlxq.jobs.redis_memory import MemoryPolicy, read_policy
from mlxq.jobs.transient import WORKER_TRANSIENT_ERRORS

log = logging.getLogger(__name__)


class EvictionWatch:
    """Reads the Redis's `maxmemory-policy` now and then; warns when it can evict mlxq's keys."""

    def __init__(self, conn: redis.Redis, every_s: float = 30.0, repeat_s: float = 600.0) -> None:
        self.conn = conn
        self.every_s = every_s
        self.repeat_s = repeat_s
        self.latest: MemoryPolicy | None = None
        self._read_at = -1e9  # monotonic time of the last reading
        self._said_at = -1e9  # of the last warning

    def check(self, force: bool = False) -> MemoryPolicy | None:
        """Read the policy if due (or `force`), warn if it evicts; a Redis that is away is skipped."""
        now = time.monotonic()
        if not force and now - self._read_at < self.every_s:
            return self.latest
        self._read_at = now
        try:
            reading = read_policy(self.conn)
        except WORKER_TRANSIENT_ERRORS as e:
            log.debug("maxmemory-policy not read error=%s", e)
            return self.latest
        changed = self.latest is None or reading.policy != self.latest.policy
        self.latest = reading
        if reading.evicts and (changed or now - self._said_at >= self.repeat_s):
            self._said_at = now
            log.warning("REDIS MAY LOSE JOBS: %s", reading.warning())
        elif reading.unknown and changed:
            log.info("%s", reading.unknown_note())
        elif changed and self._said_at > 0:
            log.warning("redis maxmemory-policy is now %s", reading.policy)
        return reading

    def fields(self) -> dict[str, str]:
        """For the worker's stats hash (`mlxq status` shows what each worker sees)."""
        policy = self.latest.policy if self.latest is not None else None
        return {"redis_maxmemory_policy": policy or "unknown"}
