"""Waiting until replicas hold what was written: Redis replicates after it replies, so a primary that
fails over (or shuts down) just after a write can take that write with it. Used by producers (a submit
returns once a replica holds the job) and workers (a job's streams, results and RQ records), by
default when they reach Redis through Sentinel, where a replica is there to fail over to.

WAIT counts the replicas that acknowledged the last write of the connection it is sent on, and a pool
may hand out another connection than the one that wrote: so a mark key is written and WAIT sent on one
connection, in one pipeline. The mark comes after the earlier writes in Redis's replication stream,
so a replica that has the mark has them too. A shortfall raises `NotReplicated`, a connection error:
the caller writes again (its writes are idempotent, as after a lost reply), reaching the new primary
once the sentinels have switched. When its retries end short (after a failover the new primary may
have no replica in sync for a while), a producer's submit stands with a warning, as a worker's writes
do: the job is on the primary.
"""

from __future__ import annotations

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

from mlxq.jobs import keys

_MARK_TTL_MS = 60_000  # the mark is only ever written, never read: it need not last


class NotReplicated(redis.ConnectionError):
    """No replica confirmed the writes in time: the primary may be failing over; write again."""


def unreplicated_warning(job_id: str, error: NotReplicated) -> str:
    """What a producer says when its retries end without a replica's confirmation: the job is on the
    primary (each try wrote it, or found it there), so the submit stands; only a failover before a replica
    copies it could lose it. Raising instead would invite a second submission of the same work."""
    return (
        f"job {job_id} is enqueued but no replica confirmed it ({error}); it is on the primary, and a "
        "failover before a replica copies it could lose it"
    )


def default_replica_acks(conn: redis.Redis | redis.asyncio.Redis) -> int:
    """1 through Sentinel (a replica to fail over to, and one to lose a write to), else 0 (no WAIT)."""
    pools = (redis.sentinel.SentinelConnectionPool, redis.asyncio.sentinel.SentinelConnectionPool)
    return 1 if isinstance(conn.connection_pool, pools) else 0


def confirm_replicated(conn: redis.Redis, wanted: int, timeout_ms: int) -> None:
    """Return once `wanted` replicas hold everything written before; `NotReplicated` if not in time."""
    if wanted <= 0:
        return
    pipe = conn.pipeline(transaction=False)
    pipe.set(keys.REPLICATION_MARK, b"1", px=_MARK_TTL_MS)
    pipe.wait(wanted, timeout_ms)
    _, acked = pipe.execute()
    if int(acked) < wanted:
        raise NotReplicated(f"{acked} of {wanted} replica(s) confirmed the writes within {timeout_ms} ms")


async def aconfirm_replicated(conn: redis.asyncio.Redis, wanted: int, timeout_ms: int) -> None:
    """`confirm_replicated` on an asyncio client."""
    if wanted <= 0:
        return
    pipe = conn.pipeline(transaction=False)
    pipe.set(keys.REPLICATION_MARK, b"1", px=_MARK_TTL_MS)
    pipe.wait(wanted, timeout_ms)
    _, acked = await pipe.execute()
    if int(acked) < wanted:
        raise NotReplicated(f"{acked} of {wanted} replica(s) confirmed the writes within {timeout_ms} ms")
