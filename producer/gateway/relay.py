"""A job's Redis stream as OpenAI's server-sent events, resumable from any gateway instance.

Each chunk carrying text is one SSE event whose `id` is the job stream's entry id; a client that
reconnects with `Last-Event-ID` gets the entries after it, read from Redis, so nothing is lost or sent
twice whichever instance it reaches. The end is three events: the finish chunk (id: the `done` entry's),
then the usage chunk if asked for and `[DONE]`, which carry no id (an SSE client keeps the last id it
saw), so a client that lost those resumes at the `done` entry and gets just them again.

A chunk is sent only for a token event with text (a token that ends inside a multi-byte character has
none yet; its text comes with the next). A job that fails ends the stream with OpenAI's error object
as data, which OpenAI's SDKs raise as an `APIError`. A `restart` entry (the job was retried after its
worker died) cannot be told to an OpenAI client, which never takes text back: after text was sent, the
stream ends with an error saying so; before, it is passed over.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio

from mlxq.jobs import keys
from mlxq.jobs.schema import DoneEvent, ErrorEvent, RestartEvent, TokenEvent

from ..aio import AsyncClient
from ..errors import JobFailed, JobNotFound
from ..sse import frame
from ..tail import START_ID, decode_entries
from .shapes import Context

DONE = "[DONE]"


def _data(body: dict[str, Any], event_id: str | None = None) -> str:
    return frame(json.dumps(body, ensure_ascii=False), event_id=event_id)


def _error(message: str, type: str = "job_failed") -> str:
    return _data({"error": {"message": message, "type": type, "param": None, "code": None}})


def _ending(ctx: Context, done: DoneEvent) -> list[str]:
    out = [_data(ctx.usage_chunk(done))] if ctx.include_usage else []
    return [*out, frame(DONE)]


async def _entry(conn: redis.asyncio.Redis, job_id: str, entry_id: str) -> Any:
    entries = await conn.xrange(keys.stream_key(job_id), entry_id, entry_id)
    items = decode_entries(entries or [])
    return items[0] if items else None


async def events(client: AsyncClient, ctx: Context, last_event_id: str | None) -> AsyncIterator[str]:
    """The SSE frames of `ctx`'s job after `last_event_id` (from the start if None)."""
    from_id = last_event_id or START_ID
    if from_id != START_ID:
        at = await _entry(client.connection, ctx.job_id, from_id)
        if at is not None and isinstance(at.event, DoneEvent):  # only the ending was lost
            for text in _ending(ctx, at.event):
                yield text
            return
    role_pending = ctx.kind == "chat" and from_id == START_ID
    sent_text = from_id != START_ID
    try:
        async for item in client.job(ctx.job_id).stream(from_id=from_id):
            event = item.event
            if isinstance(event, TokenEvent):
                if not event.text:
                    continue
                yield _data(ctx.chunk(event.text, None, role_pending), item.stream_id)
                role_pending, sent_text = False, True
            elif isinstance(event, RestartEvent):
                if sent_text:
                    yield _error(
                        f"job {ctx.job_id} was restarted (attempt {event.attempt}) after its worker "
                        "stopped; the text sent so far is void: send the request again",
                        "job_restarted",
                    )
                    return
            elif isinstance(event, DoneEvent):
                yield _data(
                    ctx.chunk(None if ctx.kind == "chat" else "", event.finish_reason, role_pending),
                    item.stream_id,
                )
                for text in _ending(ctx, event):
                    yield text
                return
            elif isinstance(event, ErrorEvent):
                yield _error(f"job {ctx.job_id} failed: {event.message}")
                return
    except (JobFailed, JobNotFound) as e:
        yield _error(str(e))
