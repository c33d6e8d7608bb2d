"""RQ's job format on the wire: the one place that knows which hash fields make an RQ job.

Both clients enqueue through here (the async client cannot call RQ, which is sync): `build_job` makes
the fields of `rq:job:<id>` and `queue_commands` queues the writes (HSET, push, SADD) on a transaction;
`LUA_ENQUEUE` and `lua_args` make the same writes from inside a Lua script, for a caller that does more
in the same atomic step (the gateway's claim on a key's jobs in flight).
The fields are those `rq.Queue.enqueue` writes with `JSONSerializer`, less RQ's empty placeholders and
with `timeout` only when one was asked for (the worker applies its own default otherwise); a test checks
the two stay equivalent. `docs/plain-redis.md` shows the minimal subset a non-Python producer needs.

Reading back goes through RQ's own code where RQ has it (`Result.restore` for a failure's text).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

import redis
from redis import Redis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline
from rq import Retry
from rq.job import JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from mlxq.jobs import keys

from .tenant import SHARED, Tenant

DESCRIPTION_MAX_CHARS = 200
"""RQ puts the whole call in `description`; a long prompt would be stored twice, so it is cut."""


AnyPipeline = Pipeline | AsyncPipeline
"""A sync or asyncio pipeline; after MULTI both only buffer commands, so one function serves both."""


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8")  # byte for byte what rq.serializers.JSONSerializer writes


@dataclass(frozen=True)
class JobOptions:
    """RQ's per-job options that mlxq passes through. None leaves RQ's (or the worker's) default."""

    job_timeout: int | None = None
    result_ttl: int | None = None
    failure_ttl: int | None = None
    retry: Retry | None = None
    at_front: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WireJob:
    """One RQ job ready to write: its id, its queue and the fields of its hash."""

    id: str
    queue: str
    fields: dict[str, str | bytes]
    at_front: bool = False

    @property
    def key(self) -> str:
        return keys.rq_job_key(self.id)

    @property
    def queue_key(self) -> str:
        return keys.rq_queue_key(self.queue)


def job_data(func_name: str, payload: dict[str, Any], *, compress: bool = True) -> bytes:
    """RQ's `data` field: the JSON of `[func_name, instance, args, kwargs]`, zlib-compressed as RQ writes it.

    RQ also reads it uncompressed (it falls back to the raw bytes), which is what plain-Redis producers send.
    """
    raw = _json_bytes([func_name, None, [payload], {}])
    return zlib.compress(raw) if compress else raw


def _description(func_name: str, payload: dict[str, Any]) -> str:
    """RQ's `description`, the call as text, cut at `DESCRIPTION_MAX_CHARS`: the payload's JSON is
    encoded only as far as the cut (a bulk score job's payload can be most of a megabyte)."""
    room = DESCRIPTION_MAX_CHARS - len(func_name) - 2
    head, n = [], 0
    for chunk in json.JSONEncoder(ensure_ascii=False).iterencode(payload):
        head.append(chunk)
        n += len(chunk)
        if n > room:
            break
    call = f"{func_name}({''.join(head)})"
    if len(call) <= DESCRIPTION_MAX_CHARS:
        return call
    return call[: DESCRIPTION_MAX_CHARS - 4] + "...)"


def _option_fields(options: JobOptions) -> dict[str, str | bytes]:
    out: dict[str, str | bytes] = {}
    if options.job_timeout is not None:
        out["timeout"] = str(options.job_timeout)
    if options.result_ttl is not None:
        out["result_ttl"] = str(options.result_ttl)
    if options.failure_ttl is not None:
        out["failure_ttl"] = str(options.failure_ttl)
    if options.retry is not None:
        out["retries_left"] = str(options.retry.max)
        out["retry_intervals"] = json.dumps(options.retry.intervals)
        if options.retry.enqueue_at_front:
            out["enqueue_at_front_on_retry"] = "1"
    if options.meta:
        out["meta"] = _json_bytes(options.meta)
    return out


def build_job(
    func_name: str,
    payload: dict[str, Any],
    *,
    queue: str,
    options: JobOptions | None = None,
    job_id: str | None = None,
    at: datetime | None = None,
    tenant: Tenant = SHARED,
) -> WireJob:
    """The RQ job hash for `func_name(payload)` on `queue`, as `Queue.enqueue` would write it; the queue
    and the job id (a fresh one unless given) are `tenant`'s."""
    if func_name not in keys.JOB_FUNCS:
        raise ValueError(f"{func_name!r} is not an mlxq job function; use one of {sorted(keys.JOB_FUNCS)}")
    options = options or JobOptions()
    queue = tenant.queue(queue)
    stamp = utcformat(at or now())
    fields: dict[str, str | bytes] = {
        "data": job_data(func_name, payload),
        "description": _description(func_name, payload),
        "origin": queue,
        "status": JobStatus.QUEUED.value,
        "created_at": stamp,
        "enqueued_at": stamp,
        **_option_fields(options),
    }
    return WireJob(id=tenant.job_id(job_id), queue=queue, fields=fields, at_front=options.at_front)


def queue_commands(pipe: AnyPipeline, job: WireJob) -> None:
    """Buffer the enqueue on `pipe` (inside MULTI): save the hash, push the id, register the queue."""
    fields: dict[Any, Any] = dict(job.fields)
    pipe.hset(job.key, mapping=fields)
    if job.at_front:
        pipe.lpush(job.queue_key, job.id)
    else:
        pipe.rpush(job.queue_key, job.id)
    pipe.sadd(keys.RQ_QUEUES_SET, job.queue_key)


LUA_ENQUEUE = """
local function enqueue(job_key, queue_key, queues_key, args, at)
  -- args from `lua_args` from position `at`: id, at_front, field count, then field, value pairs
  local id, front, n = args[at], args[at + 1], tonumber(args[at + 2])
  if redis.call('EXISTS', job_key) == 0 then  -- a retried call whose first try got through: once only
    redis.call('HSET', job_key, unpack(args, at + 3, at + 2 + 2 * n))
    redis.call(front == '1' and 'LPUSH' or 'RPUSH', queue_key, id)
    redis.call('SADD', queues_key, queue_key)
  end
  return at + 3 + 2 * n
end
"""
"""A Lua function making `queue_commands`' writes for one job (skipped if its hash exists already):
KEYS are the job's hash, its queue and `rq:queues`; the arguments are `lua_args(job)` from `at`; it
returns the position after them."""


def lua_args(job: WireJob) -> list[str | bytes]:
    """`LUA_ENQUEUE`'s arguments for `job`."""
    flat: list[str | bytes] = [job.id, "1" if job.at_front else "0", str(len(job.fields))]
    for name, value in job.fields.items():
        flat.extend((name, value))
    return flat


def results_key(job_id: str) -> str:
    """RQ's stream of execution results for a job (RQ's own naming)."""
    return cast(str, Result.get_key(job_id))  # type: ignore[no-untyped-call]


def status_after(error: redis.ResponseError) -> str:
    """`missing` (no job hash) after a WRONGTYPE reply to reading a job's status: the key holds no RQ
    job (a worker puts such an id aside); any other reply error is raised again."""
    if not str(error).startswith("WRONGTYPE"):
        raise error
    return "missing"


def decode_status(raw: bytes | str | None) -> str:
    """RQ's status value from `HGET rq:job:<id> status`, or "missing" when the job hash is gone."""
    if raw is None:
        return "missing"
    return raw.decode() if isinstance(raw, bytes) else raw


def latest_result(job_id: str, entries: list[Any] | None) -> Result | None:
    """RQ's latest `Result` from the reply of `XREVRANGE rq:results:<id> + - COUNT 1`, decoded by RQ."""
    if not entries:
        return None
    entry_id, payload = entries[0]
    entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    # Result.restore only keeps the connection for later calls we never make; it decodes offline.
    return Result.restore(job_id, entry_id, payload, connection=cast(Redis, None), serializer=JSONSerializer)


def failure_text(result: Result | None) -> str | None:
    """The exception text RQ recorded for a failed or stopped execution, if the latest result is one."""
    if result is None or result.type not in (Result.Type.FAILED, Result.Type.STOPPED):
        return None
    return result.exc_string or None


def return_value(result: Result | None) -> dict[str, Any] | None:
    """The job's result as RQ stored it (its return value), when the latest execution returned one."""
    if result is None or not isinstance(result.return_value, dict):
        return None
    return result.return_value
