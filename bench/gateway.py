"""`python -m bench.gateway`: what the OpenAI gateway adds to a job, on this machine.

Two figures, with a private redis-server and real `mlxq serve` and `mlxq worker` processes:

- added latency to the first token: the same greedy request, taking turns, through mlxq's `AsyncClient`
  (enqueue, then XREAD of the job's stream until the first token) and through the gateway (HTTP POST
  with `stream: true` until the first SSE chunk with text), each answer read to its end so that every
  round starts with the worker idle and the HTTP connection kept alive (`--hang-up`: the clients leave
  at the first token instead). p50/p99 of each and of the difference of each pair. The tiny random
  model keeps the worker's own time small, not zero: the difference is what the gateway adds.
- submissions/s: concurrent streaming POSTs from a lean load generator (raw asyncio HTTP/1.1, one
  connection each, its own CPU per request reported), each counted when the gateway answers with its
  headers (the job is enqueued by then), to a model advertised in Redis the way a worker advertises
  itself but with no worker draining its queue, so the figure is the gateway's (and Redis's) alone. The
  gateway process's own CPU time per submission is reported too: on a host shared with the load
  generator, Redis and other work, it says what one gateway core sustains. These clients hang up as
  soon as the job is enqueued, while the gateway's first read of the job's stream is under way.
- `--compare PATH`: another checkout's gateway (a `git worktree` of the commit before a change) measured
  with this one's, taking turns, so that a shared host's changing load falls on both alike.

Targets (issue 33): p50 under 2 ms added, at least 1,000 submissions/s from one gateway process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
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


def _spawn(argv: list[str], log: Path, root: Path = ROOT) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(root), "MLXQ_HEARTBEAT_S": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "mlxq.producer.cli", *argv],
        cwd=root,
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


async def first_token(
    redis_url: str, gateways: dict[str, str], token: str, model: str, rounds: int, hang_up: bool = False
) -> dict[str, dict[str, Any]]:
    """Paired first-token times, direct and through each gateway in `gateways` (name: URL), with httpx
    and with the lean client, every path once a round in a shuffled order, so that no path always
    follows the same one (and, with two gateways, both see the host's load of the moment).
    Each answer is read to its end (the clock stops at its first token), so every round starts with
    the worker idle and the HTTP connection kept alive, as an OpenAI client that reads its answers
    has it; `hang_up`: each client leaves at its first token instead (a new HTTP connection a round,
    the worker still finishing the previous round's job when the next is sent)."""
    prompt = [{"role": "user", "content": "Say something."}]
    body = {"model": model, "messages": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True}
    headers = {"authorization": f"Bearer {token}"}
    leans = {name: _LeanStream(url, token, body) for name, url in gateways.items()}
    async with AsyncClient(redis_url, queue=QUEUE) as client, httpx.AsyncClient(timeout=60.0) as http:

        async def via_client() -> float | None:
            t0 = time.perf_counter()
            job = await client.submit_generate(messages=prompt, max_tokens=2, temperature=0.0)
            first = None
            async for _ in job.text_deltas(timeout=60):
                first = first or time.perf_counter() - t0
                if hang_up:
                    break
            return first

        def via_httpx(url: str) -> Callable[[], Awaitable[float | None]]:
            async def run() -> float | None:
                t0 = time.perf_counter()
                first = None
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {") and _has_text(line):
                            first = time.perf_counter() - t0
                            if hang_up:
                                break
                return first

            return run

        def via_lean(lean: _LeanStream) -> Callable[[], Awaitable[float | None]]:
            async def run() -> float | None:
                return await lean.first_text(hang_up)

            return run

        paths: dict[tuple[str, str], Callable[[], Awaitable[float | None]]] = {("", "direct"): via_client}
        for name, url in gateways.items():
            paths[(name, "httpx")] = via_httpx(url)
            paths[(name, "lean")] = via_lean(leans[name])
        order = list(paths)
        times: dict[tuple[str, str], list[float]] = {path: [] for path in order}
        shuffle = random.Random(33).shuffle  # a new order each round, the same in every run
        for i in range(rounds + 1):  # the first round warms up and is dropped
            shuffle(order)
            for path in order:
                took = await paths[path]()
                if took is None:
                    raise RuntimeError("an answer ended with no text")
                if i:
                    times[path].append(took * 1000)
    for lean in leans.values():
        await lean.close()
    direct = times[("", "direct")]
    out = {}
    for name in gateways:
        through, lean_through = times[(name, "httpx")], times[(name, "lean")]
        added = [g - d for g, d in zip(through, direct, strict=True)]
        added_lean = [g - d for g, d in zip(lean_through, direct, strict=True)]
        out[name] = {
            "rounds": rounds,
            "hang_up": hang_up,
            "direct_ms": {"p50": _pct(direct, 0.5), "p99": _pct(direct, 0.99)},
            "gateway_ms": {"p50": _pct(through, 0.5), "p99": _pct(through, 0.99)},
            "added_ms": {"p50": _pct(added, 0.5), "p99": _pct(added, 0.99), "mean": statistics.fmean(added)},
            "lean_gateway_ms": {"p50": _pct(lean_through, 0.5), "p99": _pct(lean_through, 0.99)},
            "added_lean_client_ms": {
                "p50": _pct(added_lean, 0.5),
                "p99": _pct(added_lean, 0.99),
                "mean": statistics.fmean(added_lean),
            },
        }
    return out


def _has_text(line: str) -> bool:
    return bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))


class _LeanStream:
    """The same streamed request through raw asyncio HTTP/1.1: the request in one write on a kept-alive
    connection, the chunked SSE answer read by hand. Its first-token time less the direct one is what
    the gateway adds without an HTTP client library's own time (httpx, under OpenAI's SDK, writes the
    headers and the body apart and parses in Python)."""

    def __init__(self, gateway: str, token: str, body: dict[str, Any]) -> None:
        host, port = gateway.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        data = json.dumps(body).encode()
        self.request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
        ).encode() + data
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def first_text(self, hang_up: bool) -> float:
        """Seconds from sending the request to its first chunk with text; the answer read to its end
        (`hang_up`: the connection closed there instead)."""
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.conn
        t0 = time.perf_counter()
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"the gateway answered {head!r}")
        first = None
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            chunk = (await reader.readexactly(size + 2))[:-2].decode()
            if first is None and any(
                line.startswith("data: {") and _has_text(line) for line in chunk.split("\n")
            ):
                first = time.perf_counter() - t0
                if hang_up:
                    await self.close()
                    break
        if first is None:
            raise RuntimeError("an answer ended with no text")
        return first

    async def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None


async def submissions(port: int, token: str, total: int, concurrency: int) -> dict[str, Any]:
    """`total` streaming POSTs from `concurrency` lanes of raw asyncio HTTP/1.1 (a lean load generator:
    its own CPU per request is reported, a fraction of the gateway's), each on its own connection,
    closed once the status line and headers are in (the job is enqueued by then)."""
    body = json.dumps(
        {"model": IDLE_MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "stream": True}
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    done = 0

    async def one() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the gateway answered {head!r} {await reader.read(1000)!r}")
        finally:
            writer.close()
        done += 1

    async def lane(n: int) -> None:
        for _ in range(n):
            await one()

    await asyncio.gather(*(one() for _ in range(concurrency)))  # code warm, pools filled
    done = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane(total // concurrency) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {
        "requests": done,
        "concurrency": concurrency,
        "wall_s": wall,
        "per_s": done / wall,
        "load_generator_cpu_ms_each": (time.process_time() - cpu0) * 1000 / done,
    }


def _measure_submissions(
    gateway: subprocess.Popen[bytes], port: int, token: str, args: Any
) -> dict[str, Any]:
    cpu0 = _cpu_s(gateway.pid)
    sub = asyncio.run(submissions(port, token, args.submissions, args.concurrency))
    # The gateway's own CPU per submission: what one core of it can do, however busy the host is
    # (the load generator and Redis share this machine's cores with it).
    sub["gateway_cpu_ms_each"] = (_cpu_s(gateway.pid) - cpu0) * 1000 / sub["requests"]
    sub["per_gateway_core_s"] = 1000 / sub["gateway_cpu_ms_each"]
    return sub


def _commit(root: Path) -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    return (found.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def _machine() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs" + (
        f", {names[0]}" if names else ""
    )


def _compare(args: Any, redis_url: str, token: str, model: str, folder: Path) -> dict[str, Any]:
    """Both figures for this checkout's gateway and `args.compare`'s: each turn runs both gateways at
    once, their first-token paths taking turns round by round, then each one's submissions/s (the
    order changing each turn)."""
    trees = {"this": ROOT, "compared": args.compare.resolve()}
    ports = {"this": 18432, "compared": 18433}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for turn in range(args.turns):
        gateways = {
            name: _spawn(
                ["--redis-url", redis_url, "serve", "--port", str(ports[name]), "--log-level", "warning"],
                folder / f"gateway-{name}-{turn}.log",
                root,
            )
            for name, root in trees.items()
        }
        try:
            for name, url in urls.items():
                _wait(lambda url=url: _up(url), f"{name} gateway up")
            first = asyncio.run(first_token(redis_url, urls, token, model, args.rounds, args.hang_up))
            names = list(trees)[:: 1 if turn % 2 == 0 else -1]
            for name in names:
                sub = _measure_submissions(gateways[name], ports[name], token, args)
                runs[name].append({"first_token": first[name], **sub})
        finally:
            for gateway in gateways.values():
                gateway.terminate()
                gateway.wait(30)
    summary = []
    for name, root in trees.items():
        rates = [round(r["per_s"]) for r in runs[name]]
        cpus = [round(r["gateway_cpu_ms_each"], 2) for r in runs[name]]
        added = [round(r["first_token"]["added_ms"]["p50"], 2) for r in runs[name]]
        lean = [round(r["first_token"]["added_lean_client_ms"]["p50"], 2) for r in runs[name]]
        summary.append(
            f"{name} ({_commit(root)}): submissions/s {statistics.median(rates):.0f} (median of {rates}); "
            f"gateway CPU {statistics.median(cpus):.2f} ms each ({cpus}); added first-token p50 "
            f"{statistics.median(added):.2f} ms ({added}), with the lean client "
            f"{statistics.median(lean):.2f} ms ({lean})"
        )
    return {"runs": runs, "commits": {n: _commit(r) for n, r in trees.items()}, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="paired first-token measurements [200]")
    parser.add_argument("--submissions", type=int, default=4000, help="POSTs for submissions/s [4000]")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--compare",
        type=Path,
        help="another mlxq checkout (e.g. a `git worktree` of main): its gateway and this one's are "
        "measured for submissions/s in turns, so a shared host's load falls on both alike",
    )
    parser.add_argument("--turns", type=int, default=3, help="turns of each gateway with --compare [3]")
    parser.add_argument(
        "--hang-up",
        action="store_true",
        help="first-token rounds: each client leaves at its first token (a new HTTP connection a round, "
        "the worker still busy with the previous job) instead of reading its answer to the end",
    )
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
            first = asyncio.run(
                first_token(redis_url, {"this": gateway_url}, token, model, args.rounds, args.hang_up)
            )["this"]
            sub = _measure_submissions(gateway, 18431, token, args)
            gateway.terminate()
            gateway.wait(30)
            compared = None if args.compare is None else _compare(args, redis_url, token, model, folder)
        finally:
            for proc in (gateway, worker):
                proc.terminate()
                proc.wait(30)
        figures: dict[str, Any] = {
            "first_token": first,
            "submissions": sub,
            "machine": _machine(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "commit": _commit(ROOT),
            "load_average": os.getloadavg(),
        }
        if compared is not None:
            figures["compared"] = compared
        print(json.dumps(figures, indent=2))
        ft = figures["first_token"]
        print(
            f"added to first token: p50 {ft['added_ms']['p50']:.2f} ms, p99 {ft['added_ms']['p99']:.2f} ms "
            f"(target p50 < 2 ms): {'met' if ft['added_ms']['p50'] < 2 else 'NOT met'}; with the lean "
            f"HTTP client p50 {ft['added_lean_client_ms']['p50']:.2f} ms, "
            f"p99 {ft['added_lean_client_ms']['p99']:.2f} ms"
        )
        print(
            f"submissions/s: {sub['per_s']:.0f} (target >= 1000): "
            + ("met" if sub["per_s"] >= 1000 else "NOT met")
            + f"; gateway CPU {sub['gateway_cpu_ms_each']:.2f} ms each "
            + f"({sub['per_gateway_core_s']:.0f}/s per core); load generator "
            + f"{sub['load_generator_cpu_ms_each']:.2f} ms each"
        )
        print(f"{figures['machine']}; {figures['date_utc']} UTC; commit {figures['commit']}")
        for line in figures.get("compared", {}).get("summary", []):
            print(line)
        if args.out:
            args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
