"""The RQ worker: one process, one loaded model, jobs run in-process.

Built on RQ's `SimpleWorker` (RQ's forking `Worker` would lose the model after every job) with what it
lacks for model jobs: a `JobWatch` thread that heartbeats while jobs run (so RQ never reaps a live job
as abandoned, and a killed worker's jobs are found within a few heartbeats) and polls cancel keys; an
allowlist of job functions checked before anything is imported by name; a failure hook that ends the
job's stream with an `error` event; and two kinds of batches, each job in them still finishing or
failing on its own through RQ's own lifecycle (`_finalize_success` / `_finalize_failure`):

- score batches: after RQ hands over a score job, more queued score jobs are claimed (`ScoreClaimer`)
  and scored together;
- generation batches (`max_batch_sequences` > 1): after RQ hands over a generation job, the worker keeps
  a running `GenerationBatch`. Every `admit_every` steps, never blocking, it claims more queued
  generation jobs up to the free slots (`JobClaimer`, the same Lua move as score claims) and admits
  them while the others decode; each job leaves the moment it ends. Score jobs found in the queue at
  those points are claimed and scored right there, between two decode steps: a decode stall of one
  score batch, so scoring never waits for a busy batch to drain and streams pause a bounded time.
  The batch ends when its last job does; then RQ's own loop dequeues again. A first SIGTERM stops the
  admissions and lets the batch finish; a second one cancels every job in it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException
from rq.utils import now

from jobs import keys, parse_generate
from jobs.errors import ForbiddenJob

from .executor import JobExecutor
from .generation_batch import Finished, GenerationBatch
from .job_claim import JobClaimer, QueuedJob
from .job_watch import JobWatch
from .score_claim import ScoreClaimer, ScorePicker
from .stream_writer import REDIS_TRANSIENT, StreamOptions, StreamWriter, flush_streams

log = logging.getLogger(__name__)

_STATS_EVERY_S = 1.0  # how often a running generation batch republishes the worker's stats


@dataclass(frozen=True)
class BatchOptions:
    """How a worker batches generation jobs (see the module docstring)."""

    max_sequences: int = 1  # 1: one generation job at a time, no batching
    kv_budget_bytes: int = 0  # padded KV of the running batch; 0: no limit
    admit_every: int = 4  # decode steps between looks at the queue


@dataclass
class _BatchJob:
    job: Job
    queue: Queue
    execution: Any
    writer: StreamWriter | None = None


class MlxqWorker(SimpleWorker):
    """An RQ worker that runs only `jobs.generate`/`jobs.score`, with JSON payloads, in-process."""

    def __init__(
        self,
        queues: list[str],
        *,
        connection: redis.Redis,
        stream_options: StreamOptions,
        heartbeat_s: float = 10.0,
        cancel_poll_s: float = 0.1,
        default_job_timeout: int = 3600,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("log_job_description", False)  # descriptions hold prompts: keep them out of logs
        super().__init__(queues, connection=connection, serializer=JSONSerializer, **kwargs)
        self.stream_options = stream_options
        self.heartbeat_s = heartbeat_s
        self.cancel_poll_s = cancel_poll_s
        self.default_job_timeout = default_job_timeout
        self.executor: JobExecutor | None = None
        self.score_claimer: ScoreClaimer | None = None  # None: one score job at a time
        self.batch_options = BatchOptions()
        self.job_claimer: JobClaimer | None = None  # set when generation jobs are batched
        self.active_sequences = 0
        self.after_job: Callable[[], None] = lambda: None
        self.publish_stats: Callable[[], None] = lambda: None  # while a batch runs, every second
        self._watch: JobWatch | None = None
        self._force_stop = False

    # --- what the executor asks --------------------------------------------------------------------

    def is_cancelled(self, job_id: str) -> bool:
        """True once the job's cancel key was seen, or a second SIGTERM/SIGINT arrived."""
        watch = self._watch
        return self._force_stop or (watch is not None and job_id in watch.cancelled)

    # --- RQ hooks ----------------------------------------------------------------------------------

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # Short, refreshed by the watch thread: a killed worker's job is noticed within a few beats.
        return int(self.heartbeat_s * 3 + 5)

    def execute_job(self, job: Job, queue: Queue) -> None:
        problem = _forbidden_reason(job)
        if problem is not None:
            self._reject(job, queue, problem)
        elif (
            job.func_name == keys.SCORE_FUNC and self.score_claimer is not None and self.executor is not None
        ):
            self._execute_score_batch(job, queue)
        elif job.func_name == keys.GENERATE_FUNC and self._batching:
            self._execute_generate_batch(job, queue)
        else:
            self._execute_one(job, queue)
        self.set_state("idle")
        self.after_job()

    def handle_job_failure(
        self,
        job: Job,
        queue: Queue,
        started_job_registry: Any = None,
        exc_string: str = "",
        execution: Any = None,
    ) -> None:
        will_retry = job.should_retry and self._stopped_job_id != job.id
        if not will_retry:
            self._end_stream_with_error(job, exc_string)
        super().handle_job_failure(
            job, queue, started_job_registry=started_job_registry, exc_string=exc_string, execution=execution
        )

    def request_force_stop(self, signum: int, frame: Any) -> None:
        """Second SIGTERM/SIGINT: cancel the running job cleanly (it ends `cancelled`), then exit."""
        if self._watch is not None and not self._force_stop:
            log.warning("second stop signal: cancelling jobs=%s", ",".join(self._watch.job_ids()))
            self._force_stop = True
            return
        super().request_force_stop(signum, frame)

    # --- running jobs ------------------------------------------------------------------------------

    def _start(self, job: Job) -> Any:
        if job.timeout is None:  # RQ's own default (180 s) is too short for long generations
            job.timeout = self.default_job_timeout
        return self.prepare_execution(job)

    def _execute_one(self, job: Job, queue: Queue) -> None:
        execution = self._start(job)
        with JobWatch(self, [(job, execution)], self.heartbeat_s, self.cancel_poll_s) as watch:
            self._watch = watch
            try:
                self.perform_job(job, queue, execution)
            finally:
                self._watch = None

    def _start_claimed(self, job: Job) -> Any:
        """Start a job that is in RQ's intermediate list (dequeued or claimed) outside `perform_job`."""
        execution = self._start(job)
        self.prepare_job_execution(job, remove_from_intermediate_queue=True)
        job.started_at = now()
        return execution

    def _execute_score_batch(self, first: Job, queue: Queue) -> None:
        """Score `first` together with more queued score jobs; each job ends on its own."""
        assert self.score_claimer is not None and self.executor is not None
        jobs = [first, *self.score_claimer.claim(queue, rows_taken=_rows_of(first))]
        runs = [(job, self._start_claimed(job)) for job in jobs]
        with JobWatch(self, runs, self.heartbeat_s, self.cancel_poll_s) as watch:
            self._watch = watch
            try:
                self._score_runs(runs, queue)
            finally:
                self._watch = None

    def _score_runs(self, runs: list[tuple[Job, Any]], queue: Queue) -> None:
        assert self.executor is not None
        ready = []
        for job, execution in runs:
            try:
                ready.append((job, execution, self.executor.prepare_score(job.args[0])))
            except Exception:  # a bad job fails alone; its batch-mates go on
                self._finalize_failure(job, queue, execution, sys.exc_info())
        if not ready:
            return
        try:
            results = self.executor.score_batch([rows for _, _, rows in ready])
        except Exception:
            log.exception("score batch failed; scoring its jobs one by one jobs=%d", len(ready))
            results = None
        scored = []
        for i, (job, execution, rows) in enumerate(ready):
            try:
                scored.append(
                    (
                        job,
                        execution,
                        results[i] if results is not None else self.executor.score_batch([rows])[0],
                    )
                )
            except Exception:
                self._finalize_failure(job, queue, execution, sys.exc_info())
        try:  # every job's result and `done` in one go; a failed write fails them all (RQ may retry)
            self.executor.finish_scores([(job, result) for job, _, result in scored])
        except Exception:
            for job, execution, _ in scored:
                self._finalize_failure(job, queue, execution, sys.exc_info())
            return
        for job, execution, result in scored:
            try:
                self._finalize_success(job, queue, execution, result.model_dump(mode="json"))
            except Exception:
                self._finalize_failure(job, queue, execution, sys.exc_info())

    # --- generation batches ------------------------------------------------------------------------

    @property
    def _batching(self) -> bool:
        return (
            self.batch_options.max_sequences > 1
            and self.job_claimer is not None
            and self.executor is not None
        )

    def _execute_generate_batch(self, first: Job, queue: Queue) -> None:
        """Run `first` in a generation batch that admits more queued jobs until the batch is empty."""
        assert self.executor is not None
        opts = self.batch_options
        batch = GenerationBatch(self.executor.engine, opts.max_sequences, opts.kv_budget_bytes)
        jobs: dict[str, _BatchJob] = {}
        with JobWatch(self, [], self.heartbeat_s, self.cancel_poll_s) as watch:
            self._watch = watch
            last_stats = time.monotonic()
            try:
                self._admit(batch, jobs, [first], queue, watch)
                while len(batch):
                    if batch.steps % opts.admit_every == 0:
                        try:
                            self._claim_between_steps(batch, jobs, watch)
                        except REDIS_TRANSIENT as e:  # the running jobs go on; claimed ones return
                            log.warning("generation batch could not claim jobs error=%s", e)
                    self._retire_all([(jobs.pop(done.key), done) for done in batch.step()], watch)
                    writers = [j.writer for j in jobs.values() if j.writer is not None]
                    flush_streams(self.connection, writers, self.stream_options)
                    self.active_sequences = len(batch)
                    if time.monotonic() - last_stats >= _STATS_EVERY_S:
                        last_stats = time.monotonic()
                        self.publish_stats()
            except BaseException as e:  # as RQ's perform_job: whatever stops the loop fails what is left
                for done in batch.abort(e):
                    self._retire(jobs.pop(done.key), done, watch)
                raise
            finally:
                self._watch = None
                self.active_sequences = 0

    def _claim_between_steps(
        self, batch: GenerationBatch, jobs: dict[str, _BatchJob], watch: JobWatch
    ) -> None:
        """Admit queued generation jobs into free slots; score queued score jobs right now."""
        assert self.job_claimer is not None
        if self._stop_requested or self._force_stop:
            return
        if self.should_run_maintenance_tasks:  # a batch may run for hours: keep RQ's housekeeping going
            self.run_maintenance_tasks()
        for queue in self.queues:
            score = ScorePicker(self.score_claimer.budget) if self.score_claimer is not None else None
            pick = _BatchPicker(batch.free_slots, score)
            if pick.limit <= 0:
                return
            claimed = self.job_claimer.claim(queue, pick, pick.limit)
            scores = [job for job in claimed if job.func_name == keys.SCORE_FUNC]
            self._admit(
                batch, jobs, [job for job in claimed if job.func_name != keys.SCORE_FUNC], queue, watch
            )
            if claimed:
                log.info(
                    "generation batch claimed=%d scored=%d active=%d",
                    len(claimed) - len(scores),
                    len(scores),
                    len(batch),
                )
            if scores:
                self._score_between_steps(scores, queue, watch)

    def _score_between_steps(self, scores: list[Job], queue: Queue, watch: JobWatch) -> None:
        runs = []
        for job in scores:
            problem = _forbidden_reason(job)
            if problem is not None:
                self._reject(job, queue, problem)
                continue
            runs.append((job, self._start_claimed(job)))
            watch.add(*runs[-1])
        try:
            self._score_runs(runs, queue)
        finally:
            for job, _ in runs:
                watch.remove(job.id)

    def _admit(
        self,
        batch: GenerationBatch,
        jobs: dict[str, _BatchJob],
        claimed: list[Job],
        queue: Queue,
        watch: JobWatch,
    ) -> None:
        """Start generation jobs in the batch (their streams opened together); a bad one fails alone."""
        assert self.executor is not None
        started = []
        for job in claimed:
            problem = _forbidden_reason(job)
            if problem is not None:
                self._reject(job, queue, problem)
                continue
            started.append(_BatchJob(job, queue, self._start_claimed(job)))
            watch.add(job, started[-1].execution)
        if not started:
            return
        try:
            writers = self.executor.open_streams([entry.job for entry in started])
        except Exception:
            for entry in started:
                watch.remove(entry.job.id)
                self._finalize_failure(entry.job, queue, entry.execution, sys.exc_info())
            return
        for entry, writer in zip(started, writers, strict=True):
            entry.writer = writer
            try:
                request = parse_generate(entry.job.args[0])
                batch.admit(entry.job.id, request, writer, self._cancel_check(entry.job))
            except Exception:
                watch.remove(entry.job.id)
                self._finalize_failure(entry.job, queue, entry.execution, sys.exc_info())
                continue
            jobs[entry.job.id] = entry

    def _cancel_check(self, job: Job) -> Callable[[], bool]:
        """The job's cancel check; past its timeout it raises, as RQ's death penalty would."""
        timeout = int(job.timeout or self.default_job_timeout)
        deadline = time.monotonic() + timeout if timeout > 0 else float("inf")

        def cancelled() -> bool:
            if time.monotonic() > deadline:
                raise JobTimeoutException(f"Task exceeded maximum timeout value ({timeout} seconds)")
            return self.is_cancelled(job.id)

        return cancelled

    def _retire_all(self, ended: list[tuple[_BatchJob, Finished]], watch: JobWatch) -> None:
        """Finish the jobs one step ended: results and `done` events in one transaction, then each
        job through RQ. Failed ones go one by one."""
        assert self.executor is not None
        ok = []
        for entry, done in ended:
            if done.error is None and done.result is not None and entry.writer is not None:
                ok.append((entry, entry.writer, done.result))
            else:
                self._retire(entry, done, watch)
        if not ok:
            return
        try:
            results = self.executor.finish_generates([(entry.job.id, w, result) for entry, w, result in ok])
        except Exception:
            for entry, _, _ in ok:
                watch.remove(entry.job.id)
                self._finalize_failure(entry.job, entry.queue, entry.execution, sys.exc_info())
            return
        for (entry, _, _), result in zip(ok, results, strict=True):
            watch.remove(entry.job.id)
            try:
                self._finalize_success(
                    entry.job, entry.queue, entry.execution, result.model_dump(mode="json")
                )
            except Exception:
                self._finalize_failure(entry.job, entry.queue, entry.execution, sys.exc_info())

    def _retire(self, entry: _BatchJob, done: Finished, watch: JobWatch) -> None:
        """Finish one job of the batch through RQ: its stream's end, result and status."""
        assert self.executor is not None
        job, queue, execution = entry.job, entry.queue, entry.execution
        watch.remove(job.id)
        if done.error is not None:
            e = done.error
            self._finalize_failure(job, queue, execution, (type(e), e, e.__traceback__))
            return
        assert done.result is not None and entry.writer is not None
        try:
            result = self.executor.finish_generate(job.id, entry.writer, done.result)
            self._finalize_success(job, queue, execution, result.model_dump(mode="json"))
        except Exception:
            self._finalize_failure(job, queue, execution, sys.exc_info())

    def _reject(self, job: Job, queue: Queue, reason: str) -> None:
        log.warning("rejected job=%s reason=%s", job.id, reason)
        job.retries_left = 0
        execution = self.prepare_execution(job)
        self.handle_job_failure(
            job, queue, exc_string=f"{ForbiddenJob.__name__}: {reason}", execution=execution
        )

    def _end_stream_with_error(self, job: Job, exc_string: str) -> None:
        message = _last_line(exc_string) or "the job failed"
        try:
            StreamWriter(self.connection, job.id, self.stream_options).error_once(message)
        except Exception:  # the failure itself is recorded by RQ; a stream write must not hide it
            log.exception("could not write error event job=%s", job.id)


class _BatchPicker:
    """Chooses queued jobs at a generation batch's admission point: generation jobs for its free
    slots, and score jobs within the score batch budget (scored between two decode steps)."""

    def __init__(self, free_slots: int, score: ScorePicker | None) -> None:
        self.free = max(0, free_slots)
        self.score = score
        self.limit = self.free + (score.jobs_left if score is not None else 0)

    def __call__(self, queued: QueuedJob) -> bool:
        if queued.func == keys.GENERATE_FUNC:
            if self.free <= 0:
                return False
            self.free -= 1
            return True
        return self.score is not None and self.score(queued)


def _forbidden_reason(job: Job) -> str | None:
    """Why this job must not run here, or None. Checked before RQ imports anything by name."""
    try:
        func_name = job.func_name
        args, kwargs = job.args, job.kwargs
    except Exception as e:
        return f"the payload is not JSON in RQ's JSON format ({type(e).__name__}: {e}); mlxq never unpickles"
    if func_name not in keys.JOB_FUNCS:
        allowed = ", ".join(sorted(keys.JOB_FUNCS))
        return f"function {func_name!r} is not an mlxq job; this worker runs only {allowed}"
    if len(args) != 1 or kwargs:
        return (
            f"{func_name} takes exactly one argument, the request object (got {len(args)} "
            f"positional and {len(kwargs)} keyword arguments)"
        )
    return None


def _rows_of(job: Job) -> int:
    payload = job.args[0]
    rows = payload.get("rows") if isinstance(payload, dict) else None
    return len(rows) if isinstance(rows, list) else 0


def _last_line(exc_string: str) -> str:
    lines = [line for line in exc_string.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
