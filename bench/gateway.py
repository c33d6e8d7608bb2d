"""`python -m bench.gateway`: what the OpenAI gateway adds to a job, on this machine.

Two figures, with a private redis-server and real `mlxq serve` and `mlxq worker` processes:

- added latency to the first token: the same greedy request, taking turns, through mlxq's `AsyncClient`
  (enqueue, then XREAD of the job's stream until the first token) and through the gateway (HTTP POST
  with `stream: true` until the first SSE chunk with text). p50/p99 of each and of the difference of
  each pair. The tiny random model keeps the worker's own time small, not zero: the difference is
  what the gateway adds.
- submissions/s: concurrent streaming POSTs, each counted when the gateway answers with its headers
  (the job is enqueued by then), to a model advertised in Redis the way a worker advertises itself but
  with no worker draining its queue, so the figure is the gateway's (and Redis's) alone. The gateway
  process's own CPU time per submission is reported too: on a host shared with the load generator,
  Redis and other work, it says what one gateway core sustains. These clients hang up as soon as the
  job is enqueued, which cuts the gateway's first read of the job's stream: each costs it a Redis
  reconnect that a client reading its stream to the end does not cause.

Targets (issue 33): p50 under 2 ms added, at least 1,000 submissions/s from one gateway process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from mlxq.producer import AsyncClient
from mlxq.producer.gateway import api_keys

from .queue_client import private_redis

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "gw-bench"
IDLE_QUEUE = "gw-bench-idle"
IDLE_MODEL = "no-worker-drains-this"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLXQ_HEARTBEAT_S": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "mlxq.producer.cli", *argv],
        cwd=ROOT,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux `/proc`; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


async def first_token(redis_url: str, gateway: str, token: str, model: str, rounds: int) -> dict[str, Any]:
    prompt = [{"role": "user", "content": "Say something."}]
    body = {"model": model, "messages": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True}
    headers = {"authorization": f"Bearer {token}"}
    direct: list[float] = []
    through: list[float] = []
    async with AsyncClient(redis_url, queue=QUEUE) as client, httpx.AsyncClient(timeout=60.0) as http:
        for i in range(rounds + 1):  # the first round warms up and is dropped
            t0 = time.perf_counter()
            job = await client.submit_generate(messages=prompt, max_tokens=2, temperature=0.0)
            async for _ in job.text_deltas(timeout=60):
                break
            d = time.perf_counter() - t0
            t0 = time.perf_counter()
            async with http.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                        "content"
                    ):
                        break
            g = time.perf_counter() - t0
            if i:
                direct.append(d * 1000)
                through.append(g * 1000)
    added = [g - d for g, d in zip(through, direct, strict=True)]
    return {
        "rounds": rounds,
        "direct_ms": {"p50": _pct(direct, 0.5), "p99": _pct(direct, 0.99)},
        "gateway_ms": {"p50": _pct(through, 0.5), "p99": _pct(through, 0.99)},
        "added_ms": {"p50": _pct(added, 0.5), "p99": _pct(added, 0.99), "mean": statistics.fmean(added)},
    }


async def submissions(gateway: str, token: str, total: int, concurrency: int) -> dict[str, Any]:
    body = {
        "model": IDLE_MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {token}"}
    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal done
        async with http.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {await r.aread()!r}")
            done += 1

    async def lane(http: httpx.AsyncClient, n: int) -> None:
        for _ in range(n):
            await one(http)

    async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:
        await asyncio.gather(*(one(http) for _ in range(concurrency)))  # connections open, code warm
        done = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(lane(http, total // concurrency) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"requests": done, "concurrency": concurrency, "wall_s": wall, "per_s": done / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="paired first-token measurements [200]")
    parser.add_argument("--submissions", type=int, default=4000, help="POSTs for submissions/s [4000]")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp, private_redis() as redis_url:
        folder = Path(tmp)
        model_dir = write_random_checkpoint(folder / "tiny", {"max_position_embeddings": 4096})
        conn = redis.Redis.from_url(redis_url)
        token, _ = api_keys.create(conn, "bench", max_jobs=10**9)
        # A model advertised as a worker advertises itself, on a queue nobody drains (submissions/s).
        conn.sadd("rq:workers", "rq:worker:bench-idle")
        conn.hset("mlxq:worker:bench-idle", mapping={"model": IDLE_MODEL, "queues": IDLE_QUEUE})
        worker = _spawn(
            [
                "worker",
                "--model",
                str(model_dir),
                "--redis-url",
                redis_url,
                "--queue",
                QUEUE,
                "--name",
                "bench-worker",
            ],
            folder / "worker.log",
        )
        gateway_url = "http://127.0.0.1:18431"
        gateway = _spawn(
            ["--redis-url", redis_url, "serve", "--port", "18431", "--log-level", "warning"],
            folder / "gateway.log",
        )
        try:
            _wait(lambda: conn.hget("mlxq:worker:bench-worker", "model"), "worker up")
            _wait(lambda: _up(gateway_url), "gateway up")
            model = model_dir.name
            first = asyncio.run(first_token(redis_url, gateway_url, token, model, args.rounds))
            cpu0 = _cpu_s(gateway.pid)
            sub = asyncio.run(submissions(gateway_url, token, args.submissions, args.concurrency))
            # The gateway's own CPU per submission: what one core of it can do, however busy the host is
            # (the load generator and Redis share this machine's cores with it).
            sub["gateway_cpu_ms_each"] = (_cpu_s(gateway.pid) - cpu0) * 1000 / sub["requests"]
            sub["per_gateway_core_s"] = 1000 / sub["gateway_cpu_ms_each"]
            figures = {
                "first_token": first,
                "submissions": sub,
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
            }
        finally:
            for proc in (gateway, worker):
                proc.terminate()
                proc.wait(30)
        print(json.dumps(figures, indent=2))
        ft, sub = figures["first_token"], figures["submissions"]
        print(
            f"added to first token: p50 {ft['added_ms']['p50']:.2f} ms, p99 {ft['added_ms']['p99']:.2f} ms "
            f"(target p50 < 2 ms): {'met' if ft['added_ms']['p50'] < 2 else 'NOT met'}"
        )
        print(
            f"submissions/s: {sub['per_s']:.0f} (target >= 1000): "
            + ("met" if sub["per_s"] >= 1000 else "NOT met")
            + f"; gateway CPU {sub['gateway_cpu_ms_each']:.2f} ms each "
            + f"({sub['per_gateway_core_s']:.0f}/s per core)"
        )
        if args.out:
            args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
