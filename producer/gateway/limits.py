"""Each API key's jobs in flight, counted in Redis so that every gateway instance sees the same count.

`mlxq:gw:inflight:<key digest>` is a sorted set of the key's job ids (scored by submit time). A submit
adds its ids and counts the set in the same script that enqueues its jobs (`submission`); over the
limit, the script writes nothing, the ids whose job has ended (or expired) are taken out here
(`clear_ended`: RQ's status of each job, and its result, which the worker writes with the stream's
`done` a moment before RQ marks the job finished), and the script runs once more; still over, the
request is refused.
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

KEY_TTL_S = 7 * 86_400
"""A key that submits nothing for this long has its set dropped (all its jobs have long ended)."""

ENQUEUE_GRACE_S = 30.0
"""An id claimed this recently with no job hash yet is being enqueued, not gone."""


def inflight_key(key_digest: str) -> str:
    return INFLIGHT_PREFIX + key_digest


async def clear_ended(conn: redis.asyncio.Redis, key_digest: str) -> None:
    """Take the key's ended jobs out of its count (a few Redis reads per job in flight: only at the limit)."""
    key = inflight_key(key_digest)
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
        if (r or rq_wire.decode_status(s) in ENDED) and not (s is None and not r and i in young)
    ]
    if ended:
        await conn.zrem(key, *ended)
