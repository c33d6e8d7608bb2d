"""Which models live workers serve, and on which queues: what `GET /v1/models` lists and routes by.

Workers advertise themselves twice: RQ registers each in `rq:workers` (taken out when it dies), and
mlxq's worker keeps its stats hash `mlxq:worker:<name>` (model, queues) alive with a TTL a little past
its heartbeat. A model is served when a registered worker's stats hash names it; the hash expiring is
what ends a dead worker's advertisement even before RQ's maintenance notices it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio

from mlxq.jobs import keys

RQ_WORKERS_KEY = "rq:workers"
RQ_WORKER_PREFIX = "rq:worker:"


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


@dataclass(frozen=True)
class Served:
    """One model: the queues its live workers listen on, and how many workers serve it."""

    model: str
    queues: tuple[str, ...]
    workers: int
    created: int


async def read(conn: redis.asyncio.Redis) -> dict[str, Served]:
    """Model name -> where it is served, from the live workers' advertisements."""
    names = [_text(n).removeprefix(RQ_WORKER_PREFIX) for n in await conn.smembers(RQ_WORKERS_KEY)]
    if not names:
        return {}
    async with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hmget(keys.worker_stats_key(name), ["model", "queues", "started_at"])
        replies = await pipe.execute()
    queues: dict[str, set[str]] = {}
    workers: dict[str, int] = {}
    created: dict[str, int] = {}
    for model_raw, queues_raw, started_raw in replies:
        model = _text(model_raw)
        if not model:
            continue  # not an mlxq worker, or its advertisement expired
        queues.setdefault(model, set()).update(q for q in _text(queues_raw).split(",") if q)
        workers[model] = workers.get(model, 0) + 1
        started = int(float(_text(started_raw) or 0))
        created[model] = min(created.get(model, started), started)
    return {m: Served(m, tuple(sorted(queues[m])), workers[m], created[m]) for m in sorted(queues)}


class Catalog:
    """`read`, reused for `cache_s` seconds so that a burst of requests costs one look."""

    def __init__(self, conn: redis.asyncio.Redis, cache_s: float) -> None:
        self.conn = conn
        self.cache_s = cache_s
        self._at = -float("inf")
        self._models: dict[str, Served] = {}

    async def models(self) -> dict[str, Served]:
        now = time.monotonic()
        if now - self._at >= self.cache_s:
            self._models = await read(self.conn)
            self._at = now
        return self._models
