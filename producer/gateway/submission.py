"""A gateway submission in one Redis round trip: the API key's claim on its jobs in flight, the stream's
context and every choice's RQ job, written by one Lua script.

The script is atomic, so a claim over the key's limit writes nothing: no job is enqueued that the client
is told was refused, and no id is left counted. Only then are the key's ended jobs looked for
(`limits.clear_ended`) and the script run once more. The jobs are RQ's own (`rq_wire.LUA_ENQUEUE` makes
`rq_wire.queue_commands`' writes), so RQ, `rq info` and the workers see them as any other; a script tried
again after its reply was lost finds its first job there and writes nothing twice.
The gateway's Redis user needs `EVALSHA` (and `SCRIPT LOAD` once) on those keys, beside the commands the
script sends (deploy/redis/users.acl).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from redis.commands.core import AsyncScript

from mlxq.jobs import keys

from .. import rq_wire
from ..aio import AsyncClient
from . import limits

SCRIPT = (
    rq_wire.LUA_ENQUEUE
    + """
-- KEYS: the key's in-flight set, the context hash, rq:queues, then each job's hash and queue
-- ARGV: limit, now, in-flight TTL, context TTL, context field count, its fields, then each job's lua_args
if redis.call('EXISTS', KEYS[4]) == 1 then return -1 end  -- tried again after a lost reply: all is there
local limit, nctx = tonumber(ARGV[1]), tonumber(ARGV[5])
local first = 6 + 2 * nctx
local ids, at = {}, first
for j = 1, (#KEYS - 3) / 2 do
  ids[j] = ARGV[at]
  at = at + 3 + 2 * tonumber(ARGV[at + 2])
  redis.call('ZADD', KEYS[1], ARGV[2], ids[j])
end
local count = redis.call('ZCARD', KEYS[1])
if count > limit then
  redis.call('ZREM', KEYS[1], unpack(ids))
  return count - #ids
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if nctx > 0 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 6, 5 + 2 * nctx))
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
at = first
for j = 1, #ids do
  at = enqueue(KEYS[2 + 2 * j], KEYS[3 + 2 * j], KEYS[3], ARGV, at)
end
return -1
"""
)


class Submitter:
    """Writes submissions through `client` (its enqueue rules: retries, replicas, memory; `write_jobs`)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.script: AsyncScript = client.connection.register_script(SCRIPT)

    async def submit(
        self,
        key_digest: str,
        limit: int,
        jobs: Sequence[rq_wire.WireJob],
        context_key: str = "",
        context: Mapping[str, str] | None = None,
        context_ttl_s: int = 0,
    ) -> int | None:
        """Claim `jobs` for the key and enqueue them, with `context` written at `context_key`; None when
        done, else how many other jobs the key has in flight (over `limit`: nothing was written)."""
        inflight = limits.inflight_key(key_digest)  # without a context, its key's place holds this one
        script_keys: list[str] = [inflight, context_key or inflight, keys.RQ_QUEUES_SET]
        for job in jobs:
            script_keys.extend((job.key, job.queue_key))
        fields = [part for pair in (context or {}).items() for part in pair]
        head: list[str | bytes | int | float] = [limit, 0, limits.KEY_TTL_S, context_ttl_s, len(fields) // 2]
        args = head + fields + [part for job in jobs for part in rq_wire.lua_args(job)]

        async def write() -> int:
            args[1] = f"{time.time():.6f}"  # the claim's time: `clear_ended`'s grace counts from it
            return int(await self.script(keys=script_keys, args=args))

        busy = await self.client.write_jobs(jobs, write)
        if busy < 0:
            return None
        await limits.clear_ended(self.client.connection, key_digest)
        busy = await self.client.write_jobs(jobs, write)
        return None if busy < 0 else busy
