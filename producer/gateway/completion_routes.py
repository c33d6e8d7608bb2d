"""OpenAI's completion routes of the gateway: `POST /v1/chat/completions` and `POST /v1/completions`
(whole answers, streamed ones, and completions with `echo`/`logprobs` as score jobs: `echo`),
`GET /v1/streams/{id}` (a stream resumed from `Last-Event-ID`, on any instance: the context its
submission wrote) and `GET /v1/models` (the live models a key may use). Each route is a short function
over the gateway's parts (`gateway.Gateway`); requests are translated by `translate`, answers shaped by
`shapes` and streams relayed by `relay`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxq.jobs.schema import GenerateResult

from . import echo, relay, shapes, translate
from .api_keys import ApiKey
from .errors import ApiError, bad_request
from .event_stream import EventStream
from .gateway import Gateway, context_key

_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


class CompletionRoutes:
    """The routes, handed the gateway whose key check, body reading, submission and results they use."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def generate(self, request: Request, kind: translate.Kind) -> Response:
        key = await self.gateway.authorize(request)
        body = await self.gateway.body(request)
        if kind == "completion" and echo.wanted(body):
            return await self.scored_completion(key, body)
        t = translate.chat(body) if kind == "chat" else translate.completion(body)
        ctx = await self.gateway.submit(key, t)
        if t.stream:
            return _sse(relay.events(self.gateway.client, ctx, None, fresh=True), ctx)
        results = await asyncio.gather(*(self.gateway.result(job_id) for job_id in ctx.jobs))
        generated = [r for r in results if isinstance(r, GenerateResult)]
        if len(generated) != len(results):
            raise ApiError(500, f"job {ctx.job_id} returned no generation result", type="server_error")
        answer = ctx.whole(generated)  # with the logprobs the jobs report, where asked
        return JSONResponse(answer, headers={"x-mlxq-job-id": ",".join(ctx.jobs)})

    async def resume(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        ctx = await self.context(key, request.path_params["completion_id"])
        last = request.headers.get("last-event-id") or None
        if last is not None and not (
            len(last.split(",")) == len(ctx.jobs) and all(_STREAM_ID.fullmatch(p) for p in last.split(","))
        ):
            raise bad_request(
                f"Last-Event-ID {last!r} is not an id this stream sent (<ms>-<seq>, one per choice)"
            )
        return _sse(relay.events(self.gateway.client, ctx, last), ctx)

    async def models(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        served = await self.gateway.catalog.models()
        data = [
            {"id": m, "object": "model", "created": s.created, "owned_by": "mlxq"}
            for m, s in served.items()
            if key.allows_model(m) and any(key.allows_queue(q) for q in s.queues)
        ]
        return JSONResponse({"object": "list", "data": data})

    async def scored_completion(self, key: ApiKey, body: dict[str, Any]) -> Response:
        """`POST /v1/completions` with `echo`/`logprobs`: one score job (a choice per prompt), or a
        generation job and then the score job of its tokens (`echo`)."""
        ask = echo.parse(body, translate.model_of(body))
        if ask.generate is None:
            job_id, result = await self.gateway.scored(key, ask.model, ask.request)
            answer = echo.answer(ask, shapes.completion_id("completion", job_id), int(time.time()), result)
            return JSONResponse(answer, headers={"x-mlxq-job-id": job_id})
        ctx = await self.gateway.submit(key, ask.generate)
        generated = await self.gateway.result(ctx.job_id)
        if not isinstance(generated, GenerateResult):
            raise ApiError(500, f"job {ctx.job_id} returned no generation result", type="server_error")
        score_id, result = await self.gateway.scored(key, ask.model, echo.after(ask, generated))
        answer = echo.answer_generated(ask, ctx.id, ctx.created, generated, result)
        return JSONResponse(answer, headers={"x-mlxq-job-id": f"{ctx.job_id},{score_id}"})

    async def context(self, key: ApiKey, completion: str) -> shapes.Context:
        found = shapes.job_id_of(completion)
        raw = await self.gateway.client.connection.hgetall(context_key(found[1])) if found else None
        if not raw:
            ttl = self.gateway.settings.stream_ttl_s
            raise ApiError(
                404,
                f"no resumable stream {completion!r} (unknown, or older than {ttl} s)",
                code="stream_not_found",
            )
        assert found is not None
        ctx = shapes.Context.from_fields(found[1], {_str(k): _str(v) for k, v in raw.items()})
        if ctx.owner != key.digest:
            raise ApiError(
                404, f"no resumable stream {completion!r} for this API key", code="stream_not_found"
            )
        return ctx


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _sse(frames: AsyncIterator[str], ctx: shapes.Context) -> EventStream:
    headers = {
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
        "x-mlxq-job-id": ctx.job_id,
        "x-mlxq-resume": f"/v1/streams/{ctx.id}",
    }
    return EventStream(frames, headers)
