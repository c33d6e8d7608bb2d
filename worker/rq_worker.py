"""The RQ worker: one process, one loaded model, jobs run in-process.

Built on RQ's `SimpleWorker` (RQ's forking `Worker` would lose the model after every job) with what it
lacks for long model jobs: a watcher thread that heartbeats while a job runs (so RQ never reaps a live
job as abandoned, and a killed worker's jobs are found within a few heartbeats) and polls the job's
cancel key; an allowlist of job functions checked before anything runs; and a failure hook that ends
the job's stream with an `error` event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.errors import ForbiddenJob

from .stream_writer import REDIS_TRANSIENT, StreamOptions, StreamWriter

log = logging.getLogger(__name__)


class JobWatch:
    """Background thread for the running job: heartbeats and cancellation, never touching MLX."""

    def __init__(self, worker: MlxqWorker, job: Job, execution: Any) -> None:
        self.worker = worker
        self.job = job
        self.execution = execution
        self.cancelled = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{job.id}", daemon=True)

    def __enter__(self) -> JobWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        conn = self.worker.connection
        key = keys.cancel_key(self.job.id)
        beat_every = self.worker.heartbeat_s
        poll = self.worker.cancel_poll_s
        since_beat = 0.0
        while not self._stop.wait(poll):
            try:
                if not self.cancelled and conn.exists(key):
                    log.info("cancel requested job=%s", self.job.id)
                    self.cancelled = True
                since_beat += poll
                if since_beat >= beat_every:
                    since_beat = 0.0
                    self.worker.maintain_heartbeats(self.job, self.execution)
            except REDIS_TRANSIENT as e:  # Redis restarting: keep the job running, try again next tick
                log.warning("watch redis error job=%s error=%s", self.job.id, e)


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
        super().__init__(queues, connection=connection, serializer=JSONSerializer, **kwargs)
        self.stream_options = stream_options
        self.default_job_timeout = default_job_timeout
        self.after_job: Callable[[], None] = lambda: None
        self.heartbeat_s = heartbeat_s
        self.cancel_poll_s = cancel_poll_s
        self._watch: JobWatch | None = None
        self._force_stop = False

    # --- what the executor asks --------------------------------------------------------------------

    def is_cancelled(self, job_id: str) -> bool:
        """True once the running job's cancel key was seen, or a second SIGTERM/SIGINT arrived."""
        watch = self._watch
        return self._force_stop or (watch is not None and watch.job.id == job_id and watch.cancelled)

    # --- RQ hooks ----------------------------------------------------------------------------------

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # Short, refreshed by the watch thread: a killed worker's job is noticed within a few beats.
        return int(self.heartbeat_s * 3 + 5)

    def execute_job(self, job: Job, queue: Queue) -> None:
        problem = _forbidden_reason(job)
        if problem is not None:
            self._reject(job, queue, problem)
            return
        if job.timeout is None:  # RQ's own default (180 s) is too short for long generations
            job.timeout = self.default_job_timeout
        execution = self.prepare_execution(job)
        with JobWatch(self, job, execution) as watch:
            self._watch = watch
            try:
                self.perform_job(job, queue, execution)
            finally:
                self._watch = None
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
            log.warning("second stop signal: cancelling job=%s", self._watch.job.id)
            self._force_stop = True
            return
        super().request_force_stop(signum, frame)

    # --- helpers -----------------------------------------------------------------------------------

    def _reject(self, job: Job, queue: Queue, reason: str) -> None:
        log.warning("rejected job=%s reason=%s", job.id, reason)
        job.retries_left = 0
        execution = self.prepare_execution(job)
        self.handle_job_failure(
            job, queue, exc_string=f"{ForbiddenJob.__name__}: {reason}", execution=execution
        )
        self.set_state("idle")

    def _end_stream_with_error(self, job: Job, exc_string: str) -> None:
        message = _last_line(exc_string) or "the job failed"
        try:
            StreamWriter(self.connection, job.id, self.stream_options).error_once(message)
        except Exception:  # the failure itself is recorded by RQ; a stream write must not hide it
            log.exception("could not write error event job=%s", job.id)


def _forbidden_reason(job: Job) -> str | None:
    """Why this job must not run here, or None. Checked before RQ imports anything by name."""
    try:
        func_name = job.func_name
    except Exception as e:
        return f"the payload is not JSON in RQ's JSON format ({type(e).__name__}: {e}); mlxq never unpickles"
    if func_name not in keys.JOB_FUNCS:
        allowed = ", ".join(sorted(keys.JOB_FUNCS))
        return f"function {func_name!r} is not an mlxq job; this worker runs only {allowed}"
    if len(job.args) != 1 or job.kwargs:
        return (
            f"{func_name} takes exactly one argument, the request object (got {len(job.args)} "
            f"positional and {len(job.kwargs)} keyword arguments)"
        )
    return None


def _last_line(exc_string: str) -> str:
    lines = [line for line in exc_string.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
