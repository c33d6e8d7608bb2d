# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
"""Temporary probe: submissions/s and gateway CPU each, this checkout vs /tmp/gw-base, alternating."""

import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import redis

from bench import gateway as g
from bench.queue_client import private_redis
from mlxq.producer.gateway import api_keys

reps, n = int(sys.argv[1]), int(sys.argv[2])
trees = {"this": g.ROOT, "base": Path("/tmp/gw-base")}
ports = {"this": 18441, "base": 18442}
with tempfile.TemporaryDirectory() as tmp, private_redis() as url:
    conn = redis.Redis.from_url(url)
    token, _ = api_keys.create(conn, "bench", max_jobs=10**9)
    conn.sadd("rq:workers", "rq:worker:bench-idle")
    conn.hset("mlxq:worker:bench-idle", mapping={"model": g.IDLE_MODEL, "queues": g.IDLE_QUEUE})
    gws = {
        k: g._spawn(
            ["--redis-url", url, "serve", "--port", str(ports[k]), "--log-level", "warning"],
            Path(tmp) / f"{k}.log",
            trees[k],
        )
        for k in trees
    }
    for k in trees:
        g._wait(lambda k=k: g._up(f"http://127.0.0.1:{ports[k]}"), "up")
    res = {k: [] for k in trees}
    order = list(trees)
    for i in range(reps + 1):
        for k in order if i % 2 else order[::-1]:
            c0 = g._cpu_s(gws[k].pid)
            s = asyncio.run(g.submissions(ports[k], token, n, 32))
            if i:
                res[k].append((s["per_s"], (g._cpu_s(gws[k].pid) - c0) * 1000 / n))
    for k in trees:
        rates = [r for r, _ in res[k]]
        cpus = [c for _, c in res[k]]
        print(
            f"{k}: {statistics.median(rates):.0f}/s ({min(rates):.0f}-{max(rates):.0f}), gateway CPU {statistics.median(cpus):.3f} ms each ({min(cpus):.3f}-{max(cpus):.3f})"
        )
    print("load", os.getloadavg())
    for p in gws.values():
        p.terminate()
        p.wait(30)
