"""The producer side of the benchmarks: worker subprocesses, RQ enqueueing, reading streams back.

Jobs go in exactly as any producer puts them: `rq.Queue(..., serializer=JSONSerializer).enqueue_call`
with a JSON payload. Results come back through the job's Redis stream (XREAD from 0-0), timed on arrival.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.producer import rq_wire

ROOT = Path(__file__).resolve().parent.parent


class BenchWorker:
    """One `bench.worker_proc` subprocess serving its own queue; its log and timer records in `workdir`."""

    def __init__(
        self,
        model: str,
        redis_url: str,
        workdir: Path,
        label: str,
        *,
        env: dict[str, str] | None = None,
        burst: bool = False,
        cprofile: bool = False,
    ) -> None:
        self.label = label
        self.queue_name = f"bench-{label}-{uuid.uuid4().hex[:8]}"
        self.name = self.queue_name
        self.log_path = workdir / f"worker-{label}.log"
        self.records_path = workdir / f"records-{label}.jsonl"
        self.profile_path = workdir / f"cprofile-{label}.txt" if cprofile else None
        self.records_path.write_text("")
        self._cmd = [
            sys.executable,
            "-m",
            "bench.worker_proc",
            "--model",
            model,
            "--queue",
            self.queue_name,
            "--redis-url",
            redis_url,
            "--name",
            self.name,
            "--records",
            str(self.records_path),
        ]
        if burst:
            self._cmd.append("--burst")
        if self.profile_path is not None:
            self._cmd += ["--cprofile", str(self.profile_path)]
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self._env = {**os.environ, "PYTHONPATH": pythonpath, **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn = redis.Redis.from_url(redis_url)
        self.queue = Queue(self.queue_name, connection=self.conn, serializer=JSONSerializer)

    def start(self) -> BenchWorker:
        """Start the process (jobs may be enqueued before: a burst worker then finds them all waiting)."""
        self.proc = subprocess.Popen(
            self._cmd, cwd=ROOT, env=self._env, stdout=self._log, stderr=subprocess.STDOUT
        )
        return self

    def records(self, since: float = 0.0) -> list[dict[str, Any]]:
        """Timer records written since `since` (epoch seconds)."""
        out = []
        for line in self.records_path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec["start"] >= since:
                    out.append(rec)
        return out

    def finished(self, since: float, jobs: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Records since `since`, once `finish_streams` records cover `jobs` jobs: the worker writes
        such a record just after the `done` events it carries, so a reader may see `done` first."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.records(since)
            ended = sum(r["jobs"] for r in records if r.get("fn") == "finish_streams")
            if ended >= jobs or time.monotonic() > deadline:
                return records
            time.sleep(0.01)

    def event(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.records() if r.get("event") == name), None)

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (ready := self.event("ready")) is not None:
                return ready
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"worker {self.label} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"worker {self.label} not ready after {timeout}s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log_tail(self, n: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """Warm shutdown (SIGTERM: RQ finishes the job in hand), then kill if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> BenchWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def enqueue(queue: Queue, func: str, payload: dict[str, Any], timeout: int = 3600) -> str:
    """One job, as a producer would enqueue it."""
    job = queue.enqueue_call(func, args=(payload,), timeout=timeout, result_ttl=3600)
    return str(job.id)


def enqueue_many(queue: Queue, func: str, payloads: list[dict[str, Any]], timeout: int = 3600) -> list[str]:
    """Many jobs in one transaction (they land in the queue together), written as mlxq's bulk runner
    writes them (`rq_wire`)."""
    options = rq_wire.JobOptions(job_timeout=timeout, result_ttl=3600)
    jobs = [rq_wire.build_job(func, p, queue=queue.name, options=options) for p in payloads]
    with queue.connection.pipeline() as pipe:
        for job in jobs:
            rq_wire.queue_commands(pipe, job)
        pipe.execute()
    return [job.id for job in jobs]


@dataclass
class StreamTrace:
    """What a reader saw on one job's stream: (arrival time, fields) per entry."""

    t_submit: float
    entries: list[tuple[float, dict[str, str]]] = field(default_factory=list)

    @property
    def done(self) -> dict[str, str] | None:
        last = self.entries[-1][1] if self.entries else None
        return last if last is not None and last.get("event") in ("done", "error") else None

    def token_entries(self) -> list[tuple[float, int]]:
        return [(t, len(json.loads(f["ids"]))) for t, f in self.entries if f.get("event") == "token"]

    def ttft_s(self) -> float | None:
        tokens = self.token_entries()
        return tokens[0][0] - self.t_submit if tokens else None

    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first entry over the time from the first to the last token entry."""
        tokens = self.token_entries()
        if len(tokens) < 2:
            return None
        n = sum(k for _, k in tokens[1:])
        return n / max(tokens[-1][0] - tokens[0][0], 1e-9)

    def completion_tokens(self) -> int:
        return sum(k for _, k in self.token_entries())


def _decode(fields: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in fields.items()}


def follow(conn: redis.Redis, job_ids: list[str], t_submit: float, timeout: float) -> dict[str, StreamTrace]:
    """Read the jobs' streams from 0-0 until each ends (done/error); every entry timed on arrival."""
    traces = {j: StreamTrace(t_submit) for j in job_ids}
    last = {keys.stream_key(j): "0-0" for j in job_ids}
    by_key = {keys.stream_key(j): j for j in job_ids}
    deadline = time.monotonic() + timeout
    while last:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(last)} of {len(job_ids)} streams did not end within {timeout}s")
        reply = conn.xread(last, block=1000, count=1000)
        now = time.perf_counter()
        for key, entries in reply or []:
            k = key.decode()
            trace = traces[by_key[k]]
            for entry_id, fields in entries:
                trace.entries.append((now, _decode(fields)))
                last[k] = entry_id.decode()
            if trace.done is not None:
                del last[k]
    return traces


def job_failures(conn: redis.Redis, job_ids: list[str]) -> list[str]:
    """Error messages of jobs whose stream ended in `error`."""
    out = []
    for j in job_ids:
        entries = conn.xrevrange(keys.stream_key(j), count=1)
        if entries and entries[0][1].get(b"event") == b"error":
            out.append(entries[0][1].get(b"message", b"").decode())
    return out


def cleanup(conn: redis.Redis, job_ids: list[str], queue_name: str | None = None) -> None:
    """Delete what the benchmark's jobs left in Redis (streams, results, RQ's job and queue keys)."""
    names = [
        k
        for j in job_ids
        for k in (keys.stream_key(j), keys.result_key(j), keys.rq_job_key(j), f"rq:results:{j}")
    ]
    if queue_name is not None:
        names += [k.decode() for k in conn.scan_iter(match=f"rq:*{queue_name}*", count=1000)]
    for i in range(0, len(names), 1000):
        conn.delete(*names[i : i + 1000])


@contextmanager
def private_redis() -> Iterator[str]:
    """A throw-away Redis (or valkey) server on a free port, so nothing else shares its counters."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise FileNotFoundError("no redis-server or valkey-server on PATH for --redis-url private")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        conn = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                conn.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
