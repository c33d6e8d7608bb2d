"""Each API key's jobs in flight, counted in Redis so that every gateway instance sees the same count.

`mlxq:gw:inflight:<key digest>` is a sorted set of the key's job ids (scored by submit time). Before a
submit, the ids whose job has ended (or expired) are taken out, by asking RQ each job's status; then the
new id is added and the set counted in one transaction, and taken back out if that is over the limit.
Nothing depends on a gateway seeing a job end: a client that hangs up, or a gateway that dies, leaves
ids that the next submit clears.
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio

from mlxq.jobs import keys

from .. import rq_wire
from ..job_state import ENDED

INFLIGHT_PREFIX = "mlxq:gw:inflight:"

ENQUEUE_GRACE_S = 30.0
"""An id claimed this recently with no job hash yet is being enqueued, not gone."""


def inflight_key(key_digest: str) -> str:
    return INFLIGHT_PREFIX + key_digest


async def _clear_ended(conn: redis.asyncio.Redis, key: str) -> None:
    members: list[Any] = list(await conn.zrange(key, 0, -1, withscores=True))
    if not members:
        return
    ids = [str(i.decode() if isinstance(i, bytes) else i) for i, _ in members]
    young = {i for i, (_, at) in zip(ids, members, strict=True) if time.time() - float(at) < ENQUEUE_GRACE_S}
    async with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(keys.rq_job_key(job_id), "status")
        statuses = await pipe.execute()
    ended = [
        i
        for i, s in zip(ids, statuses, strict=True)
        if rq_wire.decode_status(s) in ENDED and not (s is None and i in young)
    ]
    if ended:
        await conn.zrem(key, *ended)


async def claim(conn: redis.asyncio.Redis, key_digest: str, job_id: str, limit: int) -> int | None:
    """Count `job_id` against the key; None if that stays within `limit`, else how many are in flight."""
    key = inflight_key(key_digest)
    await _clear_ended(conn, key)
    async with conn.pipeline(transaction=True) as pipe:
        pipe.zadd(key, {job_id: time.time()})
        pipe.zcard(key)
        _, count = await pipe.execute()
    if count > limit:
        await conn.zrem(key, job_id)
        return int(count) - 1
    return None


async def release(conn: redis.asyncio.Redis, key_digest: str, job_id: str) -> None:
    """Take a job that was never enqueued (or has ended) out of the count."""
    await conn.zrem(inflight_key(key_digest), job_id)
