"""A Redis restart in the middle of a generation loses nothing and duplicates nothing.

Runs its own `redis-server` (append-only file, fsync always) on a free port, so it can be restarted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from redis_server import PrivateRedis
from worker_process import WorkerProcess

from mlxq.jobs.schema import TokenEvent
from mlxq.producer import Client
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


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
            private_redis.restart(down_s=1.0)
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
