"""Requests past the worker's limits (settings with safe defaults), in a real worker (real Redis, real RQ,
this process): each fails alone, before the expensive step, with a message naming the field and the
limit, and the worker serves the job behind it."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from mlxq.jobs import MAX_NESTING_DEPTH, keys, parse_generate, too_deep
from mlxq.jobs.errors import InvalidRequest
from mlxq.producer import Client, JobFailed
from mlxq.worker.service import WorkerService, load_engine
from mlxq.worker.settings import WorkerSettings


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def test_nesting_is_measured_without_recursion_and_named() -> None:
    assert too_deep({"a": [{"b": []}]}, 4) is None
    assert too_deep({"a": [{"b": []}]}, 3) == "a[0].b..."
    deep: Any = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert too_deep({"prompt": "x", "logit_bias": deep}, MAX_NESTING_DEPTH) == "logit_bias[0][0]..."
    with pytest.raises(InvalidRequest, match=r"logit_bias\.a\.a\.\.\. is nested more than 32 levels deep"):
        parse_generate({"prompt": "x", "logit_bias": _nested(40)})
    tool = {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "string"}}}}
    message = {"role": "user", "content": "hi", "tools": [{"function": {"parameters": tool}}]}
    assert parse_generate({"messages": [message]}).messages is not None  # real extra fields fit


def test_each_request_past_a_limit_fails_alone_naming_it(
    model_dir: Path, redis_url: str, redis_conn: redis.Redis, client: Client, no_eos: dict[int, float]
) -> None:
    queue = Queue("default", connection=redis_conn, serializer=JSONSerializer)
    user = {"role": "user", "content": "hi"}
    gen, score = keys.GENERATE_FUNC, keys.SCORE_FUNC
    row = {"prompt": "x", "candidates": [" a"]}
    limit = "this worker takes at most"
    bad: dict[str, tuple[str, dict[str, Any], str]] = {
        "messages": (gen, {"messages": [user] * 5}, f"holds 5 messages; {limit} 4 (MLXQ_MAX_MESSAGES)"),
        "nesting": (gen, {"messages": [{**user, "name": _nested(12)}]}, "messages[0].name... is nested"),
        "score-nesting": (score, {"rows": [row], "x": _nested(9)}, "x.a.a... is nested more than 8 levels"),
        "stop-count": (gen, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "at most 16 items"),
        "stops-setting": (gen, {"prompt": "hi", "stop": ["a", "b", "c"]}, f"{limit} 2 (MLXQ_MAX_STOPS)"),
        "stop-chars": (gen, {"prompt": "hi", "stop": ["x" * 65_536]}, f"{limit} 4096 (MLXQ_MAX_STOP_CHARS)"),
        "prompt-chars": (gen, {"prompt": "x" * 100_001}, f"{limit} 100000 (MLXQ_MAX_PROMPT_CHARS)"),
    }
    ids = {name: queue.enqueue_call(func, args=(payload,)).id for name, (func, payload, _) in bad.items()}
    canary = client.submit_generate("hi", max_tokens=3, temperature=0, logit_bias=no_eos)
    settings = WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir),
        redis_url=redis_url,
        queues=["default"],
        max_messages=4,
        max_nesting_depth=8,
        max_prompt_chars=100_000,
        max_stops=2,
        _env_file=None,
    )
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        service = WorkerService.start(settings, engine=load_engine(settings))
        assert service.work(burst=True) == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    for name, (_, _, reason) in bad.items():
        with pytest.raises(JobFailed) as failed:
            client.job(ids[name]).result(timeout=5)
        assert "MLXQ_MAX_NESTING_DEPTH" in str(failed.value) or "nesting" not in name
        assert reason in str(failed.value), name
    assert canary.result(timeout=5).usage.completion_tokens == 3
    assert service.results._queued_s == {}  # nothing the failed jobs' streams noted stays behind
