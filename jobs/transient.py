"""Which Redis errors are worth another try, for producers and workers alike.

Both sides retry a Redis that is away for a while (a restart, a dropped connection, a failover) and a
demoted primary's READONLY reply (the primary a client still talks to became a replica in a failover:
the next connection finds the new one). A full Redis (`maxmemory` reached under `noeviction`, an OOM
reply) differs by side: a worker waits for memory to free (its running jobs and loaded model are worth
keeping), while a producer is told at once (`redis.exceptions.OutOfMemoryError`): its caller decides
whether to wait, shed load or report.
"""

from __future__ import annotations

import redis
from redis.exceptions import OutOfMemoryError, ReadOnlyError

TRANSIENT_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError, ReadOnlyError)
"""Redis restarting, a dropped connection, a failover (BusyLoadingError is a ConnectionError too, and a
demoted primary answers writes with READONLY until the client reconnects to the new one)."""

WORKER_TRANSIENT_ERRORS: tuple[type[Exception], ...] = (*TRANSIENT_ERRORS, OutOfMemoryError)
"""What a worker rides out: the above, and a full Redis (OOM replies) that frees memory later."""


def is_transient(e: BaseException) -> bool:
    """Worth another try: a `TRANSIENT_ERRORS` error, or the ValueError ("I/O operation on closed file")
    redis-py raises when Redis drops the connection while a thread is reading from it and the
    connection's buffer was closed under it (seen when Redis restarts under a multi-threaded bulk run;
    a long-known redis-py behaviour, its issues #633 and #947)."""
    return isinstance(e, TRANSIENT_ERRORS) or (isinstance(e, ValueError) and "closed file" in str(e))


def is_worker_transient(e: BaseException) -> bool:
    """`is_transient`, or Redis out of memory: a worker waits rather than failing its jobs."""
    return is_transient(e) or isinstance(e, OutOfMemoryError)


def is_out_of_memory(e: BaseException) -> bool:
    """An OOM reply: Redis reached `maxmemory` and refuses writes (`noeviction`)."""
    return isinstance(e, OutOfMemoryError)
