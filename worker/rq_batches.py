"""RQ's job lifecycle for jobs an mlxq worker runs together: the one module that reproduces it (the
job hash its end writes: `rq_job_hash.py`).

RQ (3.x) starts and ends one job at a time, several round trips each. A worker that runs 64 jobs in one
batch writes the same records for all of them with one script call (`rq_scripts.py`: the commands run
inside Redis, the worker sends one). What is copied, and from where:

- `start`: what `Worker.prepare_execution` (an `Execution` record in the started registry, the worker's
  heartbeat) and `Worker.prepare_job_execution(remove_from_intermediate_queue=True)` (the job's
  heartbeat, status `started` and worker name, its hash persisted, the id off the queue's intermediate
  list, the worker busy) write, for every job, without RQ's repeated writes: the job's heartbeat goes
  in the HSET that starts it, the worker's index of executions gets one SADD and one EXPIRE for the
  batch; the worker's state and heartbeat go through RQ's own methods in the same round trip, and so
  do the caller's own first commands for the jobs (`Rider`: a generation job's stream opening, its
  cancel key, the queue's head), which would otherwise each cost a round trip before its first token;
- `succeed_many`: what `Worker._finalize_success` and `Worker.handle_job_success` write for a job
  without dependents, dependencies or repeats and with a result kept for a while (result, status
  `finished`, registries, TTLs, execution record, the worker's counters), for every job: one HSET a
  job where RQ sends three, of the fields whose stored value changes where RQ rewrites them all
  (`rq_job_hash.changed_fields`), no EXPIRE of a dependents or dependencies set that does not exist;
  RQ's `Job OK` log line is one line a queue naming every job. The script checks each dependents set
  as it ends the job (RQ WATCHes them): nothing runs between the check and the writes, so a job that
  has a dependent is never ended there. It, a job with repeats left or another TTL, and every job when
  the call fails for good, ends through RQ itself;
- `cancel_running`: what RQ's `Job.cancel` writes (status `canceled`, the canceled registry) for a job
  its producer cancelled while it ran, with the worker's end of the execution (`cleanup_execution`).
  RQ's cancel is made for waiting jobs; a running mlxq job stops at its next step and writes its
  partial result (finish reason `cancelled`) first, then ends here, so RQ, `mlxq status` and
  rq-dashboard count it as canceled, not finished. `succeed`, `succeed_many` and `end_abandoned` send
  such a job here;
- `requeue`: what RQ's `BaseRegistry.requeue` writes for a job it puts back (the execution ended as
  `cleanup_execution` ends one, status `queued`, the id pushed at the front of its queue) for jobs a
  worker started but never ran (a batch taken ahead when a cold stop came), without RQ's `save` of the
  whole job, which would write the timeout this worker gave it into the job;
- `end_abandoned`: what `Worker._finalize_success` writes, through RQ's own `handle_job_success`, for a
  job whose worker died after writing its result and `done` but before RQ's end of it (found by
  another worker's maintenance, `maintenance.py`): RQ would fail it as abandoned, or run it again.

Single jobs end through RQ's own methods (`succeed`, `fail`). Every step retries while Redis restarts
(`retrying`): an error escaping `execute_job` would make RQ's loop stop the whole worker. The private RQ
names this needs (`_finalize_success`, `_finalize_failure`, `Job._handle_success`, `Job._result`,
`Job._status`, and the job's own fields in `rq_job_hash.py`) are used in these two modules and nowhere
else; `tests/service/test_rq_batches.py` holds the results against RQ's own version of each step.
"""

from __future__ import annotations

import logging
import sys
from base64 import b64encode
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any
from uuid import uuid4

from rq import Queue, SimpleWorker
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.rate_limit import release_slot
from rq.registry import CanceledJobRegistry
from rq.results import Result
from rq.utils import current_timestamp, now, utcformat
from rq.worker import WorkerStatus

from mlxq.worker import rq_scripts
from mlxq.worker.bounded_job import BoundedJob
from mlxq.worker.job_runs import Ended, Rider, Run
from mlxq.worker.rq_job_hash import changed_fields, field_name
from mlxq.worker.server_script import packed, wire
from mlxq.worker.stream_writer import StreamOptions, retrying

log = logging.getLogger(__name__)


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
        rq_scripts.load(worker.connection)

    def start(self, jobs: list[Job], queue: Queue, riders: Sequence[Rider] = ()) -> list[Run]:
        """Start jobs that are in RQ's intermediate list (dequeued or claimed): their records written by
        one script call (`rq_scripts.START`) a queue, the worker's state and heartbeat beside it, and
        the `riders`' commands after them, in one round trip."""
        if not jobs:
            return []
        w = self.worker
        at = now()
        runs = []
        groups: dict[tuple[str, int], list[tuple[Job, Execution]]] = {}
        for job in jobs:
            job.timeout = self.timeout_of(job)
            execution = Execution(id=uuid4().hex, job_id=job.id, connection=w.connection, worker_name=w.name)
            execution.created_at = execution.last_heartbeat = at
            execution._job = job
            groups.setdefault((job.origin, w.get_heartbeat_ttl(job)), []).append((job, execution))
            runs.append(Run(job, queue, execution))
        calls = [self._start_call(origin, ttl, group, at) for (origin, ttl), group in groups.items()]

        def start() -> list[tuple[Rider, list[Any]]]:
            with w.connection.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    rq_scripts.START.queue(pipe, keys, args)
                w.set_state(WorkerStatus.BUSY, pipeline=pipe)
                w.heartbeat(w.get_heartbeat_ttl(jobs[0]), pipeline=pipe)
                spans = []
                for rider in riders:
                    at = len(pipe)
                    rider.queue(pipe, runs)
                    spans.append((rider, at, len(pipe)))
                own = spans[0][1] if spans else len(pipe)
                replies = pipe.execute(raise_on_error=False)
            for reply in replies[:own]:  # the start's own: its errors are raised as `execute` raises them
                if isinstance(reply, Exception):
                    raise reply
            return [(rider, replies[a:b]) for rider, a, b in spans]

        for rider, replies in retrying(self.options)(rq_scripts.START.run, w.connection, start):
            rider.replied(replies)
        stamp = utcformat(at).encode()
        started = {
            b"last_heartbeat": stamp,
            b"started_at": stamp,
            b"worker_name": w.name.encode(),
            b"status": b"started",
        }
        for run in runs:  # what RQ's `prepare_for_execution` sets on the job, as the script wrote it
            job = run.job
            job.worker_name, job.last_heartbeat, job.started_at = w.name, at, at
            job._status = JobStatus.STARTED
            if isinstance(job, BoundedJob) and job.stored_fields is not None:
                job.stored_fields.update(started)
            w.executions[run.execution.id] = run.execution
        return runs

    def _start_call(
        self, origin: str, ttl: int, group: list[tuple[Job, Execution]], at: datetime
    ) -> tuple[list[str], list[Any]]:
        """The start script's keys and arguments for jobs of one queue and heartbeat TTL: what RQ's
        `Execution.create` (its hash and TTL, the job's executions and their TTL, the started
        registry, the worker's index of executions once for them all) and `prepare_for_execution`
        (the job's heartbeat, status, start and worker; PERSIST; off the intermediate list) write."""
        w = self.worker
        q = Queue(origin, connection=w.connection)
        stamp = current_timestamp()
        wip: int | str = ttl if ttl < 0 else stamp + ttl  # RQ's `add_execution`
        keys = [q.started_job_registry.key, q.intermediate_queue_key, group[0][1].worker_executions_key]
        args: list[Any] = [w.name, at.timestamp(), utcformat(at), ttl, stamp + ttl + 60, ttl + 60]
        args += ["+inf" if wip == -1 else wip, ttl + 60]
        for job, execution in group:
            keys += [job.key, execution.key, ExecutionRegistry.key_template.format(job.id)]
            args += [job.id, execution.id]
        return keys, args

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

    def requeue(self, runs: list[Run]) -> None:
        """Put started jobs that never ran back at the head of their queues, in order and untouched: no
        attempt counted, no retry spent, no stream event, the job hash as its producer left it (the
        fields the start wrote go, its status is `queued` again); their executions end as RQ's
        `cleanup_execution` ends one. What `BaseRegistry.requeue` does for a job it is handed, in one
        MULTI for them all; a rate-limited job keeps its slot (a job in the queue holds one, and it
        goes straight back there)."""
        if not runs:
            return
        w = self.worker

        def write() -> None:
            with w.connection.pipeline() as pipe:
                for run in reversed(runs):  # each pushed at the front: the first ends up first
                    job = run.job
                    w.cleanup_execution(job, pipeline=pipe, execution=run.execution)
                    pipe.hdel(job.key, *_STARTED_FIELDS)
                    job.set_status(JobStatus.QUEUED, pipeline=pipe)
                    if job.ttl is not None and job.ttl > 0:  # the start's PERSIST undone (RQ's `cleanup`)
                        pipe.expire(job.key, job.ttl)
                    queue = Queue(job.origin, connection=w.connection)
                    queue.push_job_id(job.id, pipeline=pipe, at_front=True)
                pipe.execute()

        retrying(self.options)(write)
        for run in runs:
            job = run.job
            job.started_at = job.last_heartbeat = None
            job.worker_name = None
            if isinstance(job, BoundedJob) and job.stored_fields is not None:
                for name in _STARTED_FIELDS:
                    job.stored_fields.pop(name.encode(), None)
                job.stored_fields[b"status"] = b"queued"
        log.warning("requeued jobs started but never run jobs=%d first=%s", len(runs), runs[0].job.id)

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
        """End many successful jobs: those RQ ends plainly (`_plain_end`) by one script call
        (`_end_together`), the others (and all of them if that call fails for good) one by one through
        RQ; a job whose end fails is failed with the reason. Jobs cancelled while they ran end
        `canceled`."""
        for run, _ in (item for item in ended if was_cancelled(item[1])):
            self.cancel_running(run)
        ended = [item for item in ended if not was_cancelled(item[1])]
        plain = [_plain_end(*item, self.worker.default_result_ttl) for item in ended]
        alone = [item for item, ok in zip(ended, plain, strict=True) if not ok]
        together = [item for item, ok in zip(ended, plain, strict=True) if ok]
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
            self._log_ok([run.job for (run, _), ok in zip(together, done, strict=True) if ok])
            alone.extend(item for item, ok in zip(together, done, strict=True) if not ok)
        for run, value in alone:
            try:
                self.succeed(run, value)
            except Exception:
                self.fail(run, sys.exc_info())

    def _log_ok(self, jobs: list[Job]) -> None:
        """RQ's `Job OK` line, one a queue for the jobs ended together, naming each (a line a job,
        through RQ's handler, costs the batch about as much as the job's end itself)."""
        by_origin: dict[str, list[str]] = {}
        for job in jobs:
            by_origin.setdefault(job.origin, []).append(job.id)
        for origin, ids in by_origin.items():
            self.worker.log.info(
                "Worker %s: %s: Jobs OK (%d): %s", self.worker.name, origin, len(ids), " ".join(ids)
            )

    def _end_together(self, ended: list[Ended]) -> list[bool]:
        """End jobs with no dependents, each as RQ's `handle_job_success` ends one, by one script call
        a queue (`rq_scripts.END`); which ones it ended. The script checks each job's dependents set
        and leaves a job that has one (its index comes back): a script runs alone, so no dependent can
        be added between that check and the writes, which RQ guards with WATCH."""
        w = self.worker
        at = now()
        by_origin: dict[str, list[int]] = {}
        for i, (run, _) in enumerate(ended):
            by_origin.setdefault(run.job.origin, []).append(i)
        calls = [
            (idx, self._end_call(origin, [ended[i] for i in idx], at)) for origin, idx in by_origin.items()
        ]

        def end() -> list[Any]:
            with w.connection.pipeline(transaction=False) as pipe:
                for _, (keys, args) in calls:
                    rq_scripts.END.queue(pipe, keys, args)
                return list(pipe.execute())

        replies = rq_scripts.END.run(w.connection, end)
        done = [True] * len(ended)
        for (idx, _), left in zip(calls, replies, strict=True):
            for k in left:
                done[idx[int(k)]] = False
        for (run, value), ok in zip(ended, done, strict=True):
            if ok:
                self._ended(run, value, at)
        return done

    def _end_call(self, origin: str, ended: list[Ended], at: datetime) -> tuple[list[str], list[Any]]:
        """The end script's keys and arguments for jobs of one queue: what RQ's `_handle_success` (the
        job hash, its result, the finished registry), `job.cleanup(ttl)` (the job's TTL) and
        `cleanup_execution` write, and the worker's counters once for them all."""
        w = self.worker
        q = Queue(origin, connection=w.connection)
        keys = [w.key, ended[0][0].execution.worker_executions_key, q.started_job_registry.key]
        keys.append(q.finished_job_registry.key)
        args: list[Any] = [w.name, at.timestamp(), current_timestamp()]
        date_text = lru_cache(maxsize=8)(utcformat)  # the batch's start and end, shared by its jobs
        for run, value in ended:
            job, execution = run.job, run.execution
            ttl = job.get_result_ttl(w.default_result_ttl)
            results = Result.get_key(job.id)  # type: ignore[no-untyped-call]
            keys += [job.key, job.dependents_key, results, execution.key]
            keys.append(ExecutionRegistry.key_template.format(job.id))
            serialized = (
                job.returned_text(value) if isinstance(job, BoundedJob) else job.serializer.dumps(value)
            )
            working = (at - (job.started_at or at)).total_seconds()
            values = [
                job.id.encode(),
                execution.id.encode(),
                wire(ttl),
                b64encode(serialized),
                wire(execution.created_at.timestamp()),
                wire(working),
            ]
            for name, field in changed_fields(job, at, date_text).items():
                values += [field_name(name), field if type(field) is bytes else wire(field)]
            args.append(packed(values))
        return keys, args

    def _ended(self, run: Run, value: Any, at: datetime) -> None:
        """The job and the worker in memory as RQ leaves them after its end of a job."""
        job = run.job
        job._result = value
        if isinstance(job, BoundedJob) and job.stored_fields is not None:
            stamp = utcformat(at).encode()
            job.stored_fields.update({b"status": b"finished", b"ended_at": stamp, b"last_heartbeat": stamp})
        self.worker.executions.pop(run.execution.id, None)


_STARTED_FIELDS = ("started_at", "last_heartbeat", "worker_name")  # what the start script adds to a job hash


def _plain_end(run: Run, value: Any, default_result_ttl: int) -> bool:
    """Whether RQ's end of this job is the one the end script writes: no repeats left (RQ queues the job
    again), a result kept for a while (RQ deletes the job at 0 and keeps it forever at -1), no
    dependencies (RQ sets their set's TTL too) and a return value (RQ's result then has none)."""
    job = run.job
    try:
        ttl = job.get_result_ttl(default_result_ttl)
    except Exception:  # RQ's own end meets the same error and fails the job with it
        return False
    if job.repeats_left or job._dependency_ids or value is None:
        return False
    return ttl is not None and ttl > 0
