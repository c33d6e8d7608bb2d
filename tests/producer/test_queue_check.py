"""A job sent where no worker listens: the client warns at submission, and a timeout says why."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from mlxq.producer import AsyncClient, Client

REDIS_DB = 10


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    ours = [r for r in caplog.records if r.name == "mlxq.producer"]
    return [r.getMessage() for r in ours if r.levelno == logging.WARNING]


def test_submitting_to_an_unserved_queue_warns_once_and_a_timeout_says_why(
    client: Client, redis_conn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    redis_conn.sadd("rq:workers:served", "rq:worker:w1")  # how RQ registers a worker on its queues
    with caplog.at_level(logging.WARNING, logger="mlxq.producer"):
        first = client.submit_generate("hi", queue="nobody")
        client.submit_generate("hi", queue="nobody")
        client.submit_generate("hi", queue="served")
    assert [w for w in _warnings(caplog) if "serves" in w] == [
        "no worker serves 'nobody': its jobs wait in that queue until one does "
        "(start one with `mlxq worker --queue nobody`, or submit to a queue that is served)"
    ]
    with pytest.raises(TimeoutError, match=f"job {first.id} is still queued: no worker serves 'nobody'"):
        first.result(timeout=0.5)
    served = client.submit_generate("hi", queue="served")
    with pytest.raises(TimeoutError) as waited:
        served.result(timeout=0.5)
    assert "no worker serves" not in str(waited.value)


def test_the_async_client_warns_and_explains_too(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async def flow() -> None:
        async with AsyncClient(redis_url) as client:
            job = await client.submit_generate("hi", queue="nobody")
            with pytest.raises(TimeoutError, match="is still queued: no worker serves 'nobody'"):
                await job.result(timeout=0.5)

    with caplog.at_level(logging.WARNING, logger="mlxq.producer"):
        asyncio.run(flow())
    assert any("no worker serves 'nobody'" in w for w in _warnings(caplog))
