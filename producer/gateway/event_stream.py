"""The gateway's server-sent events response: frames sent as they come, stopped when the client leaves.

Starlette's `StreamingResponse` does the same through an anyio task group and cancel scope, whose
bookkeeping is a noticeable share of a streamed submission's CPU when many streams are short (clients
that hang up once the job is enqueued). This one sends the frames in the request's own task and waits
for the client's `http.disconnect` in one plain asyncio task beside it, which cancels the sending when
the client leaves: one task a stream, and no `asyncio.wait` or `gather` to join two.
"""

from __future__ import annotations

import asyncio
import sys
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
        sending = asyncio.current_task()
        assert sending is not None
        streaming, stopped = True, False

        def client_left(listening: asyncio.Future[None]) -> None:
            nonlocal stopped
            if streaming and not listening.cancelled():
                stopped = True
                sending.cancel()  # the frames stop at the await they are in

        listening = asyncio.ensure_future(_client_gone(receive))
        listening.add_done_callback(client_left)
        try:
            await self._send_all(send)
        except asyncio.CancelledError:
            if not stopped:
                raise
            stopped = False
            if _uncancel(sending) > 0:  # cancelled from outside as well: that cancellation goes on
                raise
        finally:
            streaming = False  # a disconnect seen from now on cancels nothing
            if stopped:  # the frames had ended (or swallowed the cancellation): nothing is left to stop
                _uncancel(sending)
            listening.cancel()
            if listening.done() and not listening.cancelled():
                listening.exception()  # a receive that failed means the client is gone: nothing to raise

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for frame in self.frames:
            await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _client_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _uncancel(task: asyncio.Task[object]) -> int:
    """Undo one `cancel()` of `task` and say how many are left; Python 3.10 counts none (a caught
    `CancelledError` is the end of it there), so there is nothing to undo."""
    if sys.version_info >= (3, 11):
        return task.uncancel()
    return 0
