"""The RQ worker: one process, one loaded model, jobs run in-process.

Built on RQ's `SimpleWorker` (RQ's forking `Worker` would lose the model after every job) with what it
lacks for model jobs: a `JobWatch` thread that heartbeats while jobs run (so RQ never reaps a live job
as abandoned, and a killed worker's jobs are found within a few heartbeats) and polls cancel keys; an
allowlist of job functions checked before anything is imported by name; a failure hook that ends the
job's stream with an `error` event; and the dispatch of each job, by its function's name, to the
component that runs that kind (`GenerationJobs`, `ScoreJobs`: built by the service, each running its
jobs in batches and ending every job through RQ's own lifecycle, `rq_batches.py`). The worker is the
`JobHost` those components are handed. RQ's loop between jobs (state, heartbeat, suspension check,
maintenance) is `BetweenJobs` (`rq_loop.py`): RQ's writes there in fewer round trips, and a loop that
goes on while Redis restarts instead of quitting.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from time import monotonic
from typing import Any, Protocol

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job, JobStatus
from rq.job_lifecycle import call_exception_handlers
from rq.serializers import JSONSerializer
from rq.utils import now

from mlxq.jobs.errors import ForbiddenJob, InvalidRequest
from mlxq.jobs.transient import is_out_of_memory
from mlxq.worker.allowlist import forbidden_reason
from mlxq.worker.bounded_job import BoundedJob
from mlxq.worker.dead_letters import DeadLetters
from mlxq.worker.eviction_watch import EvictionWatch
from mlxq.worker.job_runs import Rider, Run
from mlxq.worker.job_watch import JobWatch
from mlxq.worker.maintenance import Maintenance
from mlxq.worker.rq_batches import RqBatches
from mlxq.worker.rq_loop import BetweenJobs, Stats
from mlxq.worker.stream_writer import REDIS_TRANSIENT, StreamOptions, StreamWriter, retrying

log = logging.getLogger(__name__)

_STUCK = "Job was stuck in intermediate queue."  # what RQ's IntermediateQueue.cleanup fails jobs with
_STATS_EVERY_S = 1.0  # how often a running generation batch republishes the worker's stats
_PUBSUB_STOP_S = 1.0  # the longest wait for the command channel's thread at exit (`unsubscribe`)
_FULL_WAIT_MAX_S = 5.0  # the longest pause between dequeues while Redis refuses them (full, read-only)
_NOT_THE_JOBS: tuple[type[Exception], ...] = (StopRequested, *REDIS_TRANSIENT)


class JobRunner(Protocol):
    """Runs one kind of job from the one RQ handed over (claiming more of its kind as it sees fit)."""

    def run(self, first: Job, queue: Queue) -> None: ...


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
        max_job_timeout: int = -1,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("log_job_description", False)  # descriptions hold prompts: keep them out of logs
        kwargs.setdefault("job_class", BoundedJob)  # payload sizes checked before RQ inflates them
        super().__init__(queues, connection=connection, serializer=JSONSerializer, **kwargs)
        self.stream_options = stream_options
        self.heartbeat_s = heartbeat_s
        self.cancel_poll_s = cancel_poll_s
        self.default_job_timeout = default_job_timeout
        self.batches = RqBatches(self, stream_options, default_job_timeout, max_job_timeout)
        self.runners: dict[str, JobRunner] = {}  # job function name -> its component (set by the service)
        self.stats: Stats | None = None
        self.active_sequences = 0
        self._stats_at = 0.0  # when a running batch last republished the stats
        self._watcher: JobWatch | None = None  # the worker's watch thread, from its first batch on
        self._watch: JobWatch | None = None  # the same, while a batch runs
        self._force_stop = False
        self.between_jobs = BetweenJobs(self)
        self.dead_letters = DeadLetters(connection, stream_options)
        # A maintainer's lease lasts as long as a job's heartbeat: a dead one is noticed as soon.
        self.maintenance = Maintenance(
            self, self.batches, self.dead_letters, stream_options, self.get_heartbeat_ttl(None)
        )
        self.full = stream_options.full  # Redis refusing writes for memory (shared with every writer)
        self.evictions = EvictionWatch(connection)
        self.fatal_error: BaseException | None = None  # what made RQ's loop quit, if anything did

    # --- the JobHost its components are handed (see `job_host.py`) -------------------------------------

    def start(self, jobs: list[Job], queue: Queue, riders: Sequence[Rider] = ()) -> list[Run]:
        """Fail the taken jobs this worker must not run (`forbidden_reason`: claims already leave such
        jobs queued, this is the same check a dequeued job gets), drop those of another queue, start the
        others together (the `riders`' commands for them in the same round trip)."""
        allowed: list[Job] = []
        seen: set[str] = set()
        for job in jobs:
            if job.origin != queue.name:
                self.dead_letters.misplaced(job.id, queue, job.origin)
                continue
            if self._taken_again(job, queue, twice=job.id in seen):
                continue
            seen.add(job.id)
            problem = forbidden_reason(job)
            if problem is None:
                allowed.append(job)
            else:
                self._reject(job, queue, problem)
        return self.batches.start(allowed, queue, riders)

    @contextmanager
    def watching(self, runs: list[Run]) -> Iterator[JobWatch]:
        """Heartbeats and cancel polling for `runs` (and those added later) while the block runs, by
        the worker's one `JobWatch` (its thread started with the first batch, stopped with the worker
        at `teardown`): a thread started and joined for every batch cost a lone job the wait for it
        to be scheduled before its first forward, and again at its end."""
        if self._watcher is None:
            self._watcher = JobWatch(self, [], self.heartbeat_s, self.cancel_poll_s).start()
        watch = self._watcher
        watch.add(runs)
        self._watch = watch
        try:
            yield watch
        finally:
            self._watch = None
            watch.clear()

    def teardown(self) -> None:
        """RQ's end of the worker (its death registered, its command channel closed), and the watch
        thread stopped."""
        try:
            super().teardown()  # type: ignore[no-untyped-call]  # RQ leaves it unannotated
        finally:
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher.stop()

    def is_cancelled(self, job_id: str) -> bool:
        """True once the job's cancel key was seen, or a second SIGTERM/SIGINT arrived."""
        watch = self._watch
        return self._force_stop or (watch is not None and job_id in watch.cancelled)

    def stopping(self) -> bool:
        return bool(self._stop_requested or self._force_stop)

    def stopping_now(self) -> bool:
        return self._force_stop

    def housekeeping(self) -> None:
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()

    def progress(self, active_sequences: int) -> None:
        self.active_sequences = active_sequences
        if self.stats is not None and monotonic() - self._stats_at >= _STATS_EVERY_S:
            self._stats_at = monotonic()
            self.stats.publish()

    # --- RQ hooks ----------------------------------------------------------------------------------

    # RQ's loop between jobs: which of its writes go, and when, is `BetweenJobs`'s (`rq_loop.py`).

    def set_state(self, state: str, pipeline: Any = None) -> None:
        self.between_jobs.set_state(super().set_state, state, pipeline)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        self.between_jobs.heartbeat(super().heartbeat, timeout, pipeline)

    def check_for_suspension(self, burst: bool) -> None:
        self.between_jobs.check_for_suspension(super().check_for_suspension, burst)

    def reorder_queues(self, reference_queue: Queue) -> None:
        super().reorder_queues(reference_queue)
        self.between_jobs.took_job()

    def run_maintenance_tasks(self) -> None:
        self.between_jobs.step(super().run_maintenance_tasks)
        self.evictions.check()

    # RQ's other hooks, with what mlxq adds to each.

    def register_birth(self) -> None:
        """RQ's registration of the worker, under the write policy (`retrying`): a full Redis (OOM
        replies) is waited out, so a worker started while Redis is full starts once memory frees
        rather than exiting; then the memory policy is read and an evicting one warned of."""
        retrying(self.stream_options)(super().register_birth)
        self.evictions.check(force=True)

    def unsubscribe(self) -> None:
        """RQ's end of the worker's command channel (the pubsub that carries `send_stop_job_command`
        and friends), with the wait for its thread bounded.

        RQ unsubscribes and then stops the listening thread. redis-py 8.2's `stop()` joins that thread
        with no limit, and a thread that has already seen the unsubscribe waits for a new subscription
        for RQ's `sleep_time` (60 s): a worker that was done held its exit for a minute. The thread is a
        daemon reading nothing of ours once unsubscribed, so it is given a second, like RQ's own join.
        """
        thread = self.pubsub_thread
        if thread is None:
            return
        log.info("unsubscribing from channel %s", self.pubsub_channel_name)
        self.pubsub.unsubscribe()
        try:
            thread.stop(timeout=_PUBSUB_STOP_S)
        except TypeError:  # redis-py before 8.2: stop() only clears the flag, it does not wait
            thread.stop()
        thread.join(timeout=_PUBSUB_STOP_S)
        self.pubsub.close()

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        """RQ's dequeue, where a job RQ cannot read (a malformed field, a key of another type) is put
        aside with the reason (`DeadLetters`) and the dequeue goes on, instead of ending the worker. A
        job found in a queue that is not its origin (its id pushed there by someone allowed to push only
        there, `producer/tenant.py`) is dropped from that queue, never run from it, and recorded. A
        dequeue Redis refuses (full: an OOM reply; a demoted primary: READONLY) is tried again, backed
        off, until it goes through or the worker is asked to stop; RQ's dequeue waits out a Redis that
        is away itself."""
        pause = 0.1
        while True:
            try:
                taken = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
                self.full.accepted()
                if taken is not None and taken[0].origin != taken[1].name:
                    self.dead_letters.misplaced(taken[0].id, taken[1], taken[0].origin)
                    continue
                return taken
            except (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError) as e:
                if is_out_of_memory(e):
                    self.full.refused(e, "dequeue")
                else:  # new connections may reach the new primary (behind a proxy); Sentinel does it itself
                    log.warning("redis is read-only (a failover?); dequeue tried again error=%s", e)
                    self.connection.connection_pool.disconnect()
                if self._stop_requested:
                    return None
                time.sleep(pause)
                pause = min(pause * 2, _FULL_WAIT_MAX_S)
            except _NOT_THE_JOBS:  # a stop signal while idle, Redis away: RQ's loop handles these
                raise
            except Exception as e:
                job_id, queue = getattr(e, "job_id", None), getattr(e, "queue", None)
                if job_id is None or not isinstance(queue, Queue):
                    self.fatal_error = e
                    raise
                self.dead_letters.put_aside(job_id, queue, e)

    def clean_registries(self) -> None:
        """RQ's registry maintenance, queue by queue, under a lease that dies with this process
        (`Maintenance`: RQ's own lock would outlive a worker killed inside it by 15 minutes)."""
        self.maintenance.run(self.queues, self._exc_handlers)
        self.last_cleaned_at = now()  # type: ignore[assignment]  # RQ declares it None only

    @property
    def dequeue_timeout(self) -> int:
        """How long an idle worker blocks on the queues: RQ's (`worker_ttl - 15`), but never past the
        maintenance interval, so that an idle worker still runs maintenance on time."""
        return max(1, min(self.worker_ttl - 15, int(self.maintenance_interval)))

    def get_heartbeat_ttl(self, job: Job | None, working_time: float = 0.0) -> int:
        # Short, refreshed by the watch thread: a killed worker's job is noticed within a few beats.
        return int(self.heartbeat_s * 3 + 5)

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Hand the job RQ dequeued to the component that runs its kind (it may claim more queued jobs
        to run beside it); a job this worker must not run is failed with the reason."""
        if self._taken_again(job, queue):
            self.between_jobs.idle()
            return
        problem = forbidden_reason(job)
        runner = self.runners.get(job.func_name or "") if problem is None else None
        if problem is None and runner is None:
            problem = f"this worker runs no {job.func_name} jobs"
        try:
            if runner is None:
                self._reject(job, queue, problem or "")
            else:
                runner.run(job, queue)
        except StopRequested:
            raise
        except Exception as e:  # RQ's loop quits on it: the process must say it failed
            self.fatal_error = e
            raise
        self.between_jobs.idle()

    def handle_job_failure(
        self,
        job: Job,
        queue: Queue,
        started_job_registry: Any = None,
        exc_string: str = "",
        execution: Any = None,
    ) -> None:
        if exc_string == _STUCK and execution is None:
            if job.origin != queue.name:
                return  # another queue's job, its id pushed onto this one: its record is not ours to end
            status = job.get_status(refresh=False)
            if status == JobStatus.QUEUED:
                self._requeue_stuck(job, queue)
                return
            if status in (JobStatus.FAILED, JobStatus.FINISHED, JobStatus.CANCELED, JobStatus.STOPPED):
                return  # it ended already (a rejected job, say): its record stands; RQ drops the id

        will_retry = job.should_retry and self._stopped_job_id != job.id
        if not will_retry:
            self._end_stream_with_error(job, exc_string)
        super().handle_job_failure(
            job, queue, started_job_registry=started_job_registry, exc_string=exc_string, execution=execution
        )

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        """RQ's report of a failed job, but a job's expected failure (a request the worker refuses: too
        long, invalid, not an mlxq job) is one warning line, not an ERROR with a traceback; RQ's
        exception handlers run either way."""
        error = exc_info[1] if len(exc_info) > 1 else None
        if not isinstance(error, InvalidRequest | ForbiddenJob):
            super().handle_exception(job, *exc_info)
            return
        name = type(error).__name__
        log.warning("job failed job=%s queue=%s error=%s: %s", job.id, job.origin, name, error)
        call_exception_handlers(self._exc_handlers, job, *exc_info)

    def _taken_again(self, job: Job, queue: Queue, twice: bool = False) -> bool:
        """Whether a job just taken from the queue has started or ended already (any RQ status but
        `queued` or `created`), or was taken `twice` in one claim: its id was in the queue a second
        time, as when a Sentinel failover leaves the new primary with a queue from before a take while
        the job's start was written again there. It is not run twice: (one copy of) its id leaves the
        intermediate list the take put it on, its records stay."""
        status = job.get_status(refresh=False)
        # never started: queued, or no status (RQ reads a missing or empty one as created)
        if not twice and (status is None or status in (JobStatus.QUEUED, JobStatus.CREATED)):
            return False
        retrying(self.stream_options)(self.connection.lrem, queue.intermediate_queue_key, 1, job.id)
        state = "in the same take" if twice else f"while {status.value if status else 'unknown'}"
        log.warning("job taken again %s, not run twice job=%s queue=%s", state, job.id, queue.name)
        return True

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

    def handle_warm_shutdown_request(self) -> None:
        """RQ's log line of a warm stop, written from the signal handler: where the signal landed in
        the middle of another write to stderr, logging's write re-enters the stream and raises
        (RuntimeError, also from its own error report), which would unwind RQ's handler before it
        records the stop, and the worker would go on as if never asked. The line is lost instead."""
        with contextlib.suppress(RuntimeError):
            super().handle_warm_shutdown_request()  # type: ignore[no-untyped-call]  # RQ leaves it unannotated

    def request_force_stop(self, signum: int, frame: Any) -> None:
        """Second SIGTERM/SIGINT: cancel the running job cleanly (it ends `cancelled`), then exit."""
        if self._watch is not None and not self._force_stop:
            self._force_stop = True  # before the log line: a write re-entering stderr must not lose it
            with contextlib.suppress(RuntimeError):
                log.warning("second stop signal: cancelling jobs=%s", ",".join(self._watch.job_ids()))
            return
        super().request_force_stop(signum, frame)

    # --- jobs that never run ----------------------------------------------------------------------

    def _reject(self, job: Job, queue: Queue, reason: str) -> None:
        log.warning("rejected job=%s reason=%s", job.id, reason)
        job.retries_left = 0
        execution = self.prepare_execution(job)
        # Off the intermediate list, where RQ's maintenance would later fail it again as "stuck".
        self.connection.lrem(queue.intermediate_queue_key, 1, job.id)
        self.handle_job_failure(
            job, queue, exc_string=f"{ForbiddenJob.__name__}: {reason}", execution=execution
        )

    def _end_stream_with_error(self, job: Job, exc_string: str) -> None:
        message = _last_line(exc_string) or "the job failed"
        try:
            StreamWriter(self.connection, job.id, self.stream_options).error_once(message)
        except Exception:  # the failure itself is recorded by RQ; a stream write must not hide it
            log.exception("could not write error event job=%s", job.id)


def _last_line(exc_string: str) -> str:
    lines = [line for line in exc_string.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
