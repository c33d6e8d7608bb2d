"""End to end for a model with sliding windows (Gemma 3: windowed local layers around a global one):
a worker process serves generation and score jobs over Redis, several at once, and every job's
result is what the engine computes for it alone in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from worker_process import WorkerProcess

from mlxq.jobs.schema import GenerateRequest
from mlxq.producer import Client
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.generation_batch import generate

REDIS_DB = 12
PROMPT = "The capital of France is Paris. " * 4  # far longer than the window


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A random Gemma 3 with a 12-token window on two layers of three."""
    from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "sliding_window": 12,
        "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 32,
        "max_position_embeddings": 4096,
    }
    return write_random_checkpoint(tmp_path_factory.mktemp("gemma3"), config, std=0.2)


def test_generation_and_score_jobs_of_a_windowed_model(
    worker: WorkerProcess, client: Client, model_dir: Path
) -> None:
    engine = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0))
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    prompts = [PROMPT + f"#{i}" * i for i in range(4)]
    jobs = [
        client.submit_generate(p, max_tokens=12 + 4 * i, temperature=0, logit_bias=no_eos)
        for i, p in enumerate(prompts)
    ]
    results = [job.result(timeout=60) for job in jobs]
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        request = GenerateRequest(prompt=prompt, max_tokens=12 + 4 * i, temperature=0, logit_bias=no_eos)
        assert result.token_ids == generate(engine, request, lambda _t, _i: None).token_ids, i
    again = client.submit_generate(prompts[2], max_tokens=20, temperature=0, logit_bias=no_eos).result(
        timeout=60
    )
    assert (
        again.usage.cached_tokens > 12 and again.token_ids == results[2].token_ids
    )  # restored past the window
    rows = [
        {"prompt": PROMPT + "The capital of France is", "candidates": [" the", " a"]},
        {"prompt": PROMPT + "The capital of Italy is", "candidates": [" is"]},
    ]
    scored = client.submit_score(rows).result(timeout=60)
    assert scored.rows[1].cached_tokens > 12
    for row, got in zip(rows, scored.rows, strict=True):
        prompt = str(row["prompt"])
        ids = engine.tokenizer.encode(prompt)
        logits = engine.model(mx.array([ids]))[0, -1]
        cand = [engine.tokenizer.encode(prompt + c)[-1] for c in row["candidates"]]
        assert got.logits == pytest.approx(logits[mx.array(cand)].tolist(), rel=1e-4, abs=1e-5)
