"""`AsyncClient` against real Redis and RQ, each scenario in its own `asyncio.run` (no pytest plugin)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import redis
import redis.asyncio.client
from conftest import WorkerSide, generate_result, score_result
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from mlxq.jobs import errors, keys
from mlxq.jobs.schema import GenerateResult, RestartEvent, ScoreResult
from mlxq.producer import AsyncClient, CancelOutcome, Client, JobFailed, JobNotFound, ProducerSettings
from mlxq.producer.connection import RetryPolicy
from mlxq.producer.tail import FRESH_BLOCK_MS

REDIS_DB = 12

T = TypeVar("T")


def run_with_client(redis_url: str, scenario: Callable[[AsyncClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with AsyncClient(
            redis_url, settings=ProducerSettings(redis_retry_initial_wait_s=0.01)
        ) as client:
            return await scenario(client)

    return asyncio.run(main())


def fetch(conn: redis.Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def test_async_enqueue_writes_the_same_job_as_the_sync_client(
    redis_url: str, redis_conn: redis.Redis
) -> None:
    options = {"job_timeout": 30, "result_ttl": 60, "retry": 2, "meta": {"who": "web"}, "temperature": 0.5}

    async def scenario(client: AsyncClient) -> str:
        handle = await client.submit_generate("Hi", job_id="async-job", **options)
        assert await handle.status() == "queued"
        return handle.id

    assert run_with_client(redis_url, scenario) == "async-job"
    with Client(redis_url) as sync:
        sync.submit_generate("Hi", job_id="sync-job", **options)
    volatile = {b"created_at", b"enqueued_at"}
    a = {k: v for k, v in redis_conn.hgetall("rq:job:async-job").items() if k not in volatile}
    b = {k: v for k, v in redis_conn.hgetall("rq:job:sync-job").items() if k not in volatile}
    assert a == b
    job = fetch(redis_conn, "async-job")
    assert (job.func_name, job.args, job.kwargs) == (
        "jobs.generate",
        [{"prompt": "Hi", "temperature": 0.5}],
        {},
    )
    assert (job.timeout, job.retries_left, job.meta) == (30, 2, {"who": "web"})
    assert Queue("default", connection=redis_conn).job_ids == ["async-job", "sync-job"]


def test_async_stream_resume_restart_and_result(redis_url: str, worker_side: WorkerSide) -> None:
    async def scenario(client: AsyncClient) -> None:
        handle = await client.submit_generate(messages=[{"role": "user", "content": "Hi"}])
        worker_side.start(handle.id)
        first, _ = worker_side.tokens(handle.id, "old", " text")
        worker_side.restart(handle.id, attempt=2)
        worker_side.tokens(handle.id, "Hel", "lo")
        worker_side.done(handle.id, generate_result("Hello"))

        items = [item async for item in handle.stream(timeout=2)]
        assert items[-1].terminal and len(items) == 6
        resumed = [item async for item in handle.stream(from_id=first, timeout=2)]
        assert resumed == items[1:]
        restarts: list[RestartEvent] = []
        deltas = [d async for d in handle.text_deltas(timeout=2, on_restart=restarts.append)]
        assert deltas == ["old", " text", "Hel", "lo"] and restarts == [RestartEvent(attempt=2)]
        result = await handle.result(timeout=2)
        assert isinstance(result, GenerateResult) and result.text == "Hello"
        by_id = await client.job(handle.id).result(timeout=2)
        assert by_id == result

    run_with_client(redis_url, scenario)


def test_async_result_waits_for_done_and_scores(redis_url: str, worker_side: WorkerSide) -> None:
    async def scenario(client: AsyncClient) -> None:
        handle = await client.submit_score([{"prompt": "1+1=", "candidates": ["2", "3"]}])
        timer = threading.Timer(0.3, worker_side.done, (handle.id, score_result()))
        timer.start()
        started = time.monotonic()
        try:
            assert isinstance(await handle.result(timeout=3), ScoreResult)
        finally:
            timer.join()
        assert time.monotonic() - started < 2

    run_with_client(redis_url, scenario)


def test_async_failures_and_timeouts(
    redis_url: str, worker_side: WorkerSide, run_rq_worker: Callable[..., None]
) -> None:
    async def submit(client: AsyncClient) -> tuple[str, str, str]:
        failing = await client.submit_generate("Hi")
        erroring = await client.submit_generate("Hi")
        waiting = await client.submit_generate("Hi", queue="idle")
        return failing.id, erroring.id, waiting.id

    failing, erroring, waiting = run_with_client(redis_url, submit)
    worker_side.start(erroring)  # taken off the queue, so the RQ worker below runs only `failing`
    worker_side.error(erroring, "InvalidCandidate: 'xyz' is 3 tokens")
    run_rq_worker()

    async def check(client: AsyncClient) -> None:
        with pytest.raises(errors.JobFailed) as info:
            await client.job(failing).result(timeout=3)
        assert isinstance(info.value, JobFailed) and "NotInWorker" in info.value.reason
        assert "Traceback" in info.value.details
        with pytest.raises(JobFailed, match="InvalidCandidate"):
            await client.job(erroring).result(timeout=2)
        with pytest.raises(TimeoutError):
            await client.job(waiting).result(timeout=0.3)
        with pytest.raises(JobNotFound):
            await client.job("nope").result(timeout=2)

    run_with_client(redis_url, check)


def test_the_async_handle_reads_a_job_key_of_another_type_as_missing(
    redis_url: str, redis_conn: redis.Redis
) -> None:
    """Redis's WRONGTYPE reply to the status read is handled by the read it was made for (the steps of
    `job_reads`, driven on asyncio), as the sync handle handles it."""
    redis_conn.set(keys.rq_job_key("not-a-hash"), "x")

    async def scenario(client: AsyncClient) -> str:
        handle = client.job("not-a-hash")
        with pytest.raises(JobNotFound):
            await handle.result(timeout=0.5)
        return await handle.status()

    assert run_with_client(redis_url, scenario) == "missing"


def test_async_cancel(redis_url: str, redis_conn: redis.Redis, worker_side: WorkerSide) -> None:
    async def scenario(client: AsyncClient) -> str:
        queued = await client.submit_generate("Hi")
        running = await client.submit_generate("Hi")
        worker_side.start(running.id)
        assert await queued.cancel() == CancelOutcome.CANCELED
        assert await running.cancel() == CancelOutcome.REQUESTED
        assert await queued.cancel() == CancelOutcome.ALREADY_OVER
        assert await client.job("nope").cancel() == CancelOutcome.MISSING
        assert await queued.status() == JobStatus.CANCELED.value
        return running.id

    running_id = run_with_client(redis_url, scenario)
    assert redis_conn.get(keys.cancel_key(running_id)) == b"1"
    assert fetch(redis_conn, running_id).get_status() == JobStatus.STARTED
    assert Queue("default", connection=redis_conn).job_ids == []


def test_async_retried_submission_is_never_enqueued_twice(
    redis_url: str, redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_execute = redis.asyncio.client.Pipeline.execute
    lost: list[bool] = []

    async def reply_lost_once(
        self: redis.asyncio.client.Pipeline, raise_on_error: bool = True
    ) -> list[object]:
        out = await real_execute(self, raise_on_error)
        if not lost:
            lost.append(True)
            raise redis.ConnectionError("connection reset while reading the reply")
        return out

    monkeypatch.setattr(redis.asyncio.client.Pipeline, "execute", reply_lost_once)

    async def scenario(client: AsyncClient) -> str:
        return (await client.submit_generate("once")).id

    job_id = run_with_client(redis_url, scenario)
    assert lost == [True]
    assert Queue("default", connection=redis_conn).job_ids == [job_id]


def test_a_fresh_stream_reads_at_once_and_keeps_its_connection_when_cut(
    redis_url: str, worker_side: WorkerSide
) -> None:
    async def scenario(client: AsyncClient) -> None:
        handle = await client.submit_generate("Hi")
        threading.Timer(0.05, worker_side.tokens, (handle.id, "Hel", "lo")).start()
        threading.Timer(0.2, worker_side.done, (handle.id,)).start()
        asked = (await client.connection.info("commandstats")).get("cmdstat_hget", {}).get("calls", 0)
        items = [item async for item in handle.stream(timeout=3, fresh=True)]
        assert [type(i.event).__name__ for i in items] == ["TokenEvent", "TokenEvent", "DoneEvent"]
        stats = await client.connection.info("commandstats")
        assert stats.get("cmdstat_hget", {}).get("calls", 0) == asked  # RQ's status was not asked
        # a caller cancelled during the first read: the read ends on its own and its connection lives
        other = await client.submit_generate("Hi")
        before = await client.connection.client_id()
        reading = asyncio.ensure_future(anext(aiter(other.stream(fresh=True))))
        await asyncio.sleep(0.02)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await asyncio.sleep(FRESH_BLOCK_MS / 1000 + 0.2)
        assert await client.connection.client_id() == before

    run_with_client(redis_url, scenario)


def test_a_relayed_stream_keeps_its_connection_when_cut_in_a_later_read(
    redis_url: str, worker_side: WorkerSide
) -> None:
    """`whole_reads` (the gateway's relay, whose client may leave at any token): a caller cancelled in
    a blocking read after its first one leaves the read to end on its own, its connection whole."""

    async def scenario(client: AsyncClient) -> None:
        handle = await client.submit_generate("Hi")
        worker_side.tokens(handle.id, "Hel")
        before = await client.connection.client_id()
        items = aiter(handle.stream(timeout=10, whole_reads=True))
        assert (await anext(items)).stream_id  # the first read's token; the next read blocks
        reading = asyncio.ensure_future(anext(items))
        await asyncio.sleep(0.05)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        worker_side.tokens(handle.id, "lo")  # the cut-off read's answer: it ends, its connection lives
        await asyncio.sleep(0.2)
        assert await client.connection.client_id() == before

    run_with_client(redis_url, scenario)


def test_the_async_retry_policy_tries_again_on_connection_errors_only() -> None:
    policy = RetryPolicy(attempts=3, initial_wait_s=0.05, max_wait_s=1.0)
    calls: list[float] = []

    async def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise redis.ConnectionError("down")
        return "up"

    assert asyncio.run(policy.acall(flaky)) == "up"
    assert len(calls) == 3 and calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.1  # waits go on

    async def down() -> str:
        calls.append(time.monotonic())
        raise redis.ConnectionError("still down")

    calls.clear()
    with pytest.raises(redis.ConnectionError, match="still down"):
        asyncio.run(policy.acall(down))
    assert len(calls) == 3

    async def bug() -> str:
        calls.append(time.monotonic())
        raise ValueError("bad value")

    calls.clear()
    with pytest.raises(ValueError, match="bad value"):
        asyncio.run(policy.acall(bug))
    assert len(calls) == 1
