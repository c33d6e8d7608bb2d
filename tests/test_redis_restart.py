"""A Redis restart in the middle of a generation loses nothing and duplicates nothing.

Runs its own `redis-server` (append-only file, fsync always) on a free port, so it can be restarted.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from worker_process import WorkerProcess

from jobs.schema import TokenEvent
from producer import Client
from worker.tiny_model import write_random_checkpoint

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    def __init__(self, folder: Path) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL)
        conn = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                conn.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()  # SIGTERM: Redis flushes the append-only file and exits
            self.proc.wait(10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def test_generation_survives_a_redis_restart(private_redis: PrivateRedis, tmp_path: Path) -> None:
    model = write_random_checkpoint(tmp_path / "tiny", {"max_position_embeddings": 4096})
    worker = WorkerProcess(model, private_redis.url, tmp_path / "w.log", MLXQ_STREAM_FLUSH_TOKENS="1")
    try:
        worker.wait_ready()
        with Client(private_redis.url) as client:
            job = client.submit_generate(
                "The capital of France is", max_tokens=2500, temperature=0, logit_bias={0: -100.0, 2: -100.0}
            )
            next(i for i in job.stream(timeout=30) if isinstance(i.event, TokenEvent))
            private_redis.stop()
            time.sleep(1.0)
            private_redis.start()
            result = job.result(timeout=120)
            tokens = [i.event for i in job.stream(timeout=30) if isinstance(i.event, TokenEvent)]
        assert result.finish_reason == "length" and result.usage.completion_tokens == 2500
        indexes = [t.index for t in tokens]
        assert indexes == sorted(set(indexes)), "a token event was written twice"
        assert [i for t in tokens for i in t.ids] == result.token_ids
        assert "".join(t.text for t in tokens) == result.text
        assert "redis write retry" in worker.log() or "redis error" in worker.log()
        assert worker.proc.poll() is None, "the worker died with Redis"
    finally:
        worker.stop()
