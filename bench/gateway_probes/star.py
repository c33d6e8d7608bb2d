# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import time

import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


async def ep(request):
    request.headers.get("authorization")
    return Response(b"x", media_type="text/plain")


routes = [Route("/v1/chat/completions", ep, methods=["POST"])] + [
    Route(f"/v1/x{i}/{{a}}", ep, methods=["GET"]) for i in range(15)
]
app = Starlette(routes=routes)
scope = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": "/v1/chat/completions",
    "raw_path": b"/v1/chat/completions",
    "query_string": b"",
    "root_path": "",
    "headers": [
        (b"host", b"x"),
        (b"authorization", b"Bearer k"),
        (b"content-type", b"application/json"),
        (b"content-length", b"10"),
    ],
    "client": ("127.0.0.1", 1),
    "server": ("127.0.0.1", 2),
    "state": {},
    "app": app,
}


async def receive():
    return {"type": "http.request", "body": b"{}", "more_body": False}


async def send(m):
    pass


async def direct(scope, receive, send):
    r = await ep(Request(scope, receive))
    await r(scope, receive, send)


async def main():
    for name, a in [("starlette", app), ("direct", direct)] * 3:
        t0 = time.process_time()
        for _ in range(5000):
            await a(dict(scope), receive, send)
        print(name, f"{(time.process_time() - t0) / 5000 * 1e6:.1f} us")


uvloop.run(main())
