"""The gateway's server-sent events response: frames sent as they come, stopped when the client leaves.

Starlette's `StreamingResponse` does the same through an anyio task group and cancel scope, whose
bookkeeping is a noticeable share of a streamed submission's CPU when many streams are short (clients
that hang up once the job is enqueued). This one uses two plain asyncio tasks: the frames, and the
wait for the client's `http.disconnect`; whichever ends first ends the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream(Response):
    """`text/event-stream` from `frames` (SSE text, one or more events each)."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[str], headers: Mapping[str, str]) -> None:
        self.frames = frames
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send_all(send))
        listening = asyncio.ensure_future(_client_gone(receive))
        try:
            await asyncio.wait((sending, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, listening):
                task.cancel()
            ended = await asyncio.gather(sending, listening, return_exceptions=True)
        if isinstance(ended[0], Exception):
            raise ended[0]  # the frames' own error, raised as StreamingResponse raises it

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for frame in self.frames:
            await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _client_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
