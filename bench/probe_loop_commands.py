"""Probe (to be deleted): Redis commands one burst worker sends for three score jobs and a refused job,
to compare a refactor against main. Run from the tree to measure, with PYTHONPATH set to it:
`PYTHONPATH=. python bench/probe_loop_commands.py redis://127.0.0.1:6392/4` (flushes that DB)."""

from __future__ import annotations

import sys
from typing import Any

import redis
from rq import Queue
from rq.serializers import JSONSerializer

import mlxq
from mlxq.jobs import keys
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.stream_writer import StreamOptions

conn = redis.Redis.from_url(sys.argv[1])
conn.flushdb()
q = Queue("count", connection=conn, serializer=JSONSerializer)
w = MlxqWorker([q], connection=conn, stream_options=StreamOptions())


class Succeeds:
    def run(self, first: Any, queue: Queue) -> None:
        (run,) = w.start([first], queue)
        w.batches.succeed(run, {"ok": True})


w.runners[keys.SCORE_FUNC] = Succeeds()
for _ in range(3):
    q.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "a", "candidates": ["b"]}]},))
q.enqueue_call("os.getcwd")
conn.config_resetstat()
w.work(burst=True)
stats = conn.info("commandstats")
skip = ("cmdstat_info", "cmdstat_config|resetstat")
print(mlxq.__file__, sorted((k[8:], v["calls"]) for k, v in stats.items() if k not in skip))
conn.flushdb()
