"""Score jobs' stream openings and endings, a batch's in one server-side script call.

A score job writes its stream once, when it ends: its attempt count (in the job's meta), a `restart`
entry where an earlier attempt wrote the stream, its result key, then its `done` entry and the
stream's TTL. `StreamWriter.open` and `finish_streams` do this for any job in two round trips (the
stream's last entry is read first, to place new entry ids after it and to see whether to announce a
restart) with ~45 arguments a one-row job for the client to pack. `FINISH_SCORES` does the same for a
batch of score jobs inside Redis, with four arguments a job: its meta, its `restart` and `done`
fields (each one JSON array, in field order) and its result. Entry ids are chosen as `StreamWriter`
chooses them: now in milliseconds, or just after the stream's last id where the clock has not passed
it. Every key is passed in KEYS; the commands are the worker ACL user's (`MGET`, not `GET`).

A call sent again after its reply was lost finds, for each job, its own `done` at the stream's end and
its own result stored, and writes nothing for that job: no second `restart` and `done` pair.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.jobs.schema import RestartEvent
from mlxq.worker.server_script import UNPACKED_LUA, ServerScript, packed
from mlxq.worker.stream_writer import StreamOptions, retrying

# KEYS per job: its hash, its stream, its result key. ARGV: now (ms), the streams' MAXLEN, the streams'
# TTL, the results' TTL; per job one argument of its values (`server_script.packed`): its meta, its
# `restart` fields and its `done` fields (JSON arrays of field, value, ...), its result. Returns how
# many jobs it wrote (the others were written already).
_FINISH_SCORES = (
    UNPACKED_LUA
    + """
local now, maxlen, ttl, result_ttl = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
local written = 0
for i = 1, #KEYS / 3 do
  local job, stream, result = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local v = unpacked(ARGV[4 + i])
  local meta, restart, done, payload = v[1], v[2], v[3], v[4]
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  local ms, seq, again = 0, 0, false
  if #last > 0 then
    local id, fields = last[1][1], last[1][2]
    local dash = string.find(id, '-', 1, true)
    ms, seq = tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
    local event = nil
    for k = 1, #fields, 2 do
      if fields[k] == 'event' then event = fields[k + 1] end
    end
    again = event == 'done' and redis.call('MGET', result)[1] == payload
  end
  if not again then
    redis.call('HSET', job, 'meta', meta)
    local entries = {}
    if #last > 0 then entries[1] = cjson.decode(restart) end
    entries[#entries + 1] = cjson.decode(done)
    redis.call('SET', result, payload, 'EX', result_ttl)
    for _, fields in ipairs(entries) do
      if now > ms then ms, seq = now, 0 else seq = seq + 1 end
      redis.call('XADD', stream, 'MAXLEN', '~', maxlen, string.format('%d-%d', ms, seq), unpack(fields))
    end
    redis.call('EXPIRE', stream, ttl)
    written = written + 1
  end
end
return written
"""
)

FINISH_SCORES = ServerScript(_FINISH_SCORES)

# A job, its attempt, its result as JSON-ready data (`model_dump(mode="json")`, as RQ's end keeps it too)
# and its `done` entry's fields.
ScoreFinal = tuple[Job, int, Any, dict[str, str]]


def finish_score_streams(
    conn: redis.Redis, finals: Sequence[ScoreFinal], options: StreamOptions
) -> list[str]:
    """Write each score job's meta, its stream's `restart` (where an earlier attempt wrote it), result
    and `done`, and the stream's TTL: one script call for the batch, retried as every write is.
    Returns each result's JSON text as written (RQ's JSON serializer makes the same of it)."""
    if not finals:
        return []
    names: list[str] = []
    texts: list[str] = []
    args: list[Any] = [0, options.maxlen, options.ttl_s, options.result_ttl_s]
    for job, attempt, value, done in finals:
        names += [job.key, keys.stream_key(job.id), keys.result_key(job.id)]
        text = json.dumps(value)
        texts.append(text)
        args.append(packed([_meta_text(job), _restart(attempt), _flat(done), text.encode()]))

    def send() -> None:
        args[0] = int(time.time() * 1000)
        conn.evalsha(FINISH_SCORES.sha, len(names), *names, *args)

    retrying(options)(FINISH_SCORES.run, conn, send)
    return texts


def _meta_text(job: Job) -> bytes:
    """The job's meta as `job.save_meta()` writes it; a meta of one count (a score job's attempt, as
    mostly) from a memory of that text, where the serializer is RQ's JSON one."""
    meta = job.meta
    if len(meta) == 1 and job.serializer is JSONSerializer:
        ((name, value),) = meta.items()
        if type(name) is str and type(value) is int:
            return _one_count(name, value)
    return bytes(job.serializer.dumps(meta))


@lru_cache(maxsize=64)
def _one_count(name: str, value: int) -> bytes:
    return json.dumps({name: value}).encode()  # what RQ's `JSONSerializer.dumps` makes of it


@lru_cache(maxsize=64)
def _restart(attempt: int) -> bytes:
    """A `restart` entry's fields, flat (`_flat`): the same few attempts again and again."""
    return _flat(RestartEvent(attempt=attempt).fields())


def _flat(fields: dict[str, str]) -> bytes:
    """An entry's fields as one JSON array: field, value, field, value (the script keeps the order)."""
    return _flat_items(tuple(fields.items()))


@lru_cache(maxsize=256)
def _flat_items(items: tuple[tuple[str, str], ...]) -> bytes:
    """`_flat` of fields that come back again and again (a batch's `done` entries mostly differ only by
    a few token counts, often not at all)."""
    return json.dumps([x for pair in items for x in pair]).encode()
