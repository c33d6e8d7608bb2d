"""A job's timeout reaches every piece of its work, in a real worker (real Redis, real RQ, this process).

The worker's clock (`job_deadline.monotonic`) is driven by the work itself: every model forward takes
10 s of it, and tokenizing a text marked `SLOW` takes 100 s. A job's deadline therefore passes at a
known point of its work whatever the machine's speed: during tokenizing, or after a few chunks of a
long prefill (of a generation job or a score batch). The job fails with RQ's timeout reason, alone; the
canary jobs beside it finish.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.jobs.schema import ScoreRequest
from mlxq.producer import Client, JobFailed
from mlxq.worker import job_deadline
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.models import llama
from mlxq.worker.service import WorkerService
from mlxq.worker.settings import WorkerSettings

PROMPT = "The capital of France is Paris. "
CHUNK = 16
FORWARD_S = 10.0
SLOW_S = 100.0


class WorkClock:
    """The worker's clock, moved by its work: `FORWARD_S` per forward, `SLOW_S` per `SLOW` text."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.widths: list[int] = []  # every forward's width (tokens per row)

    def forward(self, width: int) -> None:
        self.widths.append(width)
        self.now += FORWARD_S


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return Engine.load(str(model_dir), EngineOptions(prefill_chunk=CHUNK, prefix_cache_bytes=0))


@pytest.fixture
def clock(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> WorkClock:
    work = WorkClock()
    monkeypatch.setattr(job_deadline, "monotonic", lambda: work.now)
    forward = llama.LlamaModel.__call__

    def timed(self: llama.LlamaModel, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        work.forward(inputs.shape[1] if inputs.ndim == 2 else 1)  # (rows,): a flat decode step
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaModel, "__call__", timed)
    encode_many = engine.tokenizer.encode_many

    def slow_encode_many(texts: Any, *args: Any) -> list[list[int]]:
        work.now += SLOW_S * sum("SLOW" in t for t in texts)
        return encode_many(texts, *args)

    monkeypatch.setattr(engine.tokenizer, "encode_many", slow_encode_many)
    return work


@pytest.fixture
def serve(model_dir: Path, redis_url: str, engine: Engine) -> Iterator[Any]:
    """Run an in-process worker until its queue is empty (RQ's signal handlers put back afterwards)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    settings = WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir),
        redis_url=redis_url,
        queues=["default"],
        prefill_chunk=CHUNK,
        warm_up=False,  # the clock counts the model's forwards: the warm-up's are no job's
        _env_file=None,
    )

    def run() -> None:
        assert WorkerService.start(settings, engine=engine).work(burst=True) == 0

    yield run
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _failure(client: Client, job_id: str) -> str:
    with pytest.raises(JobFailed) as failed:
        client.job(job_id).result(timeout=5)
    return str(failed.value)


def test_generation_jobs_time_out_in_tokenizing_and_between_prefill_chunks(
    client: Client, engine: Engine, clock: WorkClock, serve: Any, no_eos: dict[int, float]
) -> None:
    long_prompt = PROMPT * 20
    chunks = -(-len(engine.tokenizer.encode(long_prompt)) // CHUNK)
    assert chunks >= 10
    long = client.submit_generate(long_prompt, max_tokens=2, job_timeout=35)
    canary = client.submit_generate("hi", max_tokens=3, temperature=0, logit_bias=no_eos, job_timeout=10**6)
    serve()
    assert "Task exceeded maximum timeout value (35 seconds)" in _failure(client, long.id)
    assert canary.result(timeout=5).usage.completion_tokens == 3
    # The long prompt's prefill stopped after the chunks its 35 s allowed, far from its end.
    assert 2 <= clock.widths.count(CHUNK) <= 4 < chunks
    # The worker's clock is one for all its jobs: a slow one runs beside a canary of its own.
    slow = client.submit_generate("SLOW to tokenize", max_tokens=2, job_timeout=50)
    canary = client.submit_generate("hi", max_tokens=3, temperature=0, logit_bias=no_eos, job_timeout=10**6)
    clock.widths.clear()
    serve()
    assert "Task exceeded maximum timeout value (50 seconds)" in _failure(client, slow.id)
    assert canary.result(timeout=5).usage.completion_tokens == 3


def test_a_score_job_times_out_alone_and_its_batch_mates_are_scored(
    client: Client, engine: Engine, clock: WorkClock, serve: Any
) -> None:
    rows = [
        {"prompt": PROMPT * 20 + f"Question {i}? Answer:", "candidates": [" a", " the"]} for i in range(3)
    ]
    canary_rows = [{"prompt": "Question? Answer:", "candidates": [" a", " the"]}]
    want = engine.score(ScoreRequest.model_validate({"rows": canary_rows}))
    clock.widths.clear()
    long = client.submit_score(rows, job_timeout=35)
    canary = client.submit_score(canary_rows, job_timeout=10**6)
    serve()
    assert "Task exceeded maximum timeout value (35 seconds)" in _failure(client, long.id)
    assert canary.result(timeout=5).rows == want.rows
    assert 2 <= clock.widths.count(CHUNK) <= 4  # the long rows' shared prefix: stopped after a few chunks
    # Rows are tokenized together: a slow one costs its batch-mates' time too (the clock is the worker's).
    slow = client.submit_score([{"prompt": "SLOW to tokenize", "candidates": [" a"]}], job_timeout=50)
    canary = client.submit_score(canary_rows, job_timeout=10**6)
    serve()
    assert "Task exceeded maximum timeout value (50 seconds)" in _failure(client, slow.id)
    assert canary.result(timeout=5).rows == want.rows
