"""The sync producer: `Client` submits jobs, `JobHandle` follows one (stream, result, status, cancel).

Only the Redis calls are made here; what they mean is shared with the async client (`aio`): job hashes
and RQ's records in `rq_wire`, requests and results in `payload`, a job's reads (status, events, result)
as steps in `job_reads` (which this handle drives on redis-py), RQ's statuses and failures in
`job_state`, cancelling in `cancellation`, per-job options in `ProducerSettings`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TextIO, TypeVar

import redis
from rq import Retry

from mlxq.jobs import keys
from mlxq.jobs.replication import NotReplicated, Replicas, unreplicated_warning
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
from .connection import RetryPolicy, connect, replica_acks
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


class JobHandle(Generic[R]):
    """One submitted job. Every read retries Redis connection errors under the client's policy."""

    def __init__(self, client: Client, job_id: str, parse: Callable[[payload.ResultData], R]) -> None:
        self._client = client
        self._conn = client.connection
        self._retry = client.retry.call
        self._parse = parse
        self.id = job_id

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"

    def status(self) -> str:
        """RQ's status (`queued`, `started`, `finished`, `failed`, `canceled`, ...) or `missing`."""
        return job_reads.run(job_reads.status(self.id), self._call)

    def stream(self, from_id: str = START_ID, timeout: float | None = None) -> Iterator[StreamItem]:
        """The job's events (token, restart, then done or error) from `from_id`; ends after the last one.

        Save an item's `stream_id` to resume later from there. Raises `JobFailed` if RQ reports the job
        failed, stopped or canceled without a terminal event, `TimeoutError` after `timeout` seconds.
        """
        follower = Follower(last_id=from_id, deadline=Deadline(timeout))
        return job_reads.items(job_reads.follow(self.id, follower), self._call)

    def text_deltas(
        self, timeout: float | None = None, on_restart: Callable[[RestartEvent], None] | None = None
    ) -> Iterator[str]:
        """The generated text, piece by piece. Raises `JobFailed` on an `error` event.

        A retried job starts over: its text comes again after a `restart`; `on_restart` is told so the
        caller can drop what it showed (without it, the earlier attempt's text simply stays).
        """
        for item in self.stream(timeout=timeout):
            event = item.event
            if isinstance(event, TokenEvent) and event.text:
                yield event.text
            elif isinstance(event, RestartEvent) and on_restart is not None:
                on_restart(event)
            elif isinstance(event, ErrorEvent):
                raise job_reads.run(job_reads.event_failure(self.id, event), self._call)

    def result(self, timeout: float | None = None) -> R:
        """Wait for the job to end and return its validated result; `JobFailed` if it failed.

        A job cancelled while running ends normally, with `finish_reason == "cancelled"`.
        """
        return job_reads.run(job_reads.result(self.id, self._parse, timeout), self._call)

    def cancel(self) -> CancelOutcome:
        """Cancel the job: RQ cancels it if it is still waiting; a running job is asked to stop."""
        return cancellation.cancel_job(self._conn, self._client.retry, self.id)

    def _call(self, call: job_reads.Call) -> Any:
        """A read's Redis command, under the client's retry policy."""
        return self._retry(getattr(self._conn, call.method), *call.args, **call.kwargs)


class Client:
    """Submits mlxq jobs to one Redis and queue. Give `redis_url` or a ready `connection` (bytes replies)."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        connection: redis.Redis | None = None,
        queue: str | None = None,
        settings: ProducerSettings | None = None,
    ) -> None:
        self.settings = settings or ProducerSettings()
        self.tenant = Tenant(self.settings.tenant)
        self.queue = self.tenant.queue(queue or self.settings.queue)
        self.connection = connection or connect(redis_url or self.settings.redis_url, self.settings)
        self.retry = RetryPolicy.from_settings(self.settings)
        self._replicas = Replicas(
            self.connection,
            replica_acks(self.connection, self.settings),
            self.settings.replica_ack_timeout_ms,
        )
        self.evictions = EvictionCheck()  # the Redis's memory policy, looked at before the first submit
        self.queue_check = QueueCheck()  # whether a worker serves each queue submitted to

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self.connection.close()

    def submit_generate(
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
    ) -> JobHandle[GenerateResult]:
        """Validate and enqueue a generation job; `params` are `GenerateRequest` fields (max_tokens, ...).

        `retry=N` lets RQ run a failed job again up to N times; `job_id` defaults to a fresh uuid4 hex.
        The text of a special token in `prompt` (`<|im_start|>`) is encoded as ordinary text unless
        `allow_special_tokens=True` (a prompt formatted by hand, from a trusted source).
        """
        request = payload.generate_request(prompt, messages, params)
        options = self.settings.job_options(job_timeout, result_ttl, failure_ttl, retry, at_front, meta)
        job_id = self.enqueue(keys.GENERATE_FUNC, payload.wire_payload(request), options, queue, job_id)
        return JobHandle(self, job_id, payload.generate_result)

    def submit_score(
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
    ) -> JobHandle[ScoreResult]:
        """Validate and enqueue a scoring job of `rows` (`{prompt, candidates}`, or `continuations`,
        `rolling`, `prompt_logprobs`: see `ScoreRow`); options as for generate."""
        request = payload.score_request(rows, params)
        options = self.settings.job_options(job_timeout, result_ttl, failure_ttl, retry, at_front, meta)
        job_id = self.enqueue(keys.SCORE_FUNC, payload.wire_payload(request), options, queue, job_id)
        return JobHandle(self, job_id, payload.score_result)

    def job(self, job_id: str) -> JobHandle[GenerateResult | ScoreResult]:
        """A handle on an existing job (submitted by anyone): resume its stream, fetch its result."""
        return JobHandle(self, job_id, payload.any_result)

    def score_dataset(
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
        batch_format: str = "auto",
    ) -> BulkSummary:
        """Score a dataset: a JSONL file's path, or rows `{custom_id, prompt, candidates}` (or, in place
        of candidates, `continuations`, `rolling` or `prompt_logprobs`: see `ScoreRow`).

        Writes `{custom_id, logits, logprobs, input_tokens, cached_tokens}` per candidates row (the
        kind's own field in place of logits and logprobs for the others) to `out_path` in input
        order; failed and malformed rows go to `errors_path` (default `<out>.errors.jsonl`) with the reason.
        Rerunning with the same `out_path` skips rows already there (and, unless `retry_errors`, rows in
        the errors file). Rows travel `rows_per_job` to a job, at most `in_flight` jobs at once. Setting
        `stop` ends the run early (outstanding jobs cancelled). With `allow_special_tokens` the rows'
        special-token text is encoded as control tokens (else as text). `batch_format` `openai` (or
        `auto` and a file of OpenAI Batch API lines): completions with `echo`/`logprobs` in, OpenAI's
        batch output lines out (`bulk_openai`). See `docs/bulk.md`.
        """
        options = bulk.BulkOptions(
            rows_per_job=rows_per_job, in_flight=in_flight, queue=queue, retry_errors=retry_errors
        )
        return bulk.score_dataset(
            self._bulk_target(),
            source,
            out_path,
            errors_path,
            options,
            add_special_tokens=add_special_tokens,
            allow_special_tokens=allow_special_tokens,
            max_tokens=max_tokens,
            progress=progress,
            stop=stop,
            batch_format=batch_format,
        )

    def generate_dataset(
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
        batch_format: str = "auto",
        **defaults: Any,
    ) -> BulkSummary:
        """Generate for a dataset: a JSONL file's path, or rows `{custom_id, prompt | messages, ...}`
        (or OpenAI Batch API request lines: `{custom_id, url, body}`).

        One generation job per row; a row's own `GenerateRequest` fields (max_tokens, temperature, stop,
        seed, ...) win over `defaults` (the same fields, for every row). Writes `{custom_id, text,
        finish_reason, token_ids, usage, timings, model}` per row to `out_path` in input order; failed and
        malformed rows go to `errors_path`. Resuming, `in_flight` and `stop` as for `score_dataset`. See
        `docs/bulk.md`.
        """
        options = bulk.BulkOptions(in_flight=in_flight, queue=queue, retry_errors=retry_errors)
        return bulk.generate_dataset(
            self._bulk_target(),
            source,
            out_path,
            errors_path,
            options,
            defaults=defaults,
            progress=progress,
            stop=stop,
            batch_format=batch_format,
        )

    def _bulk_target(self) -> bulk.BulkTarget:
        """This client as a bulk run sees it: its connection, retry policy, queue and job options."""
        self.evictions.run(self.connection)
        return bulk.BulkTarget(
            self.connection,
            self.retry,
            self.queue,
            self.settings.job_options(),
            self.tenant,
            replicas=self._replicas,
        )

    def enqueue(
        self,
        func_name: str,
        job_payload: dict[str, Any],
        options: rq_wire.JobOptions,
        queue: str | None = None,
        job_id: str | None = None,
    ) -> str:
        """Write the RQ job in one transaction; retried on connection errors, never enqueued twice."""
        queue = queue or self.queue
        job = rq_wire.build_job(
            func_name, job_payload, queue=queue, options=options, job_id=job_id, tenant=self.tenant
        )
        self.evictions.run(self.connection)
        try:
            self.retry.call(self._enqueue_durably, job)
        except redis.exceptions.OutOfMemoryError as e:
            raise RedisFull(job.id, e) from e
        except NotReplicated as e:  # enqueued on the primary; only a replica's copy is unconfirmed
            log.warning("%s", unreplicated_warning(job.id, e))
        log.debug("enqueued job=%s func=%s queue=%s", job.id, func_name, job.queue)
        self.queue_check.run(self.connection, job.queue)
        return job.id

    def _enqueue_durably(self, job: rq_wire.WireJob) -> None:
        """Enqueue once, then wait for the replicas (`jobs.replication.Replicas`; each try does both)."""
        self._enqueue_once(job)
        self._replicas.confirm()

    def _enqueue_once(self, job: rq_wire.WireJob) -> None:
        with self.connection.pipeline() as pipe:
            try:
                pipe.watch(job.key)  # type: ignore[no-untyped-call]
                if pipe.exists(job.key):  # an earlier try got through before its reply was lost
                    return
                pipe.multi()
                rq_wire.queue_commands(pipe, job)
                pipe.execute()
            except redis.WatchError:  # the same id was written meanwhile: it is there, once
                return
