"""The asyncio producer (FastAPI, aiohttp): `AsyncClient` and `AsyncJobHandle`, the sync API as coroutines.

The sync client's calls, awaited on redis.asyncio, over the same shared parts (see `producer.client`).
RQ is sync, so jobs are enqueued by writing RQ's job hash and queue push in one transaction (`rq_wire`).
Canceling a still-queued job (RQ's own `Job.cancel`) and bulk runs go to a thread, on a sync connection
that is opened only when first needed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TextIO, TypeVar

import redis
import redis.asyncio
from rq import Retry

from mlxq.jobs import keys
from mlxq.jobs.replication import AsyncReplicas, NotReplicated, Replicas, unreplicated_warning
from mlxq.jobs.schema import (
    ChatMessage,
    ErrorEvent,
    GenerateRequest,
    GenerateResult,
    RestartEvent,
    ScoreRequest,
    ScoreResult,
    ScoreRow,
    TokenEvent,
)

from . import bulk, cancellation, job_reads, payload, rq_wire
from .bulk_files import BulkSource, BulkSummary
from .connection import RetryPolicy, connect, connect_async, replica_acks
from .errors import RedisFull
from .eviction_check import EvictionCheck
from .job_state import CancelOutcome
from .queue_check import QueueCheck
from .settings import ProducerSettings
from .tail import (
    START_ID,
    Deadline,
    Follower,
    StreamItem,
)
from .tenant import Tenant

log = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")


class AsyncJobHandle(Generic[R]):
    """One submitted job, as coroutines and async iterators. See `producer.JobHandle` for the semantics."""

    def __init__(self, client: AsyncClient, job_id: str, parse: Callable[[payload.ResultData], R]) -> None:
        self._client = client
        self._conn = client.connection
        self._retry = client.retry.acall
        self._parse = parse
        self.id = job_id

    def __repr__(self) -> str:
        return f"AsyncJobHandle({self.id!r})"

    async def status(self) -> str:
        """RQ's status (`queued`, `started`, `finished`, `failed`, `canceled`, ...) or `missing`."""
        return await job_reads.arun(job_reads.status(self.id), self._call)

    def stream(
        self,
        from_id: str = START_ID,
        timeout: float | None = None,
        fresh: bool = False,
        whole_reads: bool = False,
    ) -> AsyncIterator[StreamItem]:
        """The job's events from `from_id`, ending after `done` or `error` (as `JobHandle.stream`).
        `fresh`: the caller has just enqueued the job, so the first read waits at once, briefly, and runs
        to its end whatever becomes of the caller (as `whole_reads` has every read do).
        `whole_reads`: every blocking read runs to its end even if the caller is cancelled meanwhile
        (at most `READ_BLOCK_MS`), for a relay whose own client may leave at any moment: a Redis reply
        cut off costs its connection, and the next command on it a reconnect (TCP, `HELLO`)."""
        follower = Follower(last_id=from_id, deadline=Deadline(timeout), fresh=fresh)
        return job_reads.aitems(job_reads.follow(self.id, follower, whole_reads), self._call)

    async def text_deltas(
        self, timeout: float | None = None, on_restart: Callable[[RestartEvent], None] | None = None
    ) -> AsyncIterator[str]:
        """The generated text, piece by piece; `JobFailed` on an `error` event (as the sync handle)."""
        async for item in self.stream(timeout=timeout):
            event = item.event
            if isinstance(event, TokenEvent) and event.text:
                yield event.text
            elif isinstance(event, RestartEvent) and on_restart is not None:
                on_restart(event)
            elif isinstance(event, ErrorEvent):
                raise await job_reads.arun(job_reads.event_failure(self.id, event), self._call)

    async def result(self, timeout: float | None = None) -> R:
        """Wait for the job to end and return its validated result; `JobFailed` if it failed."""
        return await job_reads.arun(job_reads.result(self.id, self._parse, timeout), self._call)

    async def cancel(self) -> CancelOutcome:
        """Cancel the job: RQ cancels it if it is still waiting; a running job is asked to stop."""
        steps = cancellation.plan(await self.status())
        if steps.request_stop:
            key = keys.cancel_key(self.id)
            await self._retry(self._conn.set, key, "1", ex=cancellation.CANCEL_KEY_TTL_S)
        if steps.rq_cancel:
            sync = self._client._sync_connection()
            return await asyncio.to_thread(self._client.retry.call, cancellation.rq_cancel, sync, self.id)
        return steps.outcome

    async def _call(self, call: job_reads.Call) -> Any:
        """A read's Redis command, under the client's retry policy; a `whole` one run to its end."""
        command = self._retry(getattr(self._conn, call.method), *call.args, **call.kwargs)
        return await (_uncut(command) if call.whole else command)


async def _uncut(command: Awaitable[T]) -> T:
    """`command` awaited to its end even if the caller is cancelled meanwhile (its error then dropped)."""
    task = asyncio.ensure_future(command)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.shield(task)


class AsyncClient:
    """Submits mlxq jobs with redis.asyncio. Use `async with AsyncClient(url) as client:` or `aclose()`."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        queue: str | None = None,
        settings: ProducerSettings | None = None,
    ) -> None:
        self.settings = settings or ProducerSettings()
        self.tenant = Tenant(self.settings.tenant)
        self.redis_url = redis_url or self.settings.redis_url
        self.queue = self.tenant.queue(queue or self.settings.queue)
        self.connection: redis.asyncio.Redis = connect_async(self.redis_url, self.settings)
        self.retry = RetryPolicy.from_settings(self.settings)
        self._replicas = AsyncReplicas(
            self.connection,
            replica_acks(self.connection, self.settings),
            self.settings.replica_ack_timeout_ms,
        )
        self.evictions = EvictionCheck()  # the Redis's memory policy, looked at before the first submit
        self.queue_check = QueueCheck()  # whether a worker serves each queue submitted to
        self._sync: redis.Redis | None = None
        self._sync_replicas: Replicas | None = None  # what a bulk run's enqueues wait for, on `_sync`

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pools."""
        await self.connection.aclose()
        if self._sync is not None:
            self._sync.close()

    def _sync_connection(self) -> redis.Redis:
        """A sync connection to the same Redis, opened when first needed: RQ's own operations and bulk
        runs are sync and run in a thread."""
        if self._sync is None:
            self._sync = connect(self.redis_url, self.settings)
        return self._sync

    async def submit_generate(
        self,
        prompt: str | GenerateRequest | None = None,
        *,
        messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
        job_id: str | None = None,
        queue: str | None = None,
        job_timeout: int | None = None,
        result_ttl: int | None = None,
        failure_ttl: int | None = None,
        retry: int | Retry | None = None,
        at_front: bool = False,
        meta: dict[str, Any] | None = None,
        **params: Any,
    ) -> AsyncJobHandle[GenerateResult]:
        """Validate and enqueue a generation job (arguments as `Client.submit_generate`)."""
        request = payload.generate_request(prompt, messages, params)
        options = self.settings.job_options(job_timeout, result_ttl, failure_ttl, retry, at_front, meta)
        job_id = await self.enqueue(keys.GENERATE_FUNC, payload.wire_payload(request), options, queue, job_id)
        return AsyncJobHandle(self, job_id, payload.generate_result)

    async def submit_score(
        self,
        rows: ScoreRequest | Sequence[ScoreRow | Mapping[str, Any]],
        *,
        job_id: str | None = None,
        queue: str | None = None,
        job_timeout: int | None = None,
        result_ttl: int | None = None,
        failure_ttl: int | None = None,
        retry: int | Retry | None = None,
        at_front: bool = False,
        meta: dict[str, Any] | None = None,
        **params: Any,
    ) -> AsyncJobHandle[ScoreResult]:
        """Validate and enqueue a scoring job (arguments as `Client.submit_score`)."""
        request = payload.score_request(rows, params)
        options = self.settings.job_options(job_timeout, result_ttl, failure_ttl, retry, at_front, meta)
        job_id = await self.enqueue(keys.SCORE_FUNC, payload.wire_payload(request), options, queue, job_id)
        return AsyncJobHandle(self, job_id, payload.score_result)

    def job(self, job_id: str) -> AsyncJobHandle[GenerateResult | ScoreResult]:
        """A handle on an existing job: resume its stream, fetch its result."""
        return AsyncJobHandle(self, job_id, payload.any_result)

    async def score_dataset(
        self,
        source: BulkSource,
        out_path: str | Path,
        *,
        errors_path: str | Path | None = None,
        queue: str | None = None,
        rows_per_job: int = 16,
        in_flight: int = 64,
        retry_errors: bool = True,
        add_special_tokens: bool = True,
        allow_special_tokens: bool = False,
        max_tokens: int | None = None,
        progress: TextIO | None = None,
        stop: threading.Event | None = None,
    ) -> BulkSummary:
        """`Client.score_dataset`, run in a thread on this client's sync connection (it is file and Redis I/O
        with a blocking read). Cancelling the task stops the run and cancels its outstanding jobs."""
        options = bulk.BulkOptions(
            rows_per_job=rows_per_job,
            in_flight=in_flight,
            queue=queue or self.queue,
            retry_errors=retry_errors,
        )
        target = self._bulk_target()

        def run(stop: threading.Event) -> BulkSummary:
            return bulk.score_dataset(
                target,
                source,
                out_path,
                errors_path,
                options,
                add_special_tokens=add_special_tokens,
                allow_special_tokens=allow_special_tokens,
                max_tokens=max_tokens,
                progress=progress,
                stop=stop,
            )

        return await bulk.in_thread(run, stop)

    async def generate_dataset(
        self,
        source: BulkSource,
        out_path: str | Path,
        *,
        errors_path: str | Path | None = None,
        queue: str | None = None,
        in_flight: int = 64,
        retry_errors: bool = True,
        progress: TextIO | None = None,
        stop: threading.Event | None = None,
        **defaults: Any,
    ) -> BulkSummary:
        """`Client.generate_dataset`, run in a thread on this client's sync connection; cancelling the task
        stops the run and cancels its outstanding jobs."""
        options = bulk.BulkOptions(in_flight=in_flight, queue=queue or self.queue, retry_errors=retry_errors)
        target = self._bulk_target()

        def run(stop: threading.Event) -> BulkSummary:
            return bulk.generate_dataset(
                target,
                source,
                out_path,
                errors_path,
                options,
                defaults=defaults,
                progress=progress,
                stop=stop,
            )

        return await bulk.in_thread(run, stop)

    def _bulk_target(self) -> bulk.BulkTarget:
        """This client as a bulk run sees it, on its sync connection (a run is sync, in a thread)."""
        self.evictions.run(self._sync_connection())
        if self._sync_replicas is None:
            self._sync_replicas = Replicas(
                self._sync_connection(), self._replicas.floor, self.settings.replica_ack_timeout_ms
            )
        return bulk.BulkTarget(
            self._sync_connection(),
            self.retry,
            self.queue,
            self.settings.job_options(),
            self.tenant,
            replicas=self._sync_replicas,
        )

    async def enqueue(
        self,
        func_name: str,
        job_payload: dict[str, Any],
        options: rq_wire.JobOptions,
        queue: str | None = None,
        job_id: str | None = None,
    ) -> str:
        """Write the RQ job in one transaction; retried on connection errors, never enqueued twice."""
        job = self.wire_job(func_name, job_payload, options, queue, job_id)
        await self.write_jobs([job], lambda: self._enqueue_once(job))
        log.debug("enqueued job=%s func=%s queue=%s", job.id, func_name, job.queue)
        return job.id

    def wire_job(
        self,
        func_name: str,
        job_payload: dict[str, Any],
        options: rq_wire.JobOptions,
        queue: str | None = None,
        job_id: str | None = None,
    ) -> rq_wire.WireJob:
        """The RQ job this client would enqueue, in its tenant, on `queue` (else the client's)."""
        return rq_wire.build_job(
            func_name,
            job_payload,
            queue=queue or self.queue,
            options=options,
            job_id=job_id,
            tenant=self.tenant,
        )

    async def write_jobs(self, jobs: Sequence[rq_wire.WireJob], write: Callable[[], Awaitable[T]]) -> T:
        """Await `write`, which writes `jobs` in one atomic step (and may do more in it), under this
        client's enqueue rules: Redis's memory policy looked at first, tried again on connection errors
        (so `write` must find a job already there and not write it twice), the replicas waited for,
        `RedisFull` when Redis refuses for memory, and the queues looked at for a worker."""
        done: list[T] = []

        async def durably() -> None:
            done[:] = [await write()]
            await self._replicas.confirm()

        await self.evictions.arun(self.connection)
        try:
            await self.retry.acall(durably)
        except redis.exceptions.OutOfMemoryError as e:
            raise RedisFull(jobs[0].id, e) from e
        except NotReplicated as e:  # written on the primary; only a replica's copy is unconfirmed
            log.warning("%s", unreplicated_warning(jobs[0].id, e))
        for queue in dict.fromkeys(job.queue for job in jobs):
            await self.queue_check.arun(self.connection, queue)
        return done[0]

    async def _enqueue_once(self, job: rq_wire.WireJob) -> None:
        async with self.connection.pipeline() as pipe:
            try:
                await pipe.watch(job.key)
                if await pipe.exists(job.key):  # an earlier try got through before its reply was lost
                    return
                pipe.multi()  # type: ignore[no-untyped-call]
                rq_wire.queue_commands(pipe, job)
                await pipe.execute()
            except redis.WatchError:  # the same id was written meanwhile: it is there, once
                return
