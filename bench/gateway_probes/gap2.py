# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import asyncio
import statistics
import sys
import time

import httpx
import uvloop

BUSY_US = float(sys.argv[1])
WHERE = sys.argv[2]


def busy():
    end = time.perf_counter() + BUSY_US / 1e6
    while time.perf_counter() < end:
        pass


class P(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t
        self.buf = b""
        self.first = True

    def data_received(self, d):
        if self.first and WHERE == "head":
            busy()
        self.first = False
        self.buf += d
        if b"\r\n\r\n" in self.buf:
            head, _, body = self.buf.partition(b"\r\n\r\n")
            n = int(
                next(l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")).split(b":")[1]
            )
            if len(body) >= n:
                if WHERE == "body":
                    busy()
                self.buf = b""
                self.first = True
                self.t.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\na\r\ndata: {}\n\n\r\n0\r\n\r\n"
                )


async def serve():
    await asyncio.get_running_loop().create_server(P, "127.0.0.1", 18498)
    await asyncio.sleep(30)


async def main():
    await asyncio.sleep(0.5)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 2,
        "stream": True,
    }
    ts = []
    async with httpx.AsyncClient() as c:
        for _i in range(400):
            t0 = time.perf_counter()
            async with c.stream(
                "POST",
                "http://127.0.0.1:18498/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer x"},
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data"):
                        ts.append(time.perf_counter() - t0)
    ts = [t * 1e6 for t in ts[50:]]
    print(f"busy {BUSY_US:.0f} us at {WHERE}: first data median {statistics.median(ts):.0f} us")


uvloop.run(serve() if sys.argv[3] == "s" else main())
