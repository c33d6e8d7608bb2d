"""The RQ worker's heartbeats: one round trip each, and RQ's back-to-back repeats skipped."""

from __future__ import annotations

import pytest
import redis

from worker import rq_worker
from worker.rq_worker import MlxqWorker
from worker.stream_writer import StreamOptions


def _commands(conn: redis.Redis) -> dict[str, int]:
    stats = conn.info("commandstats")
    return {k: int(stats.get(f"cmdstat_{k}", {"calls": 0})["calls"]) for k in ("hset", "expire")}


def test_a_heartbeat_is_sent_once_and_a_repeat_of_it_at_once_is_skipped(
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(rq_worker.time, "monotonic", lambda: clock[0])
    w = MlxqWorker(["beats"], connection=redis_conn, stream_options=StreamOptions())
    idle_ttl = w.worker_ttl + 60

    def beat(timeout: int | None = None) -> tuple[bytes | None, int, dict[str, int]]:
        before = _commands(redis_conn)
        w.heartbeat(timeout)
        after = _commands(redis_conn)
        sent = {k: after[k] - before[k] for k in after}
        return redis_conn.hget(w.key, "last_heartbeat"), redis_conn.ttl(w.key), sent

    stamp, ttl, sent = beat()
    assert stamp is not None and idle_ttl - 2 <= ttl <= idle_ttl
    assert sent == {"hset": 1, "expire": 2}  # RQ's three commands, sent together
    clock[0] += 0.5
    again, _, sent = beat()  # RQ's loop beating again at once: nothing sent
    assert again == stamp and sent == {"hset": 0, "expire": 0}
    _, short, sent = beat(35)  # a job's shorter TTL always goes out
    assert short <= 35 and sent == {"hset": 1, "expire": 2}
    _, back, _ = beat()  # and so does the idle TTL after it
    assert idle_ttl - 2 <= back <= idle_ttl
    clock[0] += 1.5
    later, _, sent = beat()  # a second later the same TTL is refreshed again
    assert later != stamp and sent == {"hset": 1, "expire": 2}
