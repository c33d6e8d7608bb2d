"""The gateway's SSE response (`producer.gateway.event_stream`) at the ASGI level: frames go out as
they come and the response ends with them; a client that leaves stops the frames at once; the frames'
own error is raised."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mlxq.producer.gateway.event_stream import EventStream


class Client:
    """The ASGI server's side: what was sent, and a disconnect once `leave` is set."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.leave = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def test_frames_go_out_and_the_response_ends_with_them() -> None:
    async def frames() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        yield "data: [DONE]\n\n"

    async def main() -> list[dict[str, Any]]:
        client = Client()
        await EventStream(frames(), {"x-mlxq-job-id": "j"})({"type": "http"}, client.receive, client.send)
        return client.sent

    sent = asyncio.run(main())
    start = sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-mlxq-job-id", b"j") in start["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]


def test_a_client_that_leaves_stops_the_frames() -> None:
    stopped = []

    async def frames() -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(3600)  # a job that never speaks again
            yield "data: never\n\n"
        finally:
            stopped.append(True)

    async def main() -> list[dict[str, Any]]:
        client = Client()
        answering = asyncio.ensure_future(
            EventStream(frames(), {})({"type": "http"}, client.receive, client.send)
        )
        while len(client.sent) < 2:
            await asyncio.sleep(0.001)
        client.leave.set()
        await asyncio.wait_for(answering, timeout=5)
        return client.sent

    sent = asyncio.run(main())
    assert stopped == [True] and [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]


def test_the_frames_own_error_is_raised() -> None:
    async def frames() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        raise RuntimeError("the relay broke")

    async def main() -> None:
        client = Client()
        await EventStream(frames(), {})({"type": "http"}, client.receive, client.send)

    with pytest.raises(RuntimeError, match="the relay broke"):
        asyncio.run(main())


def test_a_client_that_leaves_leaves_the_request_task_uncancelled() -> None:
    """The frames are sent in the request's own task, which the client's leaving cancels: once the
    response returns, that task goes on as if nothing had been cancelled (the server's code after it)."""

    async def frames() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        await asyncio.sleep(3600)
        yield "data: never\n\n"

    async def request() -> tuple[int, str]:
        client = Client()
        client.leave.set()
        await EventStream(frames(), {})({"type": "http"}, client.receive, client.send)
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0.01)  # a later await in the same task is not cancelled
        return (task.cancelling() if sys.version_info >= (3, 11) else 0), "went on"

    assert asyncio.run(request()) == (0, "went on")


def test_a_cancellation_from_outside_goes_on_through_the_response() -> None:
    async def frames() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        await asyncio.sleep(3600)
        yield "data: never\n\n"

    async def main() -> bool:
        client = Client()
        answering = asyncio.ensure_future(
            EventStream(frames(), {})({"type": "http"}, client.receive, client.send)
        )
        while len(client.sent) < 2:
            await asyncio.sleep(0.001)
        answering.cancel()  # the server shutting down, say
        try:
            await answering
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(main())
