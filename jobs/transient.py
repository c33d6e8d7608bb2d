"""Which Redis errors are worth another try, for producers and workers alike."""

from __future__ import annotations

import redis

TRANSIENT_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
"""Redis restarting, a dropped connection, a failover (BusyLoadingError is a ConnectionError too)."""


def is_transient(e: BaseException) -> bool:
    """Worth another try: a `TRANSIENT_ERRORS` error, or the ValueError ("I/O operation on closed file")
    redis-py raises when Redis drops the connection while a thread is reading from it and the
    connection's buffer was closed under it (seen when Redis restarts under a multi-threaded bulk run;
    a long-known redis-py behaviour, its issues #633 and #947)."""
    return isinstance(e, TRANSIENT_ERRORS) or (isinstance(e, ValueError) and "closed file" in str(e))
