"""OpenAI's Batch API over mlxq's bulk runs: a batch's record, its checked input, its output files.

Creating a batch checks the input file as OpenAI does (JSONL lines `{custom_id, method, url, body}`,
unique custom ids, one endpoint, one model, at most `max_batch_lines`) and turns each request into an
mlxq generation row with the same rules as the online endpoints (`translate`): a request mlxq cannot
run (`n: 2`, tools) becomes a line of the error file, never a silently different request. The rows go
to `<data_dir>/batches/<id>/rows.jsonl`, which a bulk run (`producer.bulk`) works through, writing
`out.jsonl` and `errors.jsonl` beside it; a bulk run resumes from those files, which is how a batch
survives its gateway: see `batch_runner`. The record `mlxq:gw:batch:<id>` holds OpenAI's batch object
fields, the queue, the owner; `mlxq:gw:batches:active` the ids still to finish; `mlxq:gw:batches:owner:<key
digest>` each key's batches by creation time (`GET /v1/batches`, newest first).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio

from mlxq.jobs.schema import GenerateResult

from .. import payload
from . import echo
from .errors import ApiError, bad_request, unsupported
from .shapes import Context
from .translate import Kind, Translated, chat, completion

BATCH_PREFIX = "mlxq:gw:batch:"
ACTIVE_KEY = "mlxq:gw:batches:active"
OWNER_PREFIX = "mlxq:gw:batches:owner:"  # a key's batches, scored by creation time (for the list)
ENDPOINTS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def record_key(batch_id: str) -> str:
    return BATCH_PREFIX + batch_id


def owner_key(key_digest: str) -> str:
    return OWNER_PREFIX + key_digest


def folder(data_dir: Path, batch_id: str) -> Path:
    if not batch_id.startswith("batch_") or "/" in batch_id:
        raise ValueError(f"not a batch id: {batch_id!r}")
    return data_dir / "batches" / batch_id


@dataclass(frozen=True)
class Checked:
    """An input file, checked: its model, its rows (custom_id + mlxq request), its refused lines."""

    model: str
    rows: list[dict[str, Any]]
    refused: list[dict[str, Any]]  # OpenAI error-file lines

    @property
    def total(self) -> int:
        return len(self.rows) + len(self.refused)


def _lines(content: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"line {number} of the input file is not JSON: {e}", "input_file_id") from None
        if not isinstance(line, dict):
            raise bad_request(f"line {number} of the input file is not a JSON object", "input_file_id")
        yield number, line


def check(content: bytes, endpoint: str, max_lines: int) -> Checked:
    """The input file's requests as mlxq rows; a 400 naming the line for what OpenAI also refuses."""
    kind = ENDPOINTS[endpoint]
    rows: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    seen: set[str] = set()
    model: str | None = None
    for number, line in _lines(content):
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise bad_request(f"line {number}: `custom_id` must be a non-empty string", "input_file_id")
        if custom_id in seen:
            raise bad_request(f"line {number}: custom_id {custom_id!r} appears twice", "input_file_id")
        seen.add(custom_id)
        if line.get("method", "POST") != "POST" or line.get("url") != endpoint:
            raise bad_request(
                f"line {number}: every request must be POST {endpoint} (the batch's endpoint), "
                f"got {line.get('method')} {line.get('url')}",
                "input_file_id",
            )
        body = line.get("body")
        if not isinstance(body, dict):
            raise bad_request(f"line {number}: `body` must be a JSON object", "input_file_id")
        if model is None:
            model = body.get("model")
        elif body.get("model") != model:
            raise bad_request(
                f"line {number}: model {body.get('model')!r} differs from the batch's {model!r} "
                "(a batch is for one model)",
                "input_file_id",
            )
        if len(seen) > max_lines:
            raise bad_request(f"the input file has more than {max_lines} requests", "input_file_id")
        try:
            if kind == "completion" and echo.wanted(body):
                raise unsupported("echo", "not in a batch request")
            t: Translated = chat(body) if kind == "chat" else completion(body)
            if t.stream:
                raise bad_request("`stream` is not allowed in a batch request", "stream")
            if t.n > 1:
                raise unsupported("n", "a batch request yields one choice: give each its own line")
            if t.more:
                raise unsupported("prompt", "a batch request takes one prompt: give each its own line")
            # `logprobs` of the generated tokens: the job reports them, and the output line carries them
        except ApiError as e:
            refused.append(error_line(custom_id, e.status, e.body()["error"]))
            continue
        rows.append({"custom_id": custom_id, **payload.wire_payload(t.request)})
    if model is None or not isinstance(model, str):
        raise bad_request("the input file holds no request with a `model`", "input_file_id")
    return Checked(model, rows, refused)


def error_line(custom_id: str | None, status: int, error: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": "", "body": {"error": error}},
        "error": None,
    }


def batch_usage(records: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's `usage` of a batch: the tokens of its completed requests (bulk output records,
    `{custom_id, **GenerateResult}`), summed; a failed request adds none."""
    prompt = sum(int(r["usage"]["prompt_tokens"]) for r in records)
    cached = sum(int(r["usage"].get("cached_tokens", 0)) for r in records)
    completion = sum(int(r["usage"]["completion_tokens"]) for r in records)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def output_line(
    kind: Kind, model: str, owner: str, record: dict[str, Any], prompt_chars: int = 0
) -> dict[str, Any]:
    """A bulk output record (`{custom_id, **GenerateResult}`) as an OpenAI batch output line;
    `prompt_chars`: its text prompt's characters, where a completion's `text_offset`s start."""
    custom_id = record.pop("custom_id")
    request_id = uuid.uuid4().hex
    chars = (prompt_chars,) if prompt_chars else ()
    ctx = Context(kind, request_id, model, int(time.time()), False, owner, prompt_chars=chars)
    body = ctx.whole([GenerateResult.model_validate(record)])
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def failed_line(record: dict[str, Any]) -> dict[str, Any]:
    """A bulk errors record (`{custom_id, line, error}`) as an OpenAI error-file line."""
    return error_line(
        record.get("custom_id"),
        500,
        {
            "message": str(record.get("error", "")),
            "type": "server_error",
            "param": None,
            "code": "job_failed",
        },
    )


MAX_METADATA = 16


def check_metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's `metadata`: at most 16 pairs of strings, keys up to 64 characters, values up to 512."""
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in value.items()
        )
    ):
        raise bad_request(
            f"`metadata` must map at most {MAX_METADATA} keys (up to 64 characters) to strings (up to 512)",
            "metadata",
        )
    return value


def new_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class BatchRecords:
    """The batch records in Redis (all instances read and write the same)."""

    def __init__(self, conn: redis.asyncio.Redis) -> None:
        self.conn = conn

    async def create(self, fields: dict[str, str]) -> None:
        async with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(record_key(fields["id"]), mapping=fields)  # type: ignore[arg-type]
            pipe.sadd(ACTIVE_KEY, fields["id"])
            pipe.zadd(owner_key(fields["owner"]), {fields["id"]: time.time()})
            await pipe.execute()

    async def page(self, owner: str, limit: int, after: str | None) -> tuple[list[dict[str, str]], bool]:
        """An owner's batches, newest first, from the one after `after` (None: the newest): at most
        `limit` records, and whether more follow."""
        index = owner_key(owner)
        start = 0
        if after is not None:
            rank: Any = await self.conn.zrevrank(index, after)
            if rank is None:
                raise KeyError(after)
            start = int(rank) + 1
        members: list[Any] = list(await self.conn.zrevrange(index, start, start + limit))
        ids = [str(i.decode() if isinstance(i, bytes) else i) for i in members]
        records = [await self.get(i) for i in ids[:limit]]
        return [r for r in records if r is not None], len(ids) > limit

    async def get(self, batch_id: str) -> dict[str, str] | None:
        raw = await self.conn.hgetall(record_key(batch_id))
        if not raw:
            return None
        return {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }

    async def update(self, batch_id: str, **fields: str) -> None:
        await self.conn.hset(record_key(batch_id), mapping=fields)  # type: ignore[arg-type]

    async def finish(self, batch_id: str, **fields: str) -> None:
        async with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(record_key(batch_id), mapping=fields)  # type: ignore[arg-type]
            pipe.srem(ACTIVE_KEY, batch_id)
            await pipe.execute()

    async def active(self) -> list[str]:
        return sorted(i.decode() if isinstance(i, bytes) else i for i in await self.conn.smembers(ACTIVE_KEY))


def openai_batch(fields: dict[str, str], counts: dict[str, int] | None = None) -> dict[str, Any]:
    """The batch object OpenAI's API returns, from a record (and live counts while it runs)."""
    times = {t: (int(fields[t]) if fields.get(t) else None) for t in TIMES}
    stored = json.loads(fields.get("request_counts") or "null")
    errors = json.loads(fields["errors"]) if fields.get("errors") else None
    return {
        "id": fields["id"],
        "object": "batch",
        "endpoint": fields["endpoint"],
        "model": fields.get("model") or None,
        "errors": errors,
        "input_file_id": fields["input_file_id"],
        "completion_window": fields["completion_window"],
        "status": fields["status"],
        "output_file_id": fields.get("output_file_id") or None,
        "error_file_id": fields.get("error_file_id") or None,
        **times,
        "request_counts": counts
        or stored
        or {"total": int(fields.get("total", 0)), "completed": 0, "failed": 0},
        "metadata": json.loads(fields.get("metadata") or "null"),
        "usage": json.loads(fields.get("usage") or "null"),  # once the batch is done
    }


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.endswith(b"\n"))
