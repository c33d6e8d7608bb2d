"""RQ's registry maintenance for a worker's queues, under a lease that dies with its holder.

RQ (`BaseWorker.clean_registries`) holds `rq:clean_registries:<queue>` for 899 s while it cleans a
queue and deletes it when done: a worker killed inside would stop every other worker from recovering
that queue's abandoned jobs for a quarter of an hour. Here the same key (mlxq workers and plain RQ
workers still exclude each other) is a `Lease`: set for `lease_s`, renewed by a thread every third of
it while the maintenance runs, deleted only by its holder. A killed holder's lease is gone `lease_s`
after its last renewal, so recovery waits on a dead maintainer no longer than on a dead job.

A queue's maintenance, under its lease:
1. jobs in its intermediate list that RQ cannot read are put aside (`DeadLetters.sweep`): RQ's
   cleanup below reads them all, and one it cannot read would stop it;
2. abandoned jobs whose result and `done` event were written (their worker died between that write and
   RQ's end of the job) are ended `finished` with that result (`RqBatches.end_abandoned`): the job is
   done, so RQ must neither fail it as abandoned nor run it again;
3. jobs taken but never started (their worker died between the take, a BLMOVE or a claim, and RQ's
   start) go back to the head of their queue once a pass has seen them there `STUCK_AFTER_S` ago
   (`requeue_stuck`); RQ's own rule waits a minute from its first sighting, a minute and more after
   the take, where the rest of a dead worker's jobs are recovered within a minute;
4. RQ's own cleanup: registries (the other abandoned `started` jobs are retried, their streams saying
   `restart` when they run again, or failed with `AbandonedJobError`, their streams ending with an
   `error` event as a failed job's do), dead workers, and the intermediate list (what is left there).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any
from uuid import uuid4

import redis
from rq import Queue, worker_registration
from rq.exceptions import AbandonedJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import clean_registries
from rq.utils import current_timestamp, parse_composite_key
from rq.worker import BaseWorker

from mlxq.jobs import keys
from mlxq.worker.dead_letters import DeadLetters
from mlxq.worker.rq_batches import RqBatches
from mlxq.worker.stream_writer import REDIS_TRANSIENT, StreamOptions, StreamWriter

log = logging.getLogger(__name__)

# Compare-and-renew and compare-and-delete of a lease, run by EVALSHA. MGET, not GET: the worker's Redis
# user may run MGET (`deploy/redis/users.acl`), and a script's commands are checked against that list.
_RENEW = """
if redis.call('mget', KEYS[1])[1] == ARGV[1] then return redis.call('expire', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('mget', KEYS[1])[1] == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_CLOCK_SLACK_MS = 1000
# A live worker starts what it takes within its write retries (seconds); a pass that finds a job still
# taken and not started this long after an earlier pass saw it so finds a dead worker's.
STUCK_AFTER_S = 30.0


class Lease:
    """A Redis key held by one process for `ttl_s` at a time, renewed by a thread while held.

    The key's value names the holder (`<holder>:<random>`), so only the holder renews or deletes it;
    a holder that dies (SIGKILL, a lost host) stops renewing and the key expires `ttl_s` later."""

    def __init__(self, conn: redis.Redis, key: str, ttl_s: int, holder: str) -> None:
        self.conn = conn
        self.key = key
        self.ttl_s = max(1, int(ttl_s))
        self.token = f"{holder}:{uuid4().hex}"
        self.lost = False  # a renewal found the key gone or taken: the lease lapsed while held
        self._renew = conn.register_script(_RENEW)
        self._release = conn.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        """Take the key if nobody holds it; while held, a thread renews it."""
        if not self.conn.set(self.key, self.token, nx=True, ex=self.ttl_s):
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_until_released, name="mlxq-lease", daemon=True)
        self._thread.start()
        return True

    def renew(self) -> bool:
        """Set the key's TTL back to `ttl_s` if this holder still has it."""
        return bool(self._renew(keys=[self.key], args=[self.token, self.ttl_s]))

    def release(self) -> None:
        """Stop renewing and delete the key if this holder still has it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)  # a renewal stuck on a hung Redis must not hold the worker
            self._thread = None
        self._release(keys=[self.key], args=[self.token])

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    self.lost = True
                    log.warning("lease lapsed while held key=%s", self.key)
                    return
            except REDIS_TRANSIENT as e:  # Redis restarting: the next tick tries again
                log.warning("could not renew lease key=%s error=%s", self.key, e)
            except Exception:  # a bug here must not end the renewals while the holder works
                log.exception("lease renewal failed key=%s", self.key)


class Maintenance:
    """Runs a worker's registry maintenance queue by queue (see the module docstring)."""

    def __init__(
        self,
        worker: BaseWorker,
        batches: RqBatches,
        dead_letters: DeadLetters,
        options: StreamOptions,
        lease_s: int,
    ) -> None:
        self.worker = worker
        self.conn: redis.Redis = worker.connection
        self.batches = batches
        self.dead_letters = dead_letters
        self.options = options
        self.lease_s = lease_s

    def run(self, queues: list[Queue], exc_handlers: list[Any]) -> None:
        """Clean every queue whose lease is free; a queue whose maintenance fails is logged and its lease
        given back, and the next one is cleaned. Redis errors that are worth another try propagate (the
        worker's loop skips this round and tries again)."""
        for queue in queues:
            lease = Lease(self.conn, queue.registry_cleaning_key, self.lease_s, self.worker.name)
            if not lease.acquire():
                continue
            try:
                self.clean(queue, exc_handlers)
            except REDIS_TRANSIENT:
                raise
            except Exception:
                log.exception("registry maintenance failed queue=%s", queue.name)
            finally:
                try:
                    lease.release()
                except REDIS_TRANSIENT as e:  # it expires on its own within `lease_s`
                    log.warning("could not release the maintenance lease queue=%s error=%s", queue.name, e)

    def clean(self, queue: Queue, exc_handlers: list[Any]) -> None:
        """One queue's maintenance, steps 1-3 of the module docstring (the caller holds its lease)."""
        self.dead_letters.sweep(queue)
        self.end_finished_abandoned(queue)
        left = self.requeue_stuck(queue)
        self.worker.log.info("Worker %s: cleaning registries for queue: %s", self.worker.name, queue.name)
        clean_registries(queue, [self._ending_streams_of_failed(), *exc_handlers])
        worker_registration.clean_worker_registry(queue)
        if left:  # RQ's cleanup reads the list again; an empty one has nothing for it
            queue.intermediate_queue.cleanup(self.worker, queue)

    def requeue_stuck(self, queue: Queue) -> list[str]:
        """Put back at the head of `queue` its jobs taken but never started that an earlier pass saw in
        the intermediate list `STUCK_AFTER_S` ago or more (RQ's first-seen mark; RQ's cleanup sets it
        for those seen the first time); the ids left in the list. Each goes in one MULTI: off the
        intermediate list, onto the queue, its mark gone. A job whose status is not `queued` stays for
        RQ's cleanup."""
        intermediate = queue.intermediate_queue
        taken = [_text(i) for i in self.conn.lrange(intermediate.key, 0, -1)]
        if not taken:
            return []
        started = queue.started_job_registry
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id in taken:
                pipe.get(intermediate.get_first_seen_key(job_id))
                pipe.hget(keys.rq_job_key(job_id), "status")
            replies = pipe.execute()
        requeued = []
        cutoff = time.time() - STUCK_AFTER_S
        for job_id, seen, status in zip(taken, replies[::2], replies[1::2], strict=True):
            if seen is None or float(seen) > cutoff or _text(status or b"") != JobStatus.QUEUED.value:
                continue
            if job_id not in started:
                requeued.append(job_id)
        for job_id in reversed(requeued):  # each to the head: the last first, so they keep their order
            with self.conn.pipeline() as pipe:
                pipe.lrem(intermediate.key, 1, job_id)
                queue.push_job_id(job_id, pipeline=pipe, at_front=True)
                pipe.delete(intermediate.get_first_seen_key(job_id))
                pipe.execute()
            log.warning("requeued a job taken but never started job=%s queue=%s", job_id, queue.name)
        return [job_id for job_id in taken if job_id not in requeued]

    def end_finished_abandoned(self, queue: Queue) -> int:
        """End `finished` the abandoned jobs of `queue` (their execution expired in RQ's started
        registry, RQ's status still `started`) whose result key exists and whose stream ends with `done`;
        how many. Their result is the result key's, as the worker would have stored it."""
        expired = [
            _text(entry)
            for entry in self.conn.zrangebyscore(queue.started_job_registry.key, 0, current_timestamp())
        ]
        if not expired:
            return 0
        ids = [parse_composite_key(entry) for entry in expired]
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.mget([keys.result_key(job_id) for job_id, _ in ids])
            for job_id, _ in ids:
                pipe.xrevrange(keys.stream_key(job_id), count=1)
            results, *lasts = pipe.execute()
        ended = 0
        for (job_id, execution_id), result, last in zip(ids, results, lasts, strict=True):
            if result is None or not last or _text(last[0][1].get(b"event", b"")) != "done":
                continue
            job = queue.fetch_job(job_id)
            if job is None or job.get_status(refresh=False) != JobStatus.STARTED:
                continue
            if not _written_by_this_run(job, _text(last[0][0])):
                continue
            try:
                execution = Execution.fetch(execution_id, job_id, self.conn)
            except ValueError:  # its record expired with its heartbeat: the id is all RQ needs
                execution = Execution(execution_id, job_id, self.conn)
            log.warning("abandoned job had finished: ended finished job=%s queue=%s", job_id, queue.name)
            self.batches.end_abandoned(job, queue, execution, json.loads(result))
            ended += 1
        return ended

    def _ending_streams_of_failed(self) -> Any:
        """An exception handler for RQ's cleanup, which calls it for each abandoned job just before it
        retries or fails it: a job it will fail (no retries left) gets its `error` event now. Before
        RQ's commit, not after: a maintainer killed in between leaves the job `started` and the next
        one fails it (`error_once` writes no second event), where one killed after the commit would
        leave a failed job whose stream never ends. RQ's status follows the event by a moment, as it
        follows `done`."""

        def end(job: Job, exc_type: Any, *exc: Any) -> bool:
            if exc_type is AbandonedJobError and not (job.retries_left and job.retries_left > 0):
                try:
                    StreamWriter(self.conn, job.id, self.options).error_once(
                        "AbandonedJobError: its worker stopped while running it (killed, or lost)"
                    )
                except Exception:  # RQ records the failure; the stream is a courtesy to its readers
                    log.exception("could not end the stream of an abandoned job job=%s", job.id)
            return True

        return end


def _written_by_this_run(job: Job, done_id: str) -> bool:
    """Whether the `done` entry (its id is `<ms>-<seq>`, the writer's clock) came after the job's
    current run started (RQ's `started_at`, the same worker's clock): not a `done` left by an earlier
    job under the same id. A second of slack for a clock that stepped back between the two."""
    if job.started_at is None:
        return True
    done_ms = int(done_id.split("-")[0])
    return done_ms >= job.started_at.timestamp() * 1000 - _CLOCK_SLACK_MS


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
