"""A worker's warm-up: it runs before the first job, is logged with its time, can be turned off, and
leaves nothing in Redis or in the prefix cache that changes a job's result."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import redis

from mlxq.jobs.schema import ScoreRequest
from mlxq.producer import Client
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.warm_up import WarmUpShapes, batch_sizes, prefill_widths, warm_up
from mlxq.worker.service import WorkerService
from mlxq.worker.settings import WorkerSettings

REDIS_DB = 14

ROWS = {
    "rows": [
        {"prompt": "the cat sat on the mat, then:", "candidates": ["b", "d"]},
        {"prompt": "the cat sat on the mat, so:", "candidates": ["b", "c"]},
    ]
}


def _settings(redis_url: str, model_dir: Path, **kw: object) -> WorkerSettings:
    return WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir),
        redis_url=redis_url,
        prefill_chunk=64,
        max_batch_sequences=4,
        _env_file=None,
        **kw,
    )


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_worker_warms_up_before_its_first_job_and_logs_how_long_it_took(
    redis_url: str, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = WorkerService.start(_settings(redis_url, model_dir, warm_up=True))
    with Client(redis_url) as client:
        score = client.submit_score(ROWS["rows"])
        generate = client.submit_generate("hello there", max_tokens=2)
        with caplog.at_level(logging.INFO):
            assert service.work(burst=True) == 0
        assert score.result(timeout=5) and generate.result(timeout=5)
    lines = _messages(caplog)
    warm = [i for i, m in enumerate(lines) if m.startswith("warm-up done seconds=")]
    jobs = [i for i, m in enumerate(lines) if m.startswith(("score done", "generate done"))]
    assert len(warm) == 1 and len(jobs) == 2, lines
    assert warm[0] < min(jobs)
    assert float(lines[warm[0]].split("seconds=")[1].split()[0]) > 0
    assert "batch_sizes=1,2,4" in lines[warm[0]] or "batch_sizes=1,4" in lines[warm[0]]


def test_by_default_a_worker_warms_up_on_a_gpu_only(
    redis_url: str, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset, the setting follows the device: MLX's CPU build builds no kernels, and a warm-up there
    costs what the jobs' own forwards would (a real model's worker took over a minute to start)."""
    with WorkerService.start(_settings(redis_url, model_dir)) as service, caplog.at_level(logging.INFO):
        assert service.settings.warm_up is None
        service.warm_up()
    warmed = any(m.startswith("warm-up done") for m in _messages(caplog))
    assert warmed == service.engine.on_gpu


def test_a_worker_told_not_to_warm_up_takes_its_first_job_at_once(
    redis_url: str, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = WorkerService.start(_settings(redis_url, model_dir, warm_up=False))
    with Client(redis_url) as client:
        job = client.submit_score(ROWS["rows"])
        with caplog.at_level(logging.INFO):
            assert service.work(burst=True) == 0
        assert job.result(timeout=5)
    assert not any(m.startswith("warm-up") for m in _messages(caplog))


def _contents(conn: redis.Redis) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key of the DB with its serialized value and whether it has a TTL."""
    return {k: (conn.dump(k), conn.ttl(k) > 0) for k in conn.keys("*")}


def test_warm_up_leaves_no_trace_in_redis(redis_url: str, model_dir: Path) -> None:
    with (
        redis.Redis.from_url(redis_url) as conn,
        WorkerService.start(_settings(redis_url, model_dir)) as service,
    ):
        with Client(redis_url) as client:
            client.submit_score(ROWS["rows"])  # a queued job: the warm-up must not take it
        before = _contents(conn)
        assert before
        service.warm_up()
        assert _contents(conn) == before


def test_warm_up_leaves_the_prefix_cache_as_it_was_and_results_unchanged(model_dir: Path) -> None:
    """Two engines on one checkpoint, one warmed up: the same jobs score alike, and the warmed engine's
    prefix cache holds only what those jobs put there."""
    cold = Engine.load(str(model_dir), EngineOptions(prefill_chunk=64, dtype="float32"))
    warmed = Engine.load(str(model_dir), EngineOptions(prefill_chunk=64, dtype="float32"))
    assert warmed.prefix_cache is not None and cold.prefix_cache is not None
    stats_before = warmed.prefix_cache.stats.as_dict()
    parts = warm_up(warmed, WarmUpShapes(max_sequences=4, score_rows=8))
    assert set(parts) == {"prefill", "decode", "batches", "score"} and all(s > 0 for s in parts.values())
    assert warmed.prefix_cache.stats.as_dict() == stats_before
    request = ScoreRequest.model_validate(ROWS)
    for _ in range(2):  # cold, then from the prefix cache
        a, b = cold.score(request), warmed.score(request)
        for ra, rb in zip(a.rows, b.rows, strict=True):
            assert ra.logprobs == pytest.approx(rb.logprobs, abs=1e-5)
        assert (a.input_tokens, a.cached_tokens) == (b.input_tokens, b.cached_tokens)
    assert warmed.prefix_cache.stats.as_dict() == cold.prefix_cache.stats.as_dict()


def test_the_batch_sizes_warmed_are_those_a_generation_batch_pads_to() -> None:
    assert batch_sizes(1, padded=True) == [1]
    assert batch_sizes(8, padded=True) == [1, 2, 4, 8]
    assert batch_sizes(6, padded=True) == [1, 2, 4, 6]
    assert batch_sizes(8, padded=False) == [1, 8]


def test_every_prefill_width_a_chunk_pads_to_is_warmed() -> None:
    assert prefill_widths(2048, padded=True) == [16, 32, 64, 128, 192, 256, 384, 512, 1024, 1536, 2048]
    assert prefill_widths(100, padded=True) == [16, 32, 64, 100]  # a chunk of 100: never padded past it
    assert prefill_widths(2048, padded=False) == [8, 2048]


def test_with_padded_shapes_the_warm_up_runs_each_width_and_decodes_past_the_first_cache_steps(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each warm-up prompt is its own (none a cached prefix of another, which would skip its prefill),
    so every padded width reaches the model; and one sequence decodes past two cache steps."""
    from mlxq.worker.engine.models import llama

    engine = Engine.load(str(model_dir), EngineOptions(prefill_chunk=64, dtype="float32", pad_shapes=True))
    seen: list[tuple[int, int]] = []  # (rows, width) of every forward
    forward = llama.LlamaModel.__call__

    def recorded(self: llama.LlamaModel, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((inputs.shape[0], inputs.shape[1] if inputs.ndim == 2 else 1))  # (rows,): a flat step
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaModel, "__call__", recorded)
    shapes = WarmUpShapes(max_sequences=2, score_rows=4, decode_positions=40)
    warm_up(engine, shapes)
    widths = {w for rows, w in seen if rows == 1 and w > 1}
    assert set(prefill_widths(64, padded=True)) <= widths, sorted(widths)
    assert sum(1 for rows, w in seen if (rows, w) == (1, 1)) >= 40  # the lone sequence's decode steps
