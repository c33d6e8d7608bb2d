"""The gateway's one-round-trip submission (`producer.gateway.submission`) against real Redis and RQ:
its jobs are the ones the Python clients enqueue, a claim over the key's limit writes nothing, a
script tried again after a lost reply writes nothing twice, and a full Redis is `RedisFull`."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
import redis
from redis_server import PrivateRedis, fill_memory
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.producer import AsyncClient, ProducerSettings, RedisFull, rq_wire
from mlxq.producer.gateway import limits
from mlxq.producer.gateway.app import Gateway
from mlxq.producer.gateway.settings import GatewaySettings
from mlxq.producer.gateway.submission import Submitter

REDIS_DB = 13
KEY = "0" * 64  # an API key's digest
T = TypeVar("T")


def _run(redis_url: str, scenario: Callable[[AsyncClient, Submitter], Awaitable[T]]) -> T:
    async def main() -> T:
        settings = ProducerSettings(redis_retry_initial_wait_s=0.01, redis_retry_attempts=2)
        async with AsyncClient(redis_url, settings=settings) as client:
            return await scenario(client, Submitter(client))

    return asyncio.run(main())


def _job(client: AsyncClient, prompt: str, queue: str = "gw-q", at_front: bool = False) -> rq_wire.WireJob:
    options = client.settings.job_options(at_front=at_front, meta={"api_key": "k"})
    return client.wire_job(keys.GENERATE_FUNC, {"prompt": prompt, "max_tokens": 2}, options, queue)


def test_its_jobs_are_those_the_clients_enqueue(redis_url: str, redis_conn: redis.Redis) -> None:
    async def scenario(client: AsyncClient, submitter: Submitter) -> tuple[list[str], str]:
        first, second, ahead = _job(client, "a"), _job(client, "b"), _job(client, "c", at_front=True)
        context = {"kind": "chat", "include_usage": ""}
        assert await submitter.submit(KEY, 8, [first, second], "ctx-key", context, 120) is None
        assert await submitter.submit(KEY, 8, [ahead]) is None
        piped = replace(first, id=client.tenant.job_id())  # the Python clients' transaction, to compare
        async with client.connection.pipeline() as pipe:
            rq_wire.queue_commands(pipe, piped)
            await pipe.execute()
        return [first.id, second.id, ahead.id], piped.id

    (first, second, ahead), piped = _run(redis_url, scenario)
    stored = redis_conn.hgetall(keys.rq_job_key(first))
    assert stored == redis_conn.hgetall(keys.rq_job_key(piped))  # field for field (one build_job)
    assert redis_conn.lrange(keys.rq_queue_key("gw-q"), 0, -1) == [
        i.encode() for i in (ahead, first, second, piped)
    ]
    assert redis_conn.smembers(keys.RQ_QUEUES_SET) == {keys.rq_queue_key("gw-q").encode()}
    queue = Queue("gw-q", connection=redis_conn, serializer=JSONSerializer)
    assert queue.job_ids == [ahead, first, second, piped]
    job = Job.fetch(first, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.QUEUED and job.func_name == keys.GENERATE_FUNC
    assert list(job.args) == [{"prompt": "a", "max_tokens": 2}] and job.meta == {"api_key": "k"}
    assert redis_conn.hgetall("ctx-key") == {b"kind": b"chat", b"include_usage": b""}
    assert 100 < redis_conn.ttl("ctx-key") <= 120
    inflight = limits.inflight_key(KEY)
    assert set(redis_conn.zrange(inflight, 0, -1)) == {first.encode(), second.encode(), ahead.encode()}
    assert redis_conn.ttl(inflight) > limits.KEY_TTL_S - 60


def test_over_the_limit_nothing_is_written_until_a_job_ends(redis_url: str, redis_conn: redis.Redis) -> None:
    async def scenario(client: AsyncClient, submitter: Submitter) -> None:
        running = [_job(client, "a"), _job(client, "b")]
        assert await submitter.submit(KEY, 3, running) is None
        refused = [_job(client, "c"), _job(client, "d")]
        assert await submitter.submit(KEY, 3, refused, "ctx-refused", {"kind": "chat"}, 120) == 2
        assert not await client.connection.exists(refused[0].key, refused[1].key, "ctx-refused")
        assert await client.connection.zcard(limits.inflight_key(KEY)) == 2
        assert await client.connection.llen(keys.rq_queue_key("gw-q")) == 2
        # one job ends (the worker writes its result): its place is given to the next submission
        await client.connection.set(keys.result_key(running[0].id), "{}")
        assert await submitter.submit(KEY, 3, refused) is None
        members = {m.decode() for m in await client.connection.zrange(limits.inflight_key(KEY), 0, -1)}
        assert members == {running[1].id, refused[0].id, refused[1].id}

    _run(redis_url, scenario)


def test_a_script_tried_again_writes_its_jobs_once(redis_url: str, redis_conn: redis.Redis) -> None:
    async def scenario(client: AsyncClient, submitter: Submitter) -> str:
        job = _job(client, "a")
        lost: list[int] = []
        real = submitter.script.__call__

        async def reply_lost(**kwargs: object) -> object:  # the first try gets through, its reply is lost
            answer = await real(**kwargs)  # type: ignore[arg-type]
            if not lost:
                lost.append(1)
                raise redis.ConnectionError("the reply was lost")
            return answer

        submitter.script = reply_lost  # type: ignore[assignment]
        assert await submitter.submit(KEY, 1, [job]) is None
        assert lost == [1]
        return job.id

    job_id = _run(redis_url, scenario)
    assert redis_conn.lrange(keys.rq_queue_key("gw-q"), 0, -1) == [job_id.encode()]
    assert redis_conn.zcard(limits.inflight_key(KEY)) == 1


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_a_full_redis_is_redis_full_and_nothing_is_written(tmp_path: Path) -> None:
    server = PrivateRedis(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    server.start()
    try:
        conn = redis.Redis.from_url(server.url)
        fill_memory(conn)

        async def scenario(client: AsyncClient, submitter: Submitter) -> str:
            job = _job(client, "a")
            with pytest.raises(RedisFull):
                await submitter.submit(KEY, 4, [job])
            return job.id

        started = time.monotonic()
        job_id = _run(server.url, scenario)
        assert time.monotonic() - started < 10
        assert not conn.exists(keys.rq_job_key(job_id), limits.inflight_key(KEY), keys.rq_queue_key("gw-q"))
        conn.close()
    finally:
        server.stop()


def test_the_gateways_redis_pool_is_sized_for_its_streams(redis_url: str) -> None:
    """Each relayed stream blocks a connection in XREAD: redis-py's default pool (100) would cap them."""

    async def pools() -> list[int]:
        sized = []
        for producer in (
            ProducerSettings(redis_url=redis_url),
            ProducerSettings(redis_url=redis_url, redis_max_connections=50),
        ):
            gateway = Gateway(GatewaySettings(redis_connections=300), producer)
            sized.append(gateway.client.connection.connection_pool.max_connections)
            await gateway.aclose()
        return sized

    assert asyncio.run(pools()) == [300, 50]  # the producer's own setting, where given, wins
