"""Redis's memory as producers see it: an evicting `maxmemory-policy` is warned of once per client
(`Client`, `AsyncClient`) and by `mlxq status`; a full Redis refuses a submit with a clear error at
once (nothing enqueued). Each test runs its own `redis-server` (the policy is server-wide)."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_server import PrivateRedis, fill_memory, free_memory

from mlxq.producer import AsyncClient, Client, RedisFull
from mlxq.producer.cli import main as cli_main
from mlxq.producer.status_report import collect, render

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


def _server(tmp_path: Path, *extra: str) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, *extra)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def lru_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    yield from _server(tmp_path, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    yield from _server(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The producer's warnings about Redis's memory (not those about queues nobody serves)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "mlxq.producer" and r.levelno == logging.WARNING and "maxmemory" in r.getMessage()
    ]


def test_a_client_warns_once_of_an_evicting_redis(
    lru_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="mlxq.producer"), Client(lru_redis.url) as client:
        for _ in range(3):
            client.submit_generate("hello", max_tokens=4)
    said = _warnings(caplog)
    assert len(said) == 1 and "REDIS MAY LOSE JOBS" in said[0] and "allkeys-lru" in said[0]
    assert "queued jobs included" in said[0]


def test_an_async_client_warns_once_of_an_evicting_redis(
    lru_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    async def submit() -> None:
        async with AsyncClient(lru_redis.url) as client:
            for _ in range(3):
                await client.submit_score([{"prompt": "a", "candidates": [" b"]}])

    with caplog.at_level(logging.WARNING, logger="mlxq.producer"):
        asyncio.run(submit())
    said = _warnings(caplog)
    assert len(said) == 1 and "allkeys-lru" in said[0]


def test_status_warns_of_an_evicting_redis(
    lru_redis: PrivateRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["--redis-url", lru_redis.url, "status"]) == 0
    out = capsys.readouterr().out
    assert "redis: maxmemory-policy=allkeys-lru" in out
    assert "warning: Redis maxmemory-policy is allkeys-lru" in out


def test_a_client_is_quiet_under_noeviction(
    small_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="mlxq.producer"), Client(small_redis.url) as client:
        client.submit_generate("hello", max_tokens=4)
    assert not [r for r in caplog.records if r.name == "mlxq.producer" and "maxmemory" in r.getMessage()]


def test_a_full_redis_refuses_a_submit_at_once_and_status_says_full(small_redis: PrivateRedis) -> None:
    conn = redis.Redis.from_url(small_redis.url)
    fill_memory(conn)
    with Client(small_redis.url) as client:
        with pytest.raises(RedisFull) as refused:
            client.submit_generate("hello", max_tokens=4, job_id="refused")
        assert isinstance(refused.value, redis.exceptions.OutOfMemoryError)
        assert "'refused' not enqueued: Redis is full" in str(refused.value)
        assert not conn.exists("rq:job:refused") and conn.llen("rq:queue:default") == 0

        report = collect(conn)
        assert report.redis is not None and report.redis.full
        assert "warning: Redis is full: writes are refused" in render(report)

        free_memory(conn)
        handle = client.submit_generate("hello", max_tokens=4, job_id="accepted")
        assert handle.status() == "queued"
    conn.close()
