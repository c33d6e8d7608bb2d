"""A full Redis (`maxmemory` reached under `noeviction`) is a pause for workers, not an end: a worker
started on a full Redis lives and serves once memory frees, and a worker whose Redis fills up while it
generates keeps its jobs and finishes them, every token once, when memory frees. Producers are refused
with a clear error meanwhile. Each test runs its own `redis-server` with a small `maxmemory`."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import PrivateRedis, fill_memory, free_memory

from mlxq.jobs.schema import RestartEvent, TokenEvent
from mlxq.producer import Client, RedisFull
from mlxq.producer.status_report import collect, render

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, "--maxmemory", "16mb", "--maxmemory-policy", "noeviction")
    server.start()
    yield server
    server.stop()


def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def test_a_worker_started_on_a_full_redis_lives_and_serves_once_memory_frees(
    small_redis: PrivateRedis, model_dir: Path, spawn_worker: Any, reliability_report: dict[str, Any]
) -> None:
    conn = redis.Redis.from_url(small_redis.url)
    fill_memory(conn)
    worker = spawn_worker(model_dir, small_redis.url)
    _until(lambda: "redis is full" in worker.log(), 90, f"no word of a full Redis:\n{worker.log()}")
    time.sleep(2.0)  # several backed-off tries of its registration
    assert worker.proc.poll() is None, f"the worker exited on a full Redis:\n{worker.log()}"

    with Client(small_redis.url) as client:
        with pytest.raises(RedisFull, match="Redis is full"):
            client.submit_generate("refused", max_tokens=4)
        assert conn.llen("rq:queue:default") == 0

        full_for = time.monotonic()
        free_memory(conn)
        handles = [client.submit_generate(f"job {i}", max_tokens=6, temperature=0) for i in range(6)]
        results = [h.result(timeout=120) for h in handles]
        resumed_s = time.monotonic() - full_for
        assert all(r.usage.completion_tokens >= 1 for r in results)
        # RQ's own end of a job follows its result by a moment (the worker's finalizer)
        _until(lambda: [h.status() for h in handles] == ["finished"] * 6, 30, "jobs not finished in RQ")
    assert "redis accepts writes again" in worker.log()
    assert worker.proc.poll() is None
    reliability_report["worker_started_on_full_redis"] = {"jobs": 6, "served_within_s": round(resumed_s, 1)}
    conn.close()


def test_a_running_worker_keeps_its_jobs_through_a_full_redis(
    small_redis: PrivateRedis,
    model_dir: Path,
    no_eos: dict[int, float],
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    conn = redis.Redis.from_url(small_redis.url)
    worker = spawn_worker(model_dir, small_redis.url, MLXQ_STREAM_FLUSH_TOKENS="1")
    worker.wait_ready()
    tokens = 300
    with Client(small_redis.url) as client:
        handles = [
            client.submit_generate(f"story {i}", max_tokens=tokens, temperature=0, logit_bias=no_eos)
            for i in range(4)
        ]
        next(i for i in handles[0].stream(timeout=60) if isinstance(i.event, TokenEvent))
        fill_memory(conn)
        _until(lambda: "redis is full" in worker.log(), 30, f"no word of a full Redis:\n{worker.log()}")
        written = conn.xlen(f"mlxq:stream:{handles[0].id}")
        time.sleep(10.0)  # past the jobs' heartbeat TTL (8 s with MLXQ_HEARTBEAT_S=1): still theirs
        assert worker.proc.poll() is None, f"the worker exited on a full Redis:\n{worker.log()}"
        assert conn.xlen(f"mlxq:stream:{handles[0].id}") == written  # paused, not dropping tokens
        assert {h.status() for h in handles} <= {"started", "queued"}
        report = collect(conn)
        assert report.redis is not None and report.redis.full  # status still reads a full Redis
        assert "Redis is full" in render(report)

        free_memory(conn)
        results = [h.result(timeout=240) for h in handles]
        streams = [[i.event for i in h.stream(timeout=30)] for h in handles]
    for result, stream in zip(results, streams, strict=True):
        assert result.finish_reason == "length" and result.usage.completion_tokens == tokens
        assert not [e for e in stream if isinstance(e, RestartEvent)], "a job was run again"
        events = [e for e in stream if isinstance(e, TokenEvent)]
        indexes = [e.index for e in events]
        assert indexes == sorted(set(indexes)), "a token event was written twice"
        assert "".join(e.text for e in events) == result.text
        _until(lambda: [h.status() for h in handles] == ["finished"] * 4, 30, "jobs not finished in RQ")
    log = worker.log()
    assert "redis accepts writes again" in log and worker.proc.poll() is None
    reliability_report["worker_through_full_redis"] = {"jobs": 4, "lost": 0, "oom_pause_s": 10.0}
    conn.close()


def test_a_worker_on_an_evicting_redis_says_so_in_its_log(
    tmp_path: Path, model_dir: Path, spawn_worker: Any
) -> None:
    server = PrivateRedis(tmp_path, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    server.start()
    try:
        worker = spawn_worker(model_dir, server.url)
        worker.wait_ready()
        _until(lambda: "REDIS MAY LOSE JOBS" in worker.log(), 30, f"no warning:\n{worker.log()}")
        line = next(line for line in worker.log().splitlines() if "REDIS MAY LOSE JOBS" in line)
        assert "allkeys-lru" in line and "noeviction" in line
        stats = redis.Redis.from_url(server.url).hgetall(f"mlxq:worker:{worker_name(server.url)}")
        assert stats.get(b"redis_maxmemory_policy") == b"allkeys-lru"
    finally:
        server.stop()


def worker_name(url: str) -> str:
    """The one registered worker's name."""
    conn = redis.Redis.from_url(url)
    names = [m.decode() for m in conn.smembers("rq:workers")]
    conn.close()
    assert len(names) == 1, names
    return names[0].removeprefix("rq:worker:")
