"""Batched generation through the queue: aggregate tokens/s and per-job latency, batched vs one at a time.

    python -m bench.batch_generate [--model PATH] [--sizes 1,8,32] [--max-tokens 64]

For each size N, N generation jobs are enqueued at once (one pipeline, as a bulk producer would) into a
fresh queue served by one real `mlxq worker` process, and every job's stream is read back (XREAD from
0-0, each entry timed on arrival). The same jobs run twice: through a worker with
`MLXQ_MAX_BATCH_SEQUENCES=1` (one job at a time, today's path) and through one that batches up to
`--batch` sequences. Jobs are greedy with EOS masked, so each writes exactly `--max-tokens` tokens and
both paths must return identical token ids (checked, and printed).

Without `--model` a tiny random-weight checkpoint is written to a temporary folder (CPU-sized). On a
GPU host point `--model` at a real checkpoint and raise `--sizes`/`--batch`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from jobs import keys

ROOT = Path(__file__).resolve().parent.parent
WORDS = [
    "the",
    "queue",
    "holds",
    "jobs",
    "and",
    "a",
    "worker",
    "takes",
    "them",
    "one",
    "by",
    "one",
    "or",
    "many",
    "at",
    "once",
]


@dataclass
class Run:
    mode: str
    jobs: int
    wall_s: float
    tokens: int
    latencies: list[float]
    ttfts: list[float]
    token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.wall_s, 1e-9)


class Worker:
    """One `mlxq worker` process on its own queue."""

    def __init__(self, model: str, redis_url: str, max_batch: int, log_path: Path) -> None:
        self.queue_name = f"bench-batch-{max_batch}-{uuid.uuid4().hex[:8]}"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MLXQ_MAX_BATCH_SEQUENCES": str(max_batch),
            "MLXQ_LOG_LEVEL": "WARNING",
        }
        cmd = [sys.executable, "-m", "producer.cli", "worker", "--model", model, "--redis-url", redis_url]
        cmd += ["--queue", self.queue_name, "--name", self.queue_name]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.conn = redis.Redis.from_url(redis_url)
        self.queue = Queue(self.queue_name, connection=self.conn, serializer=JSONSerializer)

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.conn.exists(keys.worker_stats_key(self.queue_name)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start (exit {self.proc.poll()}); see {self._log.name}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self.queue.delete(delete_jobs=True)


def _payloads(n: int, max_tokens: int, prompt_words: int, tag: str) -> list[dict[str, Any]]:
    """Distinct prompts (they differ from the first token: no shared prefix), greedy, EOS masked."""
    out = []
    for i in range(n):
        words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(prompt_words)]
        out.append(
            {
                "prompt": f"{tag}{i}: " + " ".join(words),
                "max_tokens": max_tokens,
                "temperature": 0,
                "logit_bias": {"0": -100.0, "1": -100.0, "2": -100.0},
            }
        )
    return out


def run_jobs(worker: Worker, payloads: list[dict[str, Any]], mode: str, timeout: float) -> Run:
    """Enqueue all payloads at once; follow every stream to its end."""
    datas = [
        Queue.prepare_data(keys.GENERATE_FUNC, args=(p,), timeout=3600, result_ttl=600) for p in payloads
    ]
    conn = worker.conn
    t0 = time.perf_counter()
    with conn.pipeline() as pipe:
        jobs = worker.queue.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    ids = [str(j.id) for j in jobs]
    first: dict[str, float] = {}
    ended: dict[str, float] = {}
    cursor = {keys.stream_key(j): "0-0" for j in ids}
    owner = {keys.stream_key(j): j for j in ids}
    deadline = time.monotonic() + timeout
    while cursor:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(cursor)} of {len(ids)} jobs unfinished after {timeout}s")
        for key, entries in conn.xread(cursor, block=1000, count=1000) or []:  # type: ignore[arg-type]
            now = time.perf_counter()
            key = key.decode()
            for entry_id, fields in entries:
                cursor[key] = entry_id.decode()
                event = fields[b"event"].decode()
                job_id = owner[key]
                if event == "token":
                    first.setdefault(job_id, now)
                elif event in ("done", "error"):
                    if event == "error":
                        raise RuntimeError(f"job {job_id} failed: {fields[b'message'].decode()}")
                    ended[job_id] = now
                    del cursor[key]
                    break
    results = [json.loads(conn.get(keys.result_key(j)) or b"{}") for j in ids]
    return Run(
        mode=mode,
        jobs=len(ids),
        wall_s=max(ended.values()) - t0,
        tokens=sum(r["usage"]["completion_tokens"] for r in results),
        latencies=[ended[j] - t0 for j in ids],
        ttfts=[first[j] - t0 for j in ids if j in first],
        token_ids=[r["token_ids"] for r in results],
    )


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def render(runs: list[Run]) -> str:
    head = (
        f"{'mode':<14}{'jobs':>5}{'tokens':>8}{'wall s':>9}{'agg tok/s':>11}{'speedup':>9}"
        f"{'lat p50':>9}{'lat p95':>9}{'lat max':>9}{'ttft p50':>10}  same tokens"
    )
    lines = [head, "-" * len(head)]
    alone = {r.jobs: r for r in runs if r.mode == "one-at-a-time"}
    for r in runs:
        base = alone.get(r.jobs)
        speedup = r.tokens_per_s / base.tokens_per_s if base else float("nan")
        same = "-" if base is None or base is r else ("yes" if base.token_ids == r.token_ids else "NO")
        lines.append(
            f"{r.mode:<14}{r.jobs:>5}{r.tokens:>8}{r.wall_s:>9.2f}{r.tokens_per_s:>11.1f}{speedup:>8.2f}x"
            f"{statistics.median(r.latencies):>9.2f}{_pct(r.latencies, 0.95):>9.2f}{max(r.latencies):>9.2f}"
            f"{statistics.median(r.ttfts) if r.ttfts else float('nan'):>10.2f}  {same}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint folder; default: a tiny random checkpoint (CPU-sized)")
    p.add_argument("--sizes", default="1,8,32", help="concurrent jobs per run, comma-separated [1,8,32]")
    p.add_argument("--batch", type=int, help="MLXQ_MAX_BATCH_SEQUENCES of the batched worker [max size]")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/7")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    batch = args.batch or max(sizes)
    workdir = Path(tempfile.mkdtemp(prefix="mlxq-batch-bench-"))
    model = args.model
    if model is None:
        from worker.tiny_model import write_random_checkpoint

        model = str(write_random_checkpoint(workdir / "tiny", {"max_position_embeddings": 4096}))
    runs: list[Run] = []
    for mode, max_batch in (("one-at-a-time", 1), (f"batched({batch})", batch)):
        worker = Worker(model, args.redis_url, max_batch, workdir / f"worker-{max_batch}.log")
        try:
            worker.wait_ready()
            run_jobs(worker, _payloads(1, 4, 4, "warmup"), mode, args.timeout)
            for n in sizes:
                payloads = _payloads(n, args.max_tokens, args.prompt_words, f"size{n}-")
                runs.append(run_jobs(worker, payloads, mode, args.timeout))
                print(f"{mode} jobs={n} done in {runs[-1].wall_s:.2f}s", file=sys.stderr, flush=True)
        finally:
            worker.stop()
    runs.sort(key=lambda r: (r.jobs, r.mode != "one-at-a-time"))
    print(
        f"model={model} max_tokens={args.max_tokens} prompt_words={args.prompt_words} (latency from enqueue)"
    )
    print(render(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
