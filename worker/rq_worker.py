"""The RQ worker: one process, one loaded model, jobs run in-process.

Built on RQ's `SimpleWorker` (RQ's forking `Worker` would lose the model after every job) with what it
lacks for model jobs: a `JobWatch` thread that heartbeats while jobs run (so RQ never reaps a live job
as abandoned, and a killed worker's jobs are found within a few heartbeats) and polls cancel keys; an
allowlist of job functions checked before anything is imported by name; a failure hook that ends the
job's stream with an `error` event; and two kinds of batches, each job in them still finishing or
failing on its own through RQ's own lifecycle (`_finalize_success` / `_finalize_failure`):

- score batches: after RQ hands over a score job, more queued score jobs are claimed (`ScoreClaimer`)
  and scored together;
- generation batches (`max_batch_sequences` > 1): see `generation_jobs.py`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from datetime import datetime
from time import monotonic
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.rate_limit import release_slot
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import WorkerStatus

from jobs import keys
from jobs.errors import ForbiddenJob
from worker.allowlist import forbidden_reason
from worker.executor import JobExecutor
from worker.generation_jobs import BatchOptions, GenerationJobs
from worker.job_claim import JobClaimer
from worker.job_watch import JobWatch
from worker.score_claim import ScoreClaimer
from worker.stream_writer import REDIS_TRANSIENT, StreamOptions, StreamWriter, retrying

log = logging.getLogger(__name__)

_BEAT_AGAIN_S = 1.0  # a heartbeat repeating the last one's TTL sooner than this is skipped (`heartbeat`)
Ended = tuple[Job, Queue, Any, Any]  # a job that returned: (job, its queue, its execution, the return value)
_STUCK = "Job was stuck in intermediate queue."  # what RQ's IntermediateQueue.cleanup fails jobs with


class MlxqWorker(GenerationJobs, SimpleWorker):
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
        self._last_beat = (-1e9, 0)  # (monotonic time, TTL) of the last heartbeat

    # --- what the executor asks --------------------------------------------------------------------

    def is_cancelled(self, job_id: str) -> bool:
        """True once the job's cancel key was seen, or a second SIGTERM/SIGINT arrived."""
        watch = self._watch
        return self._force_stop or (watch is not None and job_id in watch.cancelled)

    # --- RQ hooks ----------------------------------------------------------------------------------

    def set_state(self, state: str, pipeline: Any = None) -> None:
        """RQ's worker state; on its own (no pipeline) a step of RQ's loop between jobs (`_between_jobs`)."""
        if pipeline is not None:
            super().set_state(state, pipeline)
        else:
            self._between_jobs(super().set_state, state)

    def check_for_suspension(self, burst: bool) -> None:
        self._between_jobs(super().check_for_suspension, burst)

    def run_maintenance_tasks(self) -> None:
        self._between_jobs(super().run_maintenance_tasks)

    def _between_jobs(self, step: Callable[..., Any], *args: Any) -> bool:
        """A step of RQ's loop between jobs (the worker's state, its heartbeat, the suspension check,
        maintenance), where a Redis that is restarting would make RQ quit: the worker process would
        exit, its loaded model and warm cache with it. Here the step is skipped with a warning (False);
        the dequeue that follows waits for Redis with RQ's own backoff, and the next round does it again."""
        try:
            step(*args)
        except REDIS_TRANSIENT as e:
            log.warning("redis unreachable between jobs; skipped step=%s error=%s", step.__name__, e)
            return False
        return True

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's worker heartbeat (the worker key's `last_heartbeat` and TTL, its executions key's TTL)
        in one round trip instead of three. RQ's loop beats after each job and twice around each
        dequeue: a beat of its own (no pipeline) that gives the TTL the last beat gave, less than
        `_BEAT_AGAIN_S` after it, is skipped, so a lone job costs one beat, not three. A beat after a
        dequeue that blocked, or one that changes the TTL (a job's shorter one, RQ's idle one after
        it), always goes out."""
        ttl = timeout or self.worker_ttl + 60
        at = monotonic()
        if pipeline is not None:
            super().heartbeat(timeout, pipeline)
        else:
            last_at, last_ttl = self._last_beat
            if ttl == last_ttl and at - last_at < _BEAT_AGAIN_S:
                return
            with self.connection.pipeline(transaction=False) as pipe:
                super().heartbeat(timeout, pipe)
                if not self._between_jobs(pipe.execute):
                    return
        self._last_beat = (at, ttl)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # Short, refreshed by the watch thread: a killed worker's job is noticed within a few beats.
        return int(self.heartbeat_s * 3 + 5)

    def execute_job(self, job: Job, queue: Queue) -> None:
        problem = forbidden_reason(job)
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
        if exc_string == _STUCK and execution is None and job.get_status(refresh=False) == JobStatus.QUEUED:
            self._requeue_stuck(job, queue)
            return
        will_retry = job.should_retry and self._stopped_job_id != job.id
        if not will_retry:
            self._end_stream_with_error(job, exc_string)
        super().handle_job_failure(
            job, queue, started_job_registry=started_job_registry, exc_string=exc_string, execution=execution
        )

    def _requeue_stuck(self, job: Job, queue: Queue) -> None:
        """Put back at the head of its queue a job RQ's maintenance found in the intermediate list a
        minute after it got there, never started: a worker took it (BLMOVE, or a claim) and never got
        to start it, as when Redis restarts between executing the move and sending its reply. It never
        ran, so it runs now rather than failing with "stuck in intermediate queue" as RQ would have it.
        RQ's cleanup takes it off the intermediate list next; its first-seen mark goes, so a worker
        that takes the job again is not judged by the old one."""
        log.warning("requeued a job taken but never started job=%s queue=%s", job.id, queue.name)
        with self.connection.pipeline() as pipe:
            queue.push_job_id(job.id, pipeline=pipe, at_front=True)
            pipe.delete(queue.intermediate_queue.get_first_seen_key(job.id))
            pipe.execute()

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

    def _start_claimed(self, jobs: list[Job]) -> list[Any]:
        """Start jobs that are in RQ's intermediate list (dequeued or claimed) outside `perform_job`, all
        in one transaction; returns their executions.

        What RQ's `prepare_execution` and `prepare_job_execution` write for one job (an execution record
        in the started registry, the job's status, worker name and heartbeat, the job off the
        intermediate list, the worker busy), for many jobs at once: a batch of 64 claimed jobs started
        in one round trip, not 128. Redis restarting meanwhile is retried (as stream writes are), not
        fatal: an error escaping `execute_job` makes RQ's loop stop the whole worker."""
        if not jobs:
            return []

        intermediate = {  # each origin's intermediate list: one Queue made per origin, not per job
            origin: Queue(origin, connection=self.connection).intermediate_queue_key
            for origin in {job.origin for job in jobs}
        }

        def start() -> list[Execution]:
            executions = []
            with self.connection.pipeline() as pipe:
                for job in jobs:
                    if job.timeout is None:  # RQ's own default (180 s) is too short for long generations
                        job.timeout = self.default_job_timeout
                    ttl = self.get_heartbeat_ttl(job)
                    executions.append(Execution.create(job, ttl, pipeline=pipe, worker_name=self.name))
                    job.heartbeat(now(), ttl, pipeline=pipe)
                    job.prepare_for_execution(self.name, pipeline=pipe)
                    pipe.persist(job.key)
                    pipe.lrem(intermediate[job.origin], 1, job.id)
                self.set_state(WorkerStatus.BUSY, pipeline=pipe)
                self.heartbeat(self.get_heartbeat_ttl(jobs[0]), pipeline=pipe)
                pipe.execute()
            return executions

        executions = retrying(self.stream_options)(start)
        for job, execution in zip(jobs, executions, strict=True):
            self.executions[execution.id] = execution
            job.started_at = now()
        return executions

    def _start_allowed(self, jobs: list[Job], queue: Queue) -> list[tuple[Job, Any]]:
        """Fail the claimed jobs this worker must not run (`forbidden_reason`: claims already leave such
        jobs queued, this is the same check a dequeued job gets), start the others together
        (`_start_claimed`); returns (job, execution) for those started."""
        allowed = []
        for job in jobs:
            problem = forbidden_reason(job)
            if problem is None:
                allowed.append(job)
            else:
                self._reject(job, queue, problem)
        return list(zip(allowed, self._start_claimed(allowed), strict=True))

    def _finalize_success(self, job: Job, queue: Queue, execution: Any, return_value: Any) -> None:
        """RQ's end of a successful job, retried while Redis restarts (see `_start_claimed`)."""
        retrying(self.stream_options)(super()._finalize_success, job, queue, execution, return_value)

    def _finalize_successes(self, ended: list[Ended]) -> None:
        """RQ's end of many successful jobs: what `_finalize_success` writes for each, for all of them
        in one transaction (`_end_together`), where RQ makes four round trips per job. A job with
        dependents or repeats left, and every job when that transaction fails for good, ends on its own
        through RQ (`_finalize_success`); a job whose end fails is failed with the reason."""
        alone = [item for item in ended if item[0].repeats_left]
        together = [item for item in ended if not item[0].repeats_left]
        if together:
            try:
                done = retrying(self.stream_options)(self._end_together, together)
            except Exception:
                log.exception("could not end jobs together; ending them one by one jobs=%d", len(together))
                done = [False] * len(together)
            for (job, *_), ok in zip(together, done, strict=True):
                if ok:  # after the commit, as RQ does: a rate limit's slot, webhooks
                    release_slot(job)
                    job.send_webhooks(JobStatus.FINISHED)
                    self.log.info("Worker %s: %s: Job OK (%s)", self.name, job.origin, job.id)
            alone.extend(item for item, ok in zip(together, done, strict=True) if not ok)
        for job, queue, execution, value in alone:
            try:
                self._finalize_success(job, queue, execution, value)
            except Exception:
                self._finalize_failure(job, queue, execution, sys.exc_info())

    def _end_together(self, ended: list[Ended]) -> list[bool]:
        """End the jobs without dependents in one MULTI/EXEC, each as RQ's `handle_job_success` ends one
        (result, status, registries, the job's TTLs, its execution record, the worker's counters); which
        ones it ended. The dependents sets are watched before they are read, so a dependent added before
        the commit makes it start over, as in RQ."""
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*(job.dependents_key for job, *_ in ended))
                    with self.connection.pipeline(transaction=False) as reads:
                        for job, *_ in ended:
                            reads.exists(job.dependents_key)
                        free = [not n for n in reads.execute()]
                    pipe.multi()
                    at = now()
                    working = 0.0
                    for (job, _, execution, value), ok in zip(ended, free, strict=True):
                        if ok:
                            self._write_success(job, execution, value, at, pipe)
                            working += (at - (job.started_at or at)).total_seconds()
                    if any(free):  # the worker's counters, as RQ adds them a job at a time
                        pipe.hincrby(self.key, "successful_job_count", sum(free))
                        pipe.hincrbyfloat(self.key, "total_working_time", working)
                    pipe.execute()
                    return free
                except redis.WatchError:
                    continue

    def _write_success(self, job: Job, execution: Any, value: Any, at: datetime, pipe: Any) -> None:
        """Queue on `pipe` what RQ's `_finalize_success` writes for a job with no dependents or repeats,
        but the worker's counters (`_end_together` adds them for all its jobs at once)."""
        job.ended_at = at
        job.heartbeat(at, job.success_callback_timeout, pipeline=pipe)
        job._result = value
        job._status = JobStatus.FINISHED
        result_ttl = job.get_result_ttl(self.default_result_ttl)
        if result_ttl != 0:
            job._handle_success(
                result_ttl,
                pipeline=pipe,
                worker_name=self.name,
                execution_id=execution.id,
                execution_started_at=execution.created_at,
                execution_ended_at=at,
            )
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        self.cleanup_execution(job, pipeline=pipe, execution=execution)

    def _finalize_failure(self, job: Job, queue: Queue, execution: Any, exc_info: Any) -> None:
        """RQ's end of a failed job, retried while Redis restarts (see `_start_claimed`)."""
        retrying(self.stream_options)(super()._finalize_failure, job, queue, execution, exc_info)

    def _execute_score_batch(self, first: Job, queue: Queue) -> None:
        """Score `first` together with more queued score jobs; each job ends on its own."""
        assert self.score_claimer is not None and self.executor is not None
        try:
            claimed = self.score_claimer.claim(queue, rows_taken=_rows_of(first))
        except REDIS_TRANSIENT as e:  # Redis restarting: score `first` alone; the rest stay queued
            log.warning("score batch could not claim jobs error=%s", e)
            claimed = []
        runs = self._start_allowed([first, *claimed], queue)
        with JobWatch(self, runs, self.heartbeat_s, self.cancel_poll_s) as watch:
            self._watch = watch
            try:
                self._score_runs(runs, queue)
            finally:
                self._watch = None

    def _score_runs(self, runs: list[tuple[Job, Any]], queue: Queue) -> None:
        assert self.executor is not None
        ready = []
        for (job, execution), rows in zip(runs, self._prepare(runs), strict=True):
            if isinstance(rows, Exception):  # a bad job fails alone; its batch-mates go on
                self._finalize_failure(job, queue, execution, (type(rows), rows, rows.__traceback__))
            else:
                ready.append((job, execution, rows))
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
        self._finalize_successes(
            [(job, queue, execution, result.model_dump(mode="json")) for job, execution, result in scored]
        )

    def _prepare(self, runs: list[tuple[Job, Any]]) -> list[Any]:
        """Each run's tokenized rows or its own error (`Executor.prepare_scores`)."""
        assert self.executor is not None
        try:
            return self.executor.prepare_scores([job.args[0] for job, _ in runs])
        except Exception:  # not a job's own error (those come back in its place): each job alone
            log.exception("preparing a score batch failed; preparing its jobs one by one jobs=%d", len(runs))
        out = []
        for job, _ in runs:
            try:
                out.extend(self.executor.prepare_scores([job.args[0]]))
            except Exception as e:
                out.append(e)
        return out

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


def _rows_of(job: Job) -> int:
    payload = job.args[0]
    rows = payload.get("rows") if isinstance(payload, dict) else None
    return len(rows) if isinstance(rows, list) else 0


def _last_line(exc_string: str) -> str:
    lines = [line for line in exc_string.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
