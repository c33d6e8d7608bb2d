"""Redis's memory as the worker sees it: an evicting `maxmemory-policy` warned of at start and when it
changes, and a full Redis (OOM replies) waited out by the worker's writes instead of failing jobs.

Each test runs its own `redis-server` (the policy and memory limit are server-wide)."""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_server import PrivateRedis, fill_memory, free_memory

from mlxq.jobs.redis_memory import MemoryPolicy, from_config, from_info, read_policy
from mlxq.worker.redis_full import FullRedis
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.stream_writer import StreamOptions, StreamWriter, retrying

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


def _server(tmp_path: Path, *extra: str) -> Iterator[redis.Redis]:
    server = PrivateRedis(tmp_path, *extra)
    server.start()
    conn = redis.Redis.from_url(server.url)
    try:
        yield conn
    finally:
        conn.close()
        server.stop()


@pytest.fixture
def lru_redis(tmp_path: Path) -> Iterator[redis.Redis]:
    yield from _server(tmp_path, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")


@pytest.fixture
def safe_redis(tmp_path: Path) -> Iterator[redis.Redis]:
    yield from _server(tmp_path, "--maxmemory", "64mb", "--maxmemory-policy", "noeviction")


def test_what_each_policy_means_for_mlxq() -> None:
    assert MemoryPolicy("noeviction", 1 << 20).warning() is None
    lru = MemoryPolicy("allkeys-lru", 1 << 20).warning() or ""
    assert "queued jobs included" in lru and "noeviction" in lru
    volatile = MemoryPolicy("volatile-ttl", 1 << 20).warning() or ""
    assert "token streams" in volatile and "queued jobs stay" in volatile
    assert "maxmemory is 0" in (MemoryPolicy("allkeys-lfu", 0).warning() or "")
    unknown = MemoryPolicy(None, refused="INFO: no permission")
    assert unknown.warning() is None and "no permission" in (unknown.unknown_note() or "")
    assert from_info({"maxmemory_policy": "allkeys-lru", "maxmemory": 5, "used_memory": 7}) == MemoryPolicy(
        "allkeys-lru", 5, 7
    )
    assert MemoryPolicy("noeviction", 5, 7).full and not MemoryPolicy("noeviction", 0, 7).full
    assert from_config({b"maxmemory-policy": b"volatile-lru", b"maxmemory": b"0"}) == MemoryPolicy(
        "volatile-lru", 0
    )
    assert from_info({}) is None


def test_worker_warns_at_start_and_when_the_policy_changes(
    lru_redis: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    worker = MlxqWorker(["mem"], connection=lru_redis, stream_options=StreamOptions())
    with caplog.at_level(logging.WARNING, logger="mlxq.worker.eviction_watch"):
        worker.register_birth()
    said = [r.getMessage() for r in caplog.records if r.name == "mlxq.worker.eviction_watch"]
    assert len(said) == 1 and "REDIS MAY LOSE JOBS" in said[0] and "allkeys-lru" in said[0]
    assert worker.evictions.fields() == {"redis_maxmemory_policy": "allkeys-lru"}

    caplog.clear()
    worker.evictions.every_s = 0.0  # re-read at every maintenance run
    lru_redis.config_set("maxmemory-policy", "volatile-lru")
    with caplog.at_level(logging.WARNING, logger="mlxq.worker.eviction_watch"):
        worker.run_maintenance_tasks()
        worker.run_maintenance_tasks()  # unchanged since: said once, not at every run
    said = [r.getMessage() for r in caplog.records if r.name == "mlxq.worker.eviction_watch"]
    assert len(said) == 1 and "volatile-lru" in said[0] and "token streams" in said[0]
    worker.register_death()  # type: ignore[no-untyped-call]


def test_worker_is_quiet_under_noeviction(safe_redis: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    worker = MlxqWorker(["mem"], connection=safe_redis, stream_options=StreamOptions())
    with caplog.at_level(logging.INFO, logger="mlxq.worker.eviction_watch"):
        worker.register_birth()
    assert not [r for r in caplog.records if r.name == "mlxq.worker.eviction_watch"]
    assert worker.evictions.fields() == {"redis_maxmemory_policy": "noeviction"}
    worker.register_death()  # type: ignore[no-untyped-call]


def test_a_user_who_may_not_ask_gets_a_note_not_an_error(safe_redis: redis.Redis) -> None:
    port = safe_redis.connection_pool.connection_kwargs["port"]
    safe_redis.acl_setuser(
        "blind", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-info", "-config"]
    )
    blind = redis.Redis(port=port, username="blind", password="pw")
    reading = read_policy(blind)
    blind.close()
    assert reading.unknown and "INFO" in (reading.refused or "") and "CONFIG GET" in (reading.refused or "")


def test_a_stream_write_waits_for_a_full_redis_and_lands_once(tmp_path: Path) -> None:
    for conn in _server(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction"):
        fill_memory(conn)
        full = FullRedis()
        options = StreamOptions(flush_tokens=1, retry_attempts=2, retry_max_wait_s=0.2, full=full)
        writer = StreamWriter(conn, "full-job", options)
        wrote = threading.Thread(target=writer, args=("hello", [1, 2]))
        wrote.start()
        wrote.join(1.5)  # well past two attempts: an OOM reply is waited out, not counted as one
        assert wrote.is_alive() and full.full and full.refusals >= 2
        free_memory(conn)
        wrote.join(10)
        assert not wrote.is_alive() and not full.full
        entries = conn.xrange("mlxq:stream:full-job")
        assert [fields[b"text"] for _, fields in entries] == [b"hello"]


def test_a_full_redis_waited_for_a_bounded_time_raises_the_oom_error(tmp_path: Path) -> None:
    for conn in _server(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction"):
        fill_memory(conn)
        options = StreamOptions(retry_max_wait_s=0.05, full_wait_s=0.3)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            retrying(options)(conn.set, "k", "v")
        assert options.full.full
