# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import asyncio
import time

import uvloop


async def frames():
    await asyncio.sleep(0)
    return


async def gone(ev):
    await ev.wait()


async def cur():
    ev = asyncio.Event()
    s = asyncio.ensure_future(frames())
    l = asyncio.ensure_future(gone(ev))
    try:
        await asyncio.wait((s, l), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (s, l):
            t.cancel()
        await asyncio.gather(s, l, return_exceptions=True)


async def alt():
    ev = asyncio.Event()
    l = asyncio.ensure_future(gone(ev))
    try:
        await frames()
    finally:
        l.cancel()


async def main():
    for f in (cur, alt, cur, alt):
        t0 = time.process_time()
        for _ in range(20000):
            await f()
        print(f.__name__, (time.process_time() - t0) / 20000 * 1e6, "us")


uvloop.run(main())
