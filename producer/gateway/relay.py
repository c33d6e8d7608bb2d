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
stream ends with an error saying so; before, it is passed over. With `n` > 1 each choice is a job of its
own and their chunks are interleaved, each marked with its choice's `index` (`_merged`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
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


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False)


def _data(body: dict[str, Any]) -> str:
    return frame(_json(body))


def _error(message: str, type: str = "job_failed") -> str:
    return _json({"error": {"message": message, "type": type, "param": None, "code": None}})


def _ending(ctx: Context, dones: list[DoneEvent]) -> list[str]:
    out = [_data(ctx.usage_chunk(dones))] if ctx.include_usage else []
    return [*out, frame(DONE)]


@dataclass(frozen=True)
class _Piece:
    """One step of a job's answer: a chunk or error (`data`, JSON) with its stream entry id, and the
    job's `done` event with its finish chunk (or alone, where a resumed stream had sent that chunk)."""

    entry_id: str | None
    data: str | None
    done: DoneEvent | None = None
    error: bool = False


async def _entry(conn: redis.asyncio.Redis, job_id: str, entry_id: str) -> Any:
    entries = await conn.xrange(keys.stream_key(job_id), entry_id, entry_id)
    items = decode_entries(entries or [])
    return items[0] if items else None


async def _characters_before(conn: redis.asyncio.Redis, job_id: str, entry_id: str) -> int:
    """The completion's characters in the tokens a stream reported up to `entry_id` (since its last
    restart), by their logprobs' texts: where a resumed completion's `text_offset` goes on from."""
    characters = 0
    for item in decode_entries(await conn.xrange(keys.stream_key(job_id), "-", entry_id) or []):
        if isinstance(item.event, RestartEvent):
            characters = 0
        elif isinstance(item.event, TokenEvent):
            characters += sum(len(lp.text) for lp in item.event.logprobs or ())
    return characters


async def events(
    client: AsyncClient, ctx: Context, last_event_id: str | None, fresh: bool = False
) -> AsyncIterator[str]:
    """The SSE frames of `ctx`'s job after `last_event_id` (from the start if None); with several
    choices, their jobs' chunks interleaved (`_merged`). `fresh`: the jobs were enqueued just now."""
    if ctx.siblings:
        async for text in _merged(client, ctx, last_event_id, fresh):
            yield text
        return
    async for piece in _pieces(client, ctx, last_event_id or START_ID, fresh):
        if piece.data is not None:
            yield frame(piece.data, event_id=piece.entry_id)
        if piece.done is not None:
            for text in _ending(ctx, [piece.done]):
                yield text


async def _merged(
    client: AsyncClient, ctx: Context, last_event_id: str | None, fresh: bool
) -> AsyncIterator[str]:
    """Several choices' jobs as one stream, each chunk as it comes, marked by its choice's `index`.
    An event's id is every job's stream position (`<id0>,<id1>,...`), so a client that reconnects with
    it resumes each job where it was; the usage chunk and `[DONE]` come once, after every job's end."""
    n = len(ctx.jobs)
    positions = last_event_id.split(",") if last_event_id else [START_ID] * n
    if len(positions) != n:
        raise ValueError(f"Last-Event-ID {last_event_id!r} holds {len(positions)} positions for {n} choices")
    queue: asyncio.Queue[tuple[int, _Piece | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for piece in _pieces(client, ctx.choice(i), positions[i], fresh):
                await queue.put((i, piece))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(n)]
    dones: dict[int, DoneEvent] = {}
    try:
        running = n
        while running:
            i, piece = await queue.get()
            if piece is None:
                running -= 1
                continue
            if piece.entry_id is not None:
                positions[i] = piece.entry_id
            if piece.data is not None:
                yield frame(piece.data, event_id=None if piece.error else ",".join(positions))
            if piece.error:
                return
            if piece.done is not None:
                dones[i] = piece.done
        if len(dones) == n:
            for text in _ending(ctx, [dones[i] for i in range(n)]):
                yield text
    finally:
        for task in tasks:
            task.cancel()


async def _pieces(client: AsyncClient, ctx: Context, from_id: str, fresh: bool) -> AsyncIterator[_Piece]:
    """One job's chunks after `from_id`."""
    if from_id != START_ID:
        at = await _entry(client.connection, ctx.job_id, from_id)
        if at is not None and isinstance(at.event, DoneEvent):  # only the ending was lost
            yield _Piece(None, None, at.event)
            return
    role_pending = ctx.kind == "chat" and from_id == START_ID
    sent_text = from_id != START_ID
    offset = ctx.text_start()  # the next token's `text_offset`: after the prompt and the text before it
    if ctx.kind != "chat" and from_id != START_ID:  # a resumed completion: its offsets go on
        offset += await _characters_before(client.connection, ctx.job_id, from_id)
    try:
        async for item in client.job(ctx.job_id).stream(from_id=from_id, fresh=fresh, whole_reads=True):
            event = item.event
            if isinstance(event, TokenEvent):
                if not event.text and not event.logprobs:
                    continue
                chunk = ctx.chunk(event.text, None, role_pending, event.logprobs, offset)
                offset += sum(len(lp.text) for lp in event.logprobs or ())
                yield _Piece(item.stream_id, _json(chunk))
                role_pending, sent_text = False, True
            elif isinstance(event, RestartEvent):
                if sent_text:
                    message = (
                        f"job {ctx.job_id} was restarted (attempt {event.attempt}) after its worker "
                        "stopped; the text sent so far is void: send the request again"
                    )
                    yield _Piece(None, _error(message, "job_restarted"), error=True)
                    return
            elif isinstance(event, DoneEvent):
                finish = ctx.chunk(None if ctx.kind == "chat" else "", event.finish_reason, role_pending)
                yield _Piece(item.stream_id, _json(finish), event)
                return
            elif isinstance(event, ErrorEvent):
                yield _Piece(None, _error(f"job {ctx.job_id} failed: {event.message}"), error=True)
                return
    except (JobFailed, JobNotFound) as e:
        yield _Piece(None, _error(str(e)), error=True)
