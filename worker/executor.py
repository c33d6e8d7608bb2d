"""Runs validated job requests on the engine and writes their streams and results to Redis.

This is the `jobs.runtime.Executor` a worker installs: `jobs.generate` hands it the request, it hands
back the result that RQ stores. Failures are not written here: the worker's failure hook ends the
stream with an `error` event for every failed job, including those that never reached the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timezone
from typing import Any

import redis
from rq import get_current_job
from rq.job import Job
from rq.utils import now

from jobs import parse_score
from jobs.schema import DoneEvent, GenerateRequest, GenerateResult, ScoreRequest, ScoreResult
from worker.engine import Engine
from worker.stream_writer import StreamOptions, StreamWriter, finish_streams, open_streams

log = logging.getLogger(__name__)

ATTEMPT_META = "mlxq_attempt"
PreparedRows = list[tuple[list[int], list[int]]]  # per row: prompt tokens, candidate token ids


class JobExecutor:
    """Binds an engine to Redis: one instance per worker process."""

    def __init__(
        self,
        engine: Engine,
        conn: redis.Redis,
        stream_options: StreamOptions,
        cancelled: Callable[[str], bool],
    ) -> None:
        self.engine = engine
        self.conn = conn
        self.stream_options = stream_options
        self.cancelled = cancelled
        self.jobs_done = 0
        self.last_tokens_per_s: float | None = None
        self._queued_s: dict[str, float] = {}  # job id -> seconds from enqueue to its stream opening

    def open_stream(self, job_id: str, job: Job | None = None, deferred: bool = False) -> StreamWriter:
        """The job's stream writer, opened (a `restart` entry if an earlier attempt wrote to it).

        `job` is the RQ job when it runs in a batch (RQ's current job is then another one); `deferred`
        writers only buffer, for `flush_streams` to write a whole batch's tokens at once.
        """
        job = job if job is not None else get_current_job()
        attempt = 1
        if job is not None and job.id == job_id:  # counted in the job's meta: it survives RQ's retries
            attempt = self._attempt(job)
            job.save_meta()
        writer = StreamWriter(self.conn, job_id, self.stream_options, deferred=deferred)
        writer.open(attempt=attempt)
        return writer

    def generate(self, job_id: str, request: GenerateRequest) -> GenerateResult:
        writer = self.open_stream(job_id)
        result = self.engine.generate(request, writer, cancelled=lambda: self.cancelled(job_id))
        return self.finish_generate(job_id, writer, result)

    def finish_generate(self, job_id: str, writer: StreamWriter, result: GenerateResult) -> GenerateResult:
        """Write a generation job's `done` event and result key (after its text went through `writer`).

        Returns the result as stored: with the time the job waited in the queue.
        """
        result, done = self._generate_final(job_id, result)
        writer.finish(result, done)
        self._generate_written(job_id, result)
        return result

    def finish_generates(
        self, finished: list[tuple[str, StreamWriter, GenerateResult]]
    ) -> list[GenerateResult]:
        """`finish_generate` for the jobs a generation batch ends at one step, in one transaction."""
        finals = [(w, *self._generate_final(job_id, result)) for job_id, w, result in finished]
        finish_streams(self.conn, finals, self.stream_options)
        for (job_id, _, _), (_, result, _) in zip(finished, finals, strict=True):
            self._generate_written(job_id, result)
        return [result for _, result, _ in finals]

    def open_streams(self, jobs: list[Job], deferred: bool = True) -> list[StreamWriter]:
        """Writers (see `open_stream`; deferred by default) for jobs a batch runs together: their attempt
        counts saved and their streams' seeks in one round trip."""
        attempts = [self._attempt(job) for job in jobs]

        def save_meta(pipe: Any) -> None:
            for job in jobs:
                pipe.hset(job.key, "meta", job.serializer.dumps(job.meta))  # as `job.save_meta()` does

        writers = [StreamWriter(self.conn, job.id, self.stream_options, deferred=deferred) for job in jobs]
        openings = list(zip(writers, attempts, strict=True))
        open_streams(self.conn, openings, self.stream_options, also=save_meta)
        return writers

    def _attempt(self, job: Job) -> int:
        """Count one more attempt of `job` in its meta (saved by the caller); note its time in the queue."""
        attempt = int(job.meta.get(ATTEMPT_META, 0)) + 1
        job.meta[ATTEMPT_META] = attempt
        if job.enqueued_at is not None:
            enqueued = job.enqueued_at.replace(tzinfo=job.enqueued_at.tzinfo or timezone.utc)
            self._queued_s[job.id] = max(0.0, (now() - enqueued).total_seconds())
        return attempt

    def _generate_final(self, job_id: str, result: GenerateResult) -> tuple[GenerateResult, DoneEvent]:
        """The result as stored (with its time in the queue) and its `done` event."""
        queued_s = self._queued_s.pop(job_id, None)
        if queued_s is not None:
            result = result.model_copy(
                update={"timings": result.timings.model_copy(update={"queued_s": queued_s})}
            )
        t = result.timings
        done = DoneEvent(
            finish_reason=result.finish_reason,
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
            cached_tokens=result.usage.cached_tokens,
            ttft_s=t.ttft_s,
            decode_tokens_per_s=t.decode_tokens_per_s,
            total_s=t.total_s,
        )
        return result, done

    def _generate_written(self, job_id: str, result: GenerateResult) -> None:
        t = result.timings
        self.jobs_done += 1
        self.last_tokens_per_s = t.decode_tokens_per_s
        log.info(
            "generate done job=%s finish=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
            "queued_s=%.3f ttft_s=%.3f tokens_per_s=%.1f%s",
            job_id,
            result.finish_reason,
            result.usage.prompt_tokens,
            result.usage.cached_tokens,
            result.usage.completion_tokens,
            t.queued_s or 0.0,
            t.ttft_s or 0.0,
            t.decode_tokens_per_s or 0.0,
            self._cache_fields(),
        )

    def _cache_fields(self) -> str:
        cache = self.engine.prefix_cache
        if cache is None:
            return ""
        s = cache.stats
        return f" cache_hits={s.hits}/{s.lookups} cache_hit_tokens={s.hit_tokens} cache_bytes={s.bytes}"

    def score(self, job_id: str, request: ScoreRequest) -> ScoreResult:
        result = self.engine.score(request)
        self.finish_score(job_id, result)
        return result

    # --- score batches across jobs (driven by the worker, see `MlxqWorker`) --------------------------

    def prepare_scores(self, payloads: list[Any]) -> list[PreparedRows | Exception]:
        """Validate and tokenize score jobs' payloads, their rows together; a bad job's own error
        stands in its place (it fails alone)."""
        parsed: list[ScoreRequest | Exception] = []
        for payload in payloads:
            try:
                parsed.append(parse_score(payload))
            except Exception as e:
                parsed.append(e)
        prepared = iter(self.engine.score_tokens_many([p for p in parsed if isinstance(p, ScoreRequest)]))
        return [p if isinstance(p, Exception) else next(prepared) for p in parsed]

    def score_batch(self, prepared: list[PreparedRows]) -> list[ScoreResult]:
        """Score several jobs' rows together, shared prefixes computed once across jobs."""
        return self.engine.score_many(prepared)

    def finish_score(self, job_id: str, result: ScoreResult) -> None:
        """Write a score job's `done` event and result key."""
        writer = self.open_stream(job_id)
        writer.finish(result, _score_done(result))
        self._score_written(job_id, result)

    def finish_scores(self, finished: list[tuple[Job, ScoreResult]]) -> None:
        """`finish_score` for a batch of score jobs in three round trips, not three per job: their
        attempt counts, their streams' seeks, then one transaction with every result and `done`."""
        writers = self.open_streams([job for job, _ in finished], deferred=False)
        finals = [(w, result, _score_done(result)) for w, (_, result) in zip(writers, finished, strict=True)]
        finish_streams(self.conn, finals, self.stream_options)
        for job, result in finished:
            self._score_written(job.id, result)

    def _score_written(self, job_id: str, result: ScoreResult) -> None:
        self.jobs_done += 1
        self._queued_s.pop(job_id, None)
        log.info(
            "score done job=%s rows=%d input_tokens=%d cached_tokens=%d%s",
            job_id,
            len(result.rows),
            result.input_tokens,
            result.cached_tokens,
            self._cache_fields(),
        )


def _score_done(result: ScoreResult) -> DoneEvent:
    return DoneEvent(
        finish_reason="stop",
        prompt_tokens=result.input_tokens,
        completion_tokens=0,
        cached_tokens=result.cached_tokens,
    )
