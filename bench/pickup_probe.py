"""Where a lone generation job's time to first token goes when it finds a worker idle
(`python3 -m bench.pickup_probe [--model tiny] [--jobs 30]`, ~20 s on the CPU; prints a table).

One real worker (`bench.worker_proc`) waits on its queue; each job is enqueued alone, `--gap-s` after
the last one ended (so the worker is blocked in RQ's dequeue, as a web backend's job finds it), and
its stream is read as a client would. Per job, from the client's clock before the enqueue call:
the enqueue call itself; RQ's `started_at` (the worker's start of the job, written into the job hash);
the worker's own TTFT (from the job's admission to its first token, `done`'s `ttft_s`); the client's
TTFT (the first token entry read back); the `done` entry read back. What the client's TTFT has beyond
the worker's is the queue's share: enqueue, dequeue, RQ's start of the job, the admission before the
worker's clock starts, the first token's stream write and the client's read.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import redis

from bench.checkpoints import checkpoint
from bench.queue_client import BenchWorker, cleanup, enqueue, follow, private_redis
from jobs import keys

PHASES = ("enqueue call", "to RQ started_at", "worker TTFT", "client TTFT", "done read")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.pickup_probe")
    p.add_argument("--model", default="tiny", help="a bench checkpoint name (bench.checkpoints)")
    p.add_argument("--jobs", type=int, default=30)
    p.add_argument("--gap-s", type=float, default=0.2, help="idle time before each job")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--redis-url", default="private", help="`private`: a throw-away redis-server")
    a = p.parse_args(argv)
    model = checkpoint(a.model, Path.home() / ".cache/mlxq/bench-models")
    if a.redis_url == "private":
        with private_redis() as url:
            rows = _run(a, str(model), url)
    else:
        rows = _run(a, str(model), a.redis_url)
    print(f"model={a.model} jobs={a.jobs} gap_s={a.gap_s} max_tokens={a.max_tokens}; ms, enqueue = 0")
    print("| phase | median | p10 | p90 |\n| --- | --- | --- | --- |")
    for name in PHASES:
        v = sorted(r[name] for r in rows)
        print(f"| {name} | {statistics.median(v):.2f} | {v[len(v) // 10]:.2f} | {v[9 * len(v) // 10]:.2f} |")


def _run(a: argparse.Namespace, model: str, url: str) -> list[dict[str, float]]:
    conn = redis.Redis.from_url(url)
    rows, ids = [], []
    with BenchWorker(model, url, Path(tempfile.mkdtemp()), "pickup").start() as w:
        w.wait_ready()
        for i in range(a.jobs + 3):  # the first three warm up
            time.sleep(a.gap_s)
            prompt = f"hello world number {i} " * 4
            payload = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0.0}
            t0, epoch0 = time.perf_counter(), time.time()
            job_id = enqueue(w.queue, "jobs.generate", payload)
            t1 = time.perf_counter()
            trace = follow(conn, [job_id], t0, 60)[job_id]
            ids.append(job_id)
            done, ttft = trace.done, trace.ttft_s()
            if done is None or done.get("event") != "done" or ttft is None:
                raise RuntimeError(f"job {job_id} did not finish: {done}")
            started = conn.hget(keys.rq_job_key(job_id), "started_at")
            assert started is not None
            at = datetime.fromisoformat(started.decode().replace("Z", "+00:00")).timestamp()
            if i >= 3:
                rows.append(
                    {
                        "enqueue call": (t1 - t0) * 1e3,
                        "to RQ started_at": (at - epoch0) * 1e3,
                        "worker TTFT": float(done["ttft_s"]) * 1e3,
                        "client TTFT": ttft * 1e3,
                        "done read": (trace.entries[-1][0] - t0) * 1e3,
                    }
                )
        cleanup(conn, ids, w.queue_name)
    return rows


if __name__ == "__main__":
    main()
