# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
"""Temporary probe: py-spy on the gateway during the submissions phase and the first-token phase."""

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench import gateway as g
from bench.queue_client import private_redis
from mlxq.producer.gateway import api_keys

phase = sys.argv[1]  # sub | ft
out = sys.argv[2]
with tempfile.TemporaryDirectory() as tmp, private_redis() as url:
    folder = Path(tmp)
    conn = redis.Redis.from_url(url)
    token, _ = api_keys.create(conn, "bench", max_jobs=10**9)
    conn.sadd("rq:workers", "rq:worker:bench-idle")
    conn.hset("mlxq:worker:bench-idle", mapping={"model": g.IDLE_MODEL, "queues": g.IDLE_QUEUE})
    worker = None
    if phase == "ft":
        from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

        model_dir = write_random_checkpoint(folder / "tiny", {"max_position_embeddings": 4096})
        worker = g._spawn(
            [
                "worker",
                "--model",
                str(model_dir),
                "--redis-url",
                url,
                "--queue",
                g.QUEUE,
                "--name",
                "bench-worker",
            ],
            folder / "w.log",
        )
        g._wait(lambda: conn.hget("mlxq:worker:bench-worker", "model"), "worker up")
    gw = g._spawn(
        ["--redis-url", url, "serve", "--port", "18431", "--log-level", "warning"], folder / "gw.log"
    )
    g._wait(lambda: g._up("http://127.0.0.1:18431"), "up")
    asyncio.run(g.submissions(18431, token, 256, 32))
    spy = subprocess.Popen(
        ["/tmp/pyspy/bin/py-spy", "record", "-p", str(gw.pid), "-r", "250", "-f", "raw", "-o", out],
        env={**os.environ, "PYTHONPATH": "/tmp/pyspy"},
    )
    time.sleep(1)
    if phase == "sub":
        print(asyncio.run(g.submissions(18431, token, 6000, 32)))
    else:
        print(
            asyncio.run(g.first_token(url, {"this": "http://127.0.0.1:18431"}, token, model_dir.name, 300))[
                "this"
            ]["added_ms"]
        )
    spy.send_signal(2)
    spy.wait(30)
    gw.terminate()
    gw.wait(30)
    if worker:
        worker.terminate()
        worker.wait(30)
