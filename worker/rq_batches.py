"""RQ's job lifecycle for jobs an mlxq worker runs together: the one module that reproduces RQ.

RQ (3.x) starts and ends one job at a time, several round trips each. A worker that runs 64 jobs in one
batch does the same bookkeeping for all of them in one transaction. What is copied, and from where:

- `start`: what `Worker.prepare_execution` (an `Execution` record in the started registry, the worker's
  heartbeat) and `Worker.prepare_job_execution(remove_from_intermediate_queue=True)` (the job's
  heartbeat, status `started` and worker name, its hash persisted, the id off the queue's intermediate
  list, the worker busy) write, for every job in one MULTI/EXEC, without RQ's repeated writes: the
  job's heartbeat goes in the HSET that starts it, the worker's index of executions gets one SADD and
  one EXPIRE for the batch;
- `succeed_many`: what `Worker._finalize_success` and `Worker.handle_job_success` write for a job
  without dependents or repeats (result, status `finished`, registries, TTLs, execution record, the
  worker's counters), for every job in one MULTI/EXEC, with the dependents sets WATCHed as RQ does;
  one HSET a job where RQ sends three, and no EXPIRE of a dependents or dependencies set that does not
  exist.
  A job with repeats left, and every job when that transaction fails for good, ends through RQ itself;
- `cancel_running`: what RQ's `Job.cancel` writes (status `canceled`, the canceled registry) for a job
  its producer cancelled while it ran, with the worker's end of the execution (`cleanup_execution`).
  RQ's cancel is made for waiting jobs; a running mlxq job stops at its next step and writes its
  partial result (finish reason `cancelled`) first, then ends here, so RQ, `mlxq status` and
  rq-dashboard count it as canceled, not finished. `succeed`, `succeed_many` and `end_abandoned` send
  such a job here;
- `end_abandoned`: what `Worker._finalize_success` writes, through RQ's own `handle_job_success`, for a
  job whose worker died after writing its result and `done` but before RQ's end of it (found by
  another worker's maintenance, `maintenance.py`): RQ would fail it as abandoned, or run it again.

Single jobs end through RQ's own methods (`succeed`, `fail`). Every step retries while Redis restarts
(`retrying`): an error escaping `execute_job` would make RQ's loop stop the whole worker. The private RQ
names this needs (`_finalize_success`, `_finalize_failure`, `Job._handle_success`, `Job._result`,
`Job._status`) are used here and nowhere else; `tests/service/test_rq_batches.py` holds the results
against RQ's own version of each step.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import uuid4

import redis
from rq import Queue, SimpleWorker
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.rate_limit import release_slot
from rq.registry import CanceledJobRegistry
from rq.results import Result
from rq.utils import now, utcformat
from rq.worker import WorkerStatus

from mlxq.worker.stream_writer import StreamOptions, retrying

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """A started job: the job, the queue it came from, and RQ's record of this execution."""

    job: Job
    queue: Queue
    execution: Execution


Ended = tuple[Run, Any]  # a run that returned, with its return value


def was_cancelled(value: Any) -> bool:
    """Whether a job's return value is a generation its producer cancelled while it ran (the wire's
    `finish_reason`)."""
    return isinstance(value, dict) and value.get("finish_reason") == "cancelled"


class RqBatches:
    """Starts and ends jobs through RQ on behalf of `worker`, many at a time where RQ does one."""

    def __init__(
        self,
        worker: SimpleWorker,
        options: StreamOptions,
        default_job_timeout: int,
        max_job_timeout: int = -1,
    ) -> None:
        self.worker = worker
        self.options = options
        self.default_job_timeout = default_job_timeout
        self.max_job_timeout = max_job_timeout  # -1: a job may ask for any timeout, none included

    def start(self, jobs: list[Job], queue: Queue) -> list[Run]:
        """Start jobs that are in RQ's intermediate list (dequeued or claimed), all in one transaction."""
        if not jobs:
            return []
        w = self.worker
        intermediate = {  # each origin's intermediate list: one Queue made per origin, not per job
            origin: Queue(origin, connection=w.connection).intermediate_queue_key
            for origin in {job.origin for job in jobs}
        }

        def start() -> list[Execution]:
            executions = []
            worker_ttl = 0
            with w.connection.pipeline() as pipe:
                for job in jobs:
                    job.timeout = self.timeout_of(job)
                    ttl = w.get_heartbeat_ttl(job)
                    executions.append(_create_execution(job, ttl, w.name, pipe))
                    worker_ttl = max(worker_ttl, ttl)
                    job.prepare_for_execution(w.name, pipeline=pipe)  # `last_heartbeat` too: RQ's `heartbeat`
                    pipe.persist(job.key)
                    pipe.lrem(intermediate[job.origin], 1, job.id)
                # The worker's index of its executions: one SADD and one EXPIRE for the batch where
                # RQ's `Execution.create` sends both per job (the longest TTL: RQ's last one may be shorter).
                pipe.sadd(executions[0].worker_executions_key, *(e.composite_key for e in executions))
                pipe.expire(executions[0].worker_executions_key, worker_ttl + 60)
                w.set_state(WorkerStatus.BUSY, pipeline=pipe)
                w.heartbeat(w.get_heartbeat_ttl(jobs[0]), pipeline=pipe)
                pipe.execute()
            return executions

        executions = retrying(self.options)(start)
        runs = []
        for job, execution in zip(jobs, executions, strict=True):
            w.executions[execution.id] = execution
            job.started_at = now()
            runs.append(Run(job, queue, execution))
        return runs

    def timeout_of(self, job: Job) -> int:
        """The job's timeout as this worker runs it: the worker's default where the job has none (RQ's
        own, 180 s, is too short for long generations), never above the worker's maximum (a producer
        cannot lift the limit for its own job with a long one, or with -1 for none)."""
        timeout = self.default_job_timeout if job.timeout is None else int(job.timeout)
        if self.max_job_timeout > 0 and (timeout < 0 or timeout > self.max_job_timeout):
            return self.max_job_timeout
        return timeout

    def start_one(self, job: Job, queue: Queue) -> Run:
        """Start one job outside a batch (one that is failed before it runs): RQ's `prepare_execution`."""
        return Run(job, queue, self.worker.prepare_execution(job))

    def succeed(self, run: Run, value: Any) -> None:
        """RQ's end of one successful job (`_finalize_success`), retried while Redis restarts; a job
        cancelled while it ran ends `canceled` (`cancel_running`)."""
        if was_cancelled(value):
            self.cancel_running(run)
            return
        retrying(self.options)(self.worker._finalize_success, run.job, run.queue, run.execution, value)

    def cancel_running(self, run: Run) -> None:
        """End a job its producer cancelled while it ran as RQ's `Job.cancel` ends a waiting one (status
        `canceled`, the queue's canceled registry), with the end of its execution (`cleanup_execution`:
        off the started registry, the execution record gone), in one MULTI. Its partial result stays in
        mlxq's result key; RQ keeps no result for a canceled job."""
        job, execution = run.job, run.execution

        def write() -> None:
            at = now()
            with self.worker.connection.pipeline() as pipe:
                job.ended_at = at
                job.set_status(JobStatus.CANCELED, pipeline=pipe)
                pipe.hset(job.key, "ended_at", utcformat(at))
                self.worker.cleanup_execution(job, pipeline=pipe, execution=execution)
                registry = CanceledJobRegistry(
                    job.origin, self.worker.connection, job_class=type(job), serializer=job.serializer
                )
                registry.add(job, pipeline=pipe)
                pipe.execute()

        retrying(self.options)(write)
        release_slot(job)  # as RQ frees a rate limit's slot when a job ends
        self.worker.log.info("Worker %s: %s: Job canceled (%s)", self.worker.name, job.origin, job.id)

    def end_abandoned(self, job: Job, queue: Queue, execution: Execution, value: Any) -> None:
        """End `finished`, with `value` as its result, a `started` job whose worker died after writing its
        result: RQ's `_finalize_success` without the callbacks (the allowlist refuses jobs that name one),
        by RQ's `handle_job_success` (registries, dependents, repeats, the dead execution's record). The
        job counts among this worker's successful jobs, as RQ counts a job where it ends. A job that was
        cancelled while it ran ends `canceled` (`cancel_running`)."""
        if was_cancelled(value):
            self.cancel_running(Run(job, queue, execution))
            return
        at = now()
        job.ended_at = at
        job.started_at = job.started_at or at
        job._result = value
        job._status = JobStatus.FINISHED
        retrying(self.options)(
            self.worker.handle_job_success,
            job=job,
            queue=queue,
            started_job_registry=queue.started_job_registry,
            execution=execution,
        )
        job.send_webhooks(JobStatus.FINISHED)

    def fail(self, run: Run, exc_info: Any) -> None:
        """RQ's end of one failed job (`_finalize_failure`: retries, failed registry, the failure hook)."""
        retrying(self.options)(self.worker._finalize_failure, run.job, run.queue, run.execution, exc_info)

    def fail_with(self, run: Run, error: BaseException) -> None:
        self.fail(run, (type(error), error, error.__traceback__))

    def succeed_many(self, ended: list[Ended]) -> None:
        """End many successful jobs: those without repeats in one transaction (`_end_together`), the
        others (and all of them if that transaction fails for good) one by one through RQ; a job whose
        end fails is failed with the reason. Jobs cancelled while they ran end `canceled`."""
        for run, _ in (item for item in ended if was_cancelled(item[1])):
            self.cancel_running(run)
        ended = [item for item in ended if not was_cancelled(item[1])]
        alone = [item for item in ended if item[0].job.repeats_left]
        together = [item for item in ended if not item[0].job.repeats_left]
        if together:
            try:
                done = retrying(self.options)(self._end_together, together)
            except Exception:
                log.exception("could not end jobs together; ending them one by one jobs=%d", len(together))
                done = [False] * len(together)
            for (run, _), ok in zip(together, done, strict=True):
                if ok:  # after the commit, as RQ does: a rate limit's slot, webhooks
                    release_slot(run.job)
                    run.job.send_webhooks(JobStatus.FINISHED)
                    self.worker.log.info(
                        "Worker %s: %s: Job OK (%s)", self.worker.name, run.job.origin, run.job.id
                    )
            alone.extend(item for item, ok in zip(together, done, strict=True) if not ok)
        for run, value in alone:
            try:
                self.succeed(run, value)
            except Exception:
                self.fail(run, sys.exc_info())

    def _end_together(self, ended: list[Ended]) -> list[bool]:
        """End the jobs without dependents in one MULTI/EXEC, each as RQ's `handle_job_success` ends one;
        which ones it ended. The dependents sets are watched before they are read, so a dependent added
        before the commit makes it start over, as in RQ."""
        w = self.worker
        with w.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*(run.job.dependents_key for run, _ in ended))  # type: ignore[no-untyped-call]
                    with w.connection.pipeline(transaction=False) as reads:
                        for run, _ in ended:
                            reads.exists(run.job.dependents_key)
                        free = [not n for n in reads.execute()]
                    pipe.multi()
                    at = now()
                    working = 0.0
                    for (run, value), ok in zip(ended, free, strict=True):
                        if ok:
                            self._write_success(run, value, at, pipe)
                            working += (at - (run.job.started_at or at)).total_seconds()
                    if any(free):  # the worker's counters, as RQ adds them a job at a time
                        pipe.hincrby(w.key, "successful_job_count", sum(free))
                        pipe.hincrbyfloat(w.key, "total_working_time", working)
                    pipe.execute()
                    return free
                except redis.WatchError:
                    continue

    def _write_success(self, run: Run, value: Any, at: datetime, pipe: Any) -> None:
        """Queue on `pipe` what RQ's `_finalize_success` writes for a job with no dependents or repeats,
        but the worker's counters (`_end_together` adds them for all its jobs at once)."""
        job, execution = run.job, run.execution
        job.ended_at = at
        job.last_heartbeat = at  # RQ's `job.heartbeat(...)`, written with the rest of the hash below
        job._result = value
        job._status = JobStatus.FINISHED
        result_ttl = job.get_result_ttl(self.worker.default_result_ttl)
        if result_ttl != 0:  # RQ's `_handle_success`: its three HSETs (heartbeat, status, save) as one
            fields = job.to_dict(include_meta=False, include_result=False)
            pipe.hset(job.key, mapping={**fields, "status": JobStatus.FINISHED})
            Result.create(
                job,
                Result.Type.SUCCESSFUL,
                return_value=value,
                ttl=result_ttl,
                worker_name=self.worker.name,
                pipeline=pipe,
                execution_id=execution.id,
                execution_started_at=execution.created_at,
                execution_ended_at=at,
            )
            job.finished_job_registry.add(job, result_ttl, pipe)
        else:
            pipe.hset(job.key, "last_heartbeat", utcformat(at))
        if result_ttl is not None and result_ttl > 0:
            # RQ's `job.cleanup(ttl)`, but without EXPIRE of keys that do not exist (a no-op): the
            # dependents set (`_end_together` found it absent, under WATCH) and the dependencies set of
            # a job that depends on nothing.
            pipe.expire(job.key, result_ttl)
            if job._dependency_ids:
                pipe.expire(job.dependencies_key, result_ttl)
        else:
            job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        self.worker.cleanup_execution(job, pipeline=pipe, execution=execution)


def _create_execution(job: Job, ttl: int, worker_name: str, pipe: Any) -> Execution:
    """RQ's `Execution.create` but the worker's index of executions (`RqBatches.start` writes it once
    for the batch): the execution's hash, the job's registry of executions, the started registry."""
    execution = Execution(id=uuid4().hex, job_id=job.id, connection=job.connection, worker_name=worker_name)
    execution._job = job
    execution.save(ttl=ttl, pipeline=pipe)
    ExecutionRegistry(job_id=job.id, connection=pipe).add(execution=execution, ttl=ttl, pipeline=pipe)
    job.started_job_registry.add_execution(execution, pipeline=pipe, ttl=ttl, xx=False)
    return execution
