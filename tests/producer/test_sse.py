"""A job's stream relayed as Server-Sent Events over real HTTP and read by a real SSE client (httpx-sse):
newlines and carriage returns in the text arrive as the model wrote them, and a reconnect with
`Last-Event-ID` resumes after the last event seen."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import WorkerSide, generate_result
from httpx_sse import connect_sse

from mlxq.producer import Client
from mlxq.producer.sse import frame, item_frame
from mlxq.producer.tail import START_ID

REDIS_DB = 13
TEXTS = ["Hello", "\n", "a\nb", "\r\n", "c\rd", "\n\n", " end"]
PLAIN = ["plain", "\n", "a\nb\n", "", "line\r\nbreak"]


@pytest.fixture
def relay(client: Client) -> Iterator[str]:
    """An HTTP server relaying `GET /jobs/<id>` as SSE, from `Last-Event-ID` on when the client sends one."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/plain/"):  # `frame` alone: plain text as the data
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(frame(PLAIN[int(self.path.rsplit("/", 1)[-1])], event="t").encode())
                return
            job = client.job(self.path.rsplit("/", 1)[-1])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for item in job.stream(from_id=self.headers.get("Last-Event-ID") or START_ID, timeout=10):
                self.wfile.write(item_frame(item).encode())
                self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_text_with_line_breaks_arrives_whole_and_a_reconnect_resumes(
    relay: str, client: Client, worker_side: WorkerSide
) -> None:
    job = client.submit_generate("hi")
    ids = worker_side.tokens(job.id, *TEXTS)
    worker_side.done(job.id, generate_result("".join(TEXTS)))
    with httpx.Client(timeout=10) as http, connect_sse(http, "GET", f"{relay}/jobs/{job.id}") as source:
        events = list(source.iter_sse())
    assert [e.event for e in events] == ["token"] * len(TEXTS) + ["done"]
    assert [json.loads(e.data)["text"] for e in events[:-1]] == TEXTS
    assert [e.id for e in events[:-1]] == ids
    assert json.loads(events[-1].data)["finish_reason"] == "stop"

    headers = {"Last-Event-ID": ids[2]}
    with (
        httpx.Client(timeout=10) as http,
        connect_sse(http, "GET", f"{relay}/jobs/{job.id}", headers=headers) as source,
    ):
        resumed = list(source.iter_sse())
    assert [json.loads(e.data).get("text") for e in resumed[:-1]] == TEXTS[3:]


@pytest.mark.parametrize("n", range(len(PLAIN)))
def test_a_frame_of_plain_text_keeps_its_lines(relay: str, n: int) -> None:
    """`frame` alone (text as the data, no JSON): each line its own `data:` line, joined back by the
    client; a CR LF arrives as LF, as SSE reads any line break."""
    with httpx.Client(timeout=10) as http, connect_sse(http, "GET", f"{relay}/plain/{n}") as source:
        events = list(source.iter_sse())
    assert [(e.event, e.data) for e in events] == [("t", PLAIN[n].replace("\r\n", "\n"))]
