"""What a job leaves in Redis besides RQ's records: its stream's opening and its result and `done` event.

The generation and score components hand finished work here; this module owns the attempt count (kept
in the job's meta, so it survives RQ's retries: a retried job's stream says `restart` first), the time a
job waited in its queue, the result key and `done` event written together (one transaction for all the
generation jobs that end at once; for a batch of score jobs, which write their streams only as they
end, one script call with their attempt counts and `restart` entries: `stream_scripts.py`), the per-job
log line and the worker's job counters. Failures are not written
here: the worker's failure hook ends the stream with an `error` event for every failed job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import redis
from rq.job import Job
from rq.utils import now

from mlxq.jobs.schema import DoneEvent, GenerateResult, ScoreResult
from mlxq.worker.bounded_job import BoundedJob
from mlxq.worker.job_runs import Run
from mlxq.worker.stream_scripts import finish_score_streams
from mlxq.worker.stream_writer import StreamOptions, StreamWriter, finish_streams, opened

log = logging.getLogger(__name__)

ATTEMPT_META = "mlxq_attempt"


class JobResults:
    """Opens jobs' streams and writes their results; one instance per worker process."""

    def __init__(
        self, conn: redis.Redis, options: StreamOptions, cache_fields: Callable[[], str] = lambda: ""
    ) -> None:
        self.conn = conn
        self.options = options
        self.cache_fields = cache_fields  # the prefix cache's figures for the per-job log line
        self.jobs_done = 0
        self.last_tokens_per_s: float | None = None
        self.draft_tokens = 0  # speculative decoding, over every generation job: tokens drafted...
        self.accepted_tokens = 0  # ...and those of them kept
        self._queued_s: dict[str, float] = {}  # job id -> seconds from enqueue to its stream opening

    def opening(self, deferred: bool = True) -> StreamOpening:
        """The opening of the streams of jobs that start together, sent in their start's round trip."""
        return StreamOpening(self, deferred)

    def _attempt(self, job: Job, at: datetime | None = None) -> int:
        """Count one more attempt of `job` in its meta (saved by the caller); note its time in the queue
        (until `at`: now, or the time of a batch's writes)."""
        attempt = int(job.meta.get(ATTEMPT_META, 0)) + 1
        job.meta[ATTEMPT_META] = attempt
        if job.enqueued_at is not None:
            enqueued = job.enqueued_at.replace(tzinfo=job.enqueued_at.tzinfo or timezone.utc)
            self._queued_s[job.id] = max(0.0, ((at or now()) - enqueued).total_seconds())
        return attempt

    def forget(self, job_id: str) -> None:
        """Drop what opening the stream of a job noted (it failed: no result will be written): a
        worker lives for days, and every job it fails would otherwise stay noted."""
        self._queued_s.pop(job_id, None)

    def finish_generates(
        self, finished: list[tuple[str, StreamWriter, GenerateResult]]
    ) -> list[GenerateResult]:
        """Write the `done` events and result keys of the generation jobs that ended at one step, in one
        transaction (after their text went through their writers). Returns the results as stored:
        with the time each job waited in the queue."""
        finals = [(w, *self._generate_final(job_id, result)) for job_id, w, result in finished]
        finish_streams(self.conn, finals, self.options)
        for (job_id, _, _), (_, result, _) in zip(finished, finals, strict=True):
            self._generate_written(job_id, result)
        return [result for _, result, _ in finals]

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
            draft_tokens=result.usage.draft_tokens,
            accepted_tokens=result.usage.accepted_tokens,
        )
        return result, done

    def _generate_written(self, job_id: str, result: GenerateResult) -> None:
        t = result.timings
        self.jobs_done += 1
        self.last_tokens_per_s = t.decode_tokens_per_s
        self.draft_tokens += result.usage.draft_tokens
        self.accepted_tokens += result.usage.accepted_tokens
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
            self.cache_fields(),
        )

    def finish_scores(self, finished: list[tuple[Job, ScoreResult]]) -> list[Any]:
        """Write score jobs' attempt counts, results and `done` events (and a `restart` where an earlier
        attempt wrote the stream) by one script call for them all (`stream_scripts.py`), and log one
        line for the batch (a line a job at DEBUG). Returns each result as written (JSON-ready): RQ's
        end keeps the same value, dumped once."""
        values = [result.model_dump(mode="json") for _, result in finished]
        at = now()
        finals = [
            (job, self._attempt(job, at), value, _score_done(result))
            for (job, result), value in zip(finished, values, strict=True)
        ]
        texts = finish_score_streams(self.conn, finals, self.options)
        for (job, _), value, text in zip(finished, values, texts, strict=True):
            self.jobs_done += 1
            self._queued_s.pop(job.id, None)
            if isinstance(job, BoundedJob):  # RQ's end sends the same text: not dumped again
                job.returned = (value, text.encode())
        if finished and log.isEnabledFor(logging.DEBUG):
            for job, result in finished:
                log.debug(
                    "score done job=%s rows=%d input_tokens=%d cached_tokens=%d",
                    job.id,
                    len(result.rows),
                    result.input_tokens,
                    result.cached_tokens,
                )
        if finished and log.isEnabledFor(logging.INFO):
            log.info(
                "score done jobs=%d rows=%d input_tokens=%d cached_tokens=%d%s ids=%s",
                len(finished),
                sum(len(result.rows) for _, result in finished),
                sum(result.input_tokens for _, result in finished),
                sum(result.cached_tokens for _, result in finished),
                self.cache_fields(),
                ",".join(job.id for job, _ in finished),
            )
        return values


class StreamOpening:
    """The opening of the streams of jobs that start together, sent in their start's round trip (a
    `Rider` of `RqBatches.start`): each job's attempt count saved in its meta (as `job.save_meta()`
    saves it: it survives RQ's retries, so a retried job's stream says `restart` first) and its
    stream's last entry read. `writers()` then gives their writers, a `restart` entry written where an
    earlier attempt wrote. Deferred writers only buffer, for `flush_streams` to write a whole batch's
    tokens at once."""

    def __init__(self, results: JobResults, deferred: bool = True) -> None:
        self.results = results
        self.deferred = deferred
        self._jobs: list[Job] = []
        self._openings: list[tuple[StreamWriter, int]] | None = None
        self._replies: list[Any] = []

    def queue(self, pipe: Any, runs: list[Run]) -> None:
        if self._openings is None:  # attempts counted once, however often the round trip is sent
            results = self.results
            self._jobs = [run.job for run in runs]
            self._openings = [
                (StreamWriter(results.conn, job.id, results.options, self.deferred), results._attempt(job))
                for job in self._jobs
            ]
        for job in self._jobs:
            pipe.hset(job.key, "meta", job.serializer.dumps(job.meta))
        for w, _ in self._openings:
            w.seek(pipe)

    def replied(self, replies: list[Any]) -> None:
        self._replies = replies

    def writers(self) -> list[StreamWriter]:
        """The jobs' writers, their streams opened; the error of a write that failed is raised here."""
        for reply in self._replies:
            if isinstance(reply, Exception):
                raise reply
        openings = self._openings or []
        opened(openings, self._replies[len(self._jobs) :])
        return [w for w, _ in openings]


# A score job's `done` entry: the same fields every time but its token counts (`_score_done`).
_SCORE_DONE = DoneEvent(finish_reason="stop", prompt_tokens=0, completion_tokens=0, cached_tokens=0).fields()


def _score_done(result: ScoreResult) -> dict[str, str]:
    """The fields of a score job's `done` entry (`DoneEvent.fields`), without building the event."""
    return {
        **_SCORE_DONE,
        "prompt_tokens": str(result.input_tokens),
        "cached_tokens": str(result.cached_tokens),
    }
