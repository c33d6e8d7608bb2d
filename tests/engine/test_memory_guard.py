"""Out of memory: the engine empties its caches and tries once more, else the job fails clearly.

MLX on the Linux CPU build cannot be made to fail an allocation on purpose (its memory limit is not
enforced there, and a refused allocation ends the process), so the model raises MLX's own Metal
message here, the way a GPU worker sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxq.jobs.errors import OutOfMemory
from mlxq.jobs.schema import GenerateRequest, ScoreRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.cache.token_match import common_length
from mlxq.worker.engine.generation_batch import GenerationBatch, generate
from mlxq.worker.engine.scoring import PrefixScorer
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

METAL_OOM = (
    "[metal::malloc] Attempting to allocate 9663676416 bytes which is greater than the maximum allowed"
)
PROMPT = "The capital of France is Paris. " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 1024})


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return Engine.load(str(model_dir))


def _fail(
    monkeypatch: pytest.MonkeyPatch,
    engine: Engine,
    method: str,
    times: int,
    message: str = METAL_OOM,
    after: int = 0,
) -> list[int]:
    """Make the model's `method` raise `message` on calls after+1 .. after+times; returns the call count."""
    cls = type(engine.model)
    real = getattr(cls, method)
    calls = [0]

    def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if after < calls[0] <= after + times:
            raise RuntimeError(message)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, flaky)
    return calls


def _generate(engine: Engine, **fields: Any) -> Any:
    req = GenerateRequest(prompt=PROMPT, temperature=0, logit_bias={0: -100.0, 2: -100.0}, **fields)
    return generate(engine, req, lambda text, ids: None)


def test_one_allocation_failure_empties_the_caches_and_the_job_succeeds(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _generate(engine, max_tokens=8).token_ids
    assert engine.prefix_cache is not None and engine.prefix_cache.stats.bytes > 0
    _fail(monkeypatch, engine, "hidden", times=1)
    result = _generate(engine, max_tokens=8)
    assert result.token_ids == expected
    # The prefix cache was emptied before the retry; the row kept the cached prefix it had taken.
    assert engine.prefix_cache.stats.evictions > 0


def test_a_second_failure_fails_the_job_with_a_clear_error(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail(monkeypatch, engine, "hidden", times=2)
    with pytest.raises(OutOfMemory, match=r"even after emptying its caches.*metal::malloc"):
        _generate(engine, max_tokens=8)
    assert len(_generate(engine, max_tokens=3).token_ids) == 3  # the engine is fine afterwards


def test_no_retry_once_text_was_streamed(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail(monkeypatch, engine, "__call__", times=1, after=3)  # during decoding
    with pytest.raises(OutOfMemory, match="ran out of memory decoding 1 sequences together"):
        _generate(engine, max_tokens=20)
    assert engine.prefix_cache is not None and engine.prefix_cache.stats.bytes == 0  # emptied for the next


def test_other_runtime_errors_are_not_mistaken_for_memory(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fail(monkeypatch, engine, "hidden", times=1, message="[reshape] Cannot reshape array")
    with pytest.raises(RuntimeError, match="reshape"):
        _generate(engine, max_tokens=4)
    assert calls[0] == 1  # not retried


def test_scoring_retries_once_too(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    req = ScoreRequest.model_validate({"rows": [{"prompt": PROMPT, "candidates": [" the", " a"]}]})
    expected = engine.score(req).rows[0].logits
    _fail(monkeypatch, engine, "hidden", times=1)
    assert engine.score(req).rows[0].logits == pytest.approx(expected, rel=1e-5)


def test_a_score_batch_that_runs_out_of_memory_retries_in_smaller_batches(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, suffix_batches: list[int]
) -> None:
    rows = [{"prompt": PROMPT + f"Question {i}: it is", "candidates": [" the", " a"]} for i in range(8)]
    req = ScoreRequest.model_validate({"rows": rows})
    free = Engine.load(str(model_dir))
    expected = [r.logits for r in free.score(req).rows]
    ids = [free.tokenizer.encode(str(r["prompt"])) for r in rows]
    shared = min(common_length(ids[0], other) for other in ids[1:])
    scorer = PrefixScorer(free.model, kv_bytes_per_token=free.kv_bytes_per_token)
    four = scorer._kv_bytes(4, shared, max(len(i) for i in ids) - shared)  # what a batch of 4 rows holds
    engine = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0, score_kv_bytes=four))
    suffix_batches.clear()
    _fail(monkeypatch, engine, "hidden", times=1, after=1)  # the first suffix batch (after the prefix)
    got = engine.score(req).rows
    assert suffix_batches == [
        4,
        4,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
    ]  # the retry's batches hold a quarter of the bytes
    for row, want in zip(got, expected, strict=True):
        assert row.logits == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_batched_prefill_retries_once_then_its_jobs_fail_clearly(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:

    def run_batch() -> list[Any]:
        batch = GenerationBatch(engine, max_sequences=3)
        for i in range(3):
            req = GenerateRequest(prompt=f"{i} {PROMPT}", max_tokens=4, temperature=0, logit_bias={0: -100.0})
            batch.admit(str(i), req, lambda text, ids: None, lambda: False)
        done = [f for _ in range(20) for f in batch.step()]
        assert len(batch) == 0
        return sorted(done, key=lambda f: f.key)

    want = [f.result.token_ids for f in run_batch()]
    calls = _fail(monkeypatch, engine, "hidden", times=1)
    got = run_batch()
    assert [f.result.token_ids for f in got] == want and calls[0] >= 2  # retried, same tokens
    _fail(monkeypatch, engine, "hidden", times=2)  # wraps the first wrapper: fresh count
    failed = run_batch()
    assert all(isinstance(f.error, OutOfMemory) and "3 prompts together" in str(f.error) for f in failed)
