# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench import gateway as g
from bench.queue_client import private_redis
from mlxq.producer.gateway import api_keys

with tempfile.TemporaryDirectory() as tmp, private_redis() as url:
    folder = Path(tmp)
    conn = redis.Redis.from_url(url)
    token, _ = api_keys.create(conn, "bench", max_jobs=10**9)
    conn.sadd("rq:workers", "rq:worker:bench-idle")
    conn.hset("mlxq:worker:bench-idle", mapping={"model": g.IDLE_MODEL, "queues": g.IDLE_QUEUE})
    import subprocess

    gw = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxq.producer.cli",
            "--redis-url",
            url,
            "serve",
            "--port",
            "18431",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "PYTHONPATH": f"{g.ROOT}:/tmp/gwprobe/gcsite"},
        cwd=g.ROOT,
    )
    g._wait(lambda: g._up("http://127.0.0.1:18431"), "up")
    time.sleep(3)
    asyncio.run(g.submissions(18431, token, 256, 32))
    gw.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    print(open(f"/tmp/gwprobe/gc-{gw.pid}.txt").read())
    c0 = g._cpu_s(gw.pid)
    print(asyncio.run(g.submissions(18431, token, int(sys.argv[1]), 32)))
    print("gw cpu ms each", (g._cpu_s(gw.pid) - c0) * 1000 / int(sys.argv[1]))
    gw.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    print(open(f"/tmp/gwprobe/gc-{gw.pid}.txt").read())
    gw.terminate()
    gw.wait(30)
