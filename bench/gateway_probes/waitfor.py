# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import time

import redis.asyncio as r
import uvloop


async def bench(timeout):
    c = r.Redis.from_url("redis://127.0.0.1:6383", socket_timeout=timeout, health_check_interval=30)
    await c.ping()
    best = []
    for _rep in range(5):
        t0 = time.process_time()
        for _ in range(3000):
            await c.ping()
        best.append((time.process_time() - t0) / 3000 * 1e6)
    await c.aclose()
    return sorted(best)[2]


async def main():
    for _ in range(2):
        for t in (None, 30.0):
            print(t, f"{await bench(t):.1f} us CPU/ping")


uvloop.run(main())
