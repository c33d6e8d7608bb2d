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

How many replicas: every replica the primary lists online, never fewer than the setting (`Replicas`,
`ReplicaSet`). One would not do: in a `SENTINEL FAILOVER` with the old primary still up, the sentinels
promote one replica while the old primary keeps taking writes and feeding the other replica until it
is demoted, and then that replica follows the new primary too; a write acknowledged by it alone is
lost with it. Waiting for all of them turns that window into a shortfall; the replica that left the
list is then asked for its role, and while it says primary, writes here are not confirmed: they are
done again, reaching the new primary once the sentinels have switched. A replica that left because it
went down is forgotten (after one shortfall), so a replica outage costs one slow write, not all.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

from mlxq.jobs import keys

_MARK_TTL_MS = 60_000  # the mark is only ever written, never read: it need not last
_REFRESH_S = 1.0  # how long the primary's list of replicas is used before it is looked at again
_PROBE_TIMEOUT_S = 0.5  # asking a replica that left the list for its role


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


Address = tuple[str, int]


def online_replicas(info: Mapping[str, Any]) -> set[Address]:
    """The replicas a primary's `INFO replication` (as redis-py parses it) lists as online."""
    found = set()
    for key, value in info.items():
        if key.startswith("slave") and isinstance(value, Mapping) and value.get("state") == "online":
            found.add((str(value["ip"]), int(value["port"])))
    return found


class ReplicaSet:
    """Which replicas a write must reach, from what the primary reports (no I/O here): every replica
    it listed online when last looked at, never fewer than `floor`. A replica that has left the list
    is asked for its role by the caller: one that is a primary now means a failover is under way, and
    then nothing written to this primary counts as safe until the client reaches the new one."""

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self.replid: str | None = None
        self.known: set[Address] = set()
        self.until = 0.0  # when to look again

    def due(self) -> bool:
        return time.monotonic() >= self.until

    def look(self, info: Mapping[str, Any]) -> set[Address]:
        """Take the primary's report; the replicas that left the list since (to be asked their role)."""
        if info.get("role") != "master":
            raise NotReplicated("this server is no longer the primary (a failover is under way)")
        online = online_replicas(info)
        replid = str(info.get("master_replid"))
        if replid != self.replid:  # another primary (or this one's history was reset): start afresh
            self.replid, self.known = replid, set()
        gone = self.known - online
        self.known = self.known | online
        return gone

    def settle(self, gone: set[Address], promoted: set[Address]) -> None:
        """Forget the replicas that left and were not promoted (down, or moved elsewhere); a promoted
        one stays wanted, so writes here fall short until the client follows the failover."""
        if promoted:
            raise NotReplicated(
                f"replica {', '.join(f'{h}:{p}' for h, p in sorted(promoted))} is a primary now: "
                "a failover is under way"
            )
        self.known -= gone
        self.until = time.monotonic() + _REFRESH_S

    def wanted(self) -> int:
        return 0 if self.floor <= 0 else max(self.floor, len(self.known))

    def forget(self) -> None:
        self.until = 0.0


def _probe_kwargs(pool: Any) -> dict[str, Any]:
    """How to reach a replica directly: the pool's credentials and TLS, a short timeout."""
    kwargs = {
        k: v
        for k, v in pool.connection_kwargs.items()
        if k in ("username", "password") or (k.startswith("ssl") and k != "ssl")
    }
    tls = issubclass(pool.connection_class, (redis.SSLConnection, redis.asyncio.SSLConnection))
    return {
        **kwargs,
        "ssl": tls,
        "socket_timeout": _PROBE_TIMEOUT_S,
        "socket_connect_timeout": _PROBE_TIMEOUT_S,
    }


def _is_primary(role: Any) -> bool:
    first = role[0] if isinstance(role, list | tuple) and role else role
    return (first.decode() if isinstance(first, bytes) else str(first)) == "master"


class Replicas:
    """Waits until the replicas a write must reach hold it (`confirm`), on a sync client: every replica
    the primary lists online, at least `floor` (`MLXQ_REPLICA_ACKS`, by default `default_replica_acks`;
    0: no waiting). See the module's docstring for why one is not enough. A shortfall raises
    `NotReplicated`."""

    def __init__(self, conn: redis.Redis, floor: int, timeout_ms: int = 1000) -> None:
        self.conn = conn
        self.timeout_ms = timeout_ms
        self.set = ReplicaSet(floor)

    @property
    def floor(self) -> int:
        return self.set.floor

    def confirm(self) -> None:
        if self.set.floor <= 0:
            return
        try:
            if self.set.due():
                self._look()
            confirm_replicated(self.conn, self.set.wanted(), self.timeout_ms)
        except NotReplicated:
            self.set.forget()  # which replicas there are may have changed: look before the next try
            # Idle connections may still reach a primary being demoted: the next try connects afresh
            # (through Sentinel, to whichever primary the sentinels name now).
            self.conn.connection_pool.disconnect(inuse_connections=False)
            raise

    def _look(self) -> None:
        gone = self.set.look(self.conn.info("replication"))
        self.set.settle(gone, {addr for addr in gone if self._promoted(addr)})

    def _promoted(self, addr: Address) -> bool:
        probe = redis.Redis(host=addr[0], port=addr[1], **_probe_kwargs(self.conn.connection_pool))
        try:
            return _is_primary(probe.role())
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return False  # down or unreachable: not a primary anyone can reach
        finally:
            probe.close()


class AsyncReplicas:
    """`Replicas` on an asyncio client."""

    def __init__(self, conn: redis.asyncio.Redis, floor: int, timeout_ms: int = 1000) -> None:
        self.conn = conn
        self.timeout_ms = timeout_ms
        self.set = ReplicaSet(floor)

    @property
    def floor(self) -> int:
        return self.set.floor

    async def confirm(self) -> None:
        if self.set.floor <= 0:
            return
        try:
            if self.set.due():
                await self._look()
            await aconfirm_replicated(self.conn, self.set.wanted(), self.timeout_ms)
        except NotReplicated:
            self.set.forget()
            await self.conn.connection_pool.disconnect(inuse_connections=False)
            raise

    async def _look(self) -> None:
        gone = self.set.look(await self.conn.info("replication"))
        self.set.settle(gone, {addr for addr in gone if await self._promoted(addr)})

    async def _promoted(self, addr: Address) -> bool:
        probe = redis.asyncio.Redis(host=addr[0], port=addr[1], **_probe_kwargs(self.conn.connection_pool))
        try:
            return _is_primary(await probe.role())
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return False
        finally:
            await probe.aclose()


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
