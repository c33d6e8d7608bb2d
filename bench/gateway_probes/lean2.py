# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import asyncio
import json
import statistics
import sys
import time

import uvloop


async def main():
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 2,
            "stream": True,
        }
    ).encode()
    req = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    r, w = await asyncio.open_connection("127.0.0.1", 18498)
    ts = []
    for _i in range(400):
        t0 = time.perf_counter()
        w.write(req)
        await r.readuntil(b"\r\n\r\n")
        await r.readuntil(b"\r\n")
        ts.append(time.perf_counter() - t0)
        await r.readuntil(b"0\r\n\r\n")
    ts = [t * 1e6 for t in ts[50:]]
    print(
        f"lean client, busy {sys.argv[1]} us at {sys.argv[2]}: first data median {statistics.median(ts):.0f} us"
    )


uvloop.run(main())
