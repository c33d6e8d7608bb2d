"""Each API key's jobs in flight, counted in Redis so that every gateway instance sees the same count.

`mlxq:gw:inflight:<key digest>` is a sorted set of the key's job ids (scored by submit time). A submit
adds its id and counts the set in one transaction; over the limit, the ids whose job has ended (or
expired) are taken out, by asking RQ each job's status and looking for its result (the worker writes
that with the stream's `done`, a moment before RQ marks the job finished), and if the count is still
over, the new id is taken back out and the request refused.
Nothing depends on a gateway seeing a job end: a client that hangs up, or a gateway that dies, leaves
ids that the next submit clears.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis.asyncio

from mlxq.jobs import keys

from .. import rq_wire
from ..job_state import ENDED

INFLIGHT_PREFIX = "mlxq:gw:inflight:"

KEY_TTL_S = 7 * 86_400
"""A key that submits nothing for this long has its set dropped (all its jobs have long ended)."""

ENQUEUE_GRACE_S = 30.0
"""An id claimed this recently with no job hash yet is being enqueued, not gone."""


def inflight_key(key_digest: str) -> str:
    return INFLIGHT_PREFIX + key_digest


async def _clear_ended(conn: redis.asyncio.Redis, key: str, keep: str) -> None:
    members: list[Any] = list(await conn.zrange(key, 0, -1, withscores=True))
    if not members:
        return
    ids = [str(i.decode() if isinstance(i, bytes) else i) for i, _ in members]
    young = {i for i, (_, at) in zip(ids, members, strict=True) if time.time() - float(at) < ENQUEUE_GRACE_S}
    async with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(keys.rq_job_key(job_id), "status")
            pipe.exists(keys.result_key(job_id))  # written with the `done` event, before RQ says finished
        replies = await pipe.execute()
    statuses, results = replies[0::2], replies[1::2]
    ended = [
        i
        for i, s, r in zip(ids, statuses, results, strict=True)
        if i != keep and (r or rq_wire.decode_status(s) in ENDED) and not (s is None and not r and i in young)
    ]
    if ended:
        await conn.zrem(key, *ended)


async def claim(
    conn: redis.asyncio.Redis,
    key_digest: str,
    job_id: str,
    limit: int,
    also: Callable[[Any], None] | None = None,
) -> int | None:
    """Count `job_id` against the key; None if that stays within `limit`, else how many are in flight.

    One round trip while the key is under its limit; only at the limit are the ended jobs looked for
    (so a key's cost per submit does not grow with its jobs in flight). `also` adds the caller's own
    commands to that round trip's transaction."""
    key = inflight_key(key_digest)
    count = await _add(conn, key, job_id, also)
    if count <= limit:
        return None
    await _clear_ended(conn, key, keep=job_id)
    count = int(await conn.zcard(key))
    if count > limit:
        await conn.zrem(key, job_id)
        return count - 1
    return None


async def _add(conn: redis.asyncio.Redis, key: str, job_id: str, also: Callable[[Any], None] | None) -> int:
    async with conn.pipeline(transaction=True) as pipe:
        pipe.zadd(key, {job_id: time.time()})
        pipe.zcard(key)
        pipe.expire(key, KEY_TTL_S)
        if also is not None:
            also(pipe)
        replies = await pipe.execute()
    return int(replies[1])


async def release(conn: redis.asyncio.Redis, key_digest: str, job_id: str) -> None:
    """Take a job that was never enqueued (or has ended) out of the count."""
    await conn.zrem(inflight_key(key_digest), job_id)
