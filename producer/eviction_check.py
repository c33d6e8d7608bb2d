"""The producer's look at Redis's memory policy: once per client, before its first submit.

An evicting Redis (`maxmemory-policy` other than `noeviction`) drops submitted jobs without an error
(`jobs.redis_memory` says which keys each policy takes), so a client says so once, as a logging
warning on the `producer` logger, not a Python `warnings.warn`: it is a fact about the server that an
operator must fix, not about the calling code, and `warnings.warn` would turn into an exception in an
application run with warnings as errors. A Redis that cannot be asked (its user may run neither INFO
nor CONFIG) is noted once at INFO level; a connection error leaves the look to the next submit.
"""

from __future__ import annotations

import logging

import redis
import redis.asyncio

from mlxq.jobs.redis_memory import MemoryPolicy, aread_policy, read_policy

log = logging.getLogger("mlxq.producer")


class EvictionCheck:
    """Whether this client has looked at its Redis's memory policy yet, and the reading it got."""

    def __init__(self) -> None:
        self.reading: MemoryPolicy | None = None

    def run(self, conn: redis.Redis) -> None:
        """Look once (sync client); never raises."""
        if self.reading is not None:
            return
        try:
            self._say(read_policy(conn))
        except redis.RedisError as e:
            log.debug("maxmemory-policy not read; next submit tries again error=%s", e)

    async def arun(self, conn: redis.asyncio.Redis) -> None:
        """Look once (asyncio client); never raises."""
        if self.reading is not None:
            return
        try:
            self._say(await aread_policy(conn))
        except redis.RedisError as e:
            log.debug("maxmemory-policy not read; next submit tries again error=%s", e)

    def _say(self, reading: MemoryPolicy) -> None:
        self.reading = reading
        warning = reading.warning()
        if warning is not None:
            log.warning("REDIS MAY LOSE JOBS: %s", warning)
        elif reading.unknown:
            log.info("%s", reading.unknown_note())
