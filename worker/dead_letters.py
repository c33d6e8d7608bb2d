"""Jobs that cannot be read, put aside so that they never stop a worker or RQ's maintenance.

RQ restores a job from its hash field by field and raises on the first it cannot parse (a `created_at`
in another date format, a `status` that is no status, a `timeout` that is no number, a key that is not a
hash at all); in RQ's loop that error ends the worker process, and the job's id is left in the queue's
intermediate list, where the next worker's maintenance meets it again. A producer in any language
writes these hashes, so one malformed field must fail only its own job.

`DeadLetters.put_aside` takes such a job off the intermediate list, records it in the queue's capped
dead-letter stream (`mlxq:dead:<queue>`: job id and the reason, naming the field), and ends the job's own
stream with an `error` event so that a waiting producer learns why; its hash is left as it was (nothing
is deleted). `reason` names the field (`bounded_job.field_problem`). `DeadLetters.misplaced` records a
job found in a queue that is not its own (its origin names another), touching nothing of the job.
"""

from __future__ import annotations

import logging

import redis
from rq import Queue

from mlxq.jobs import keys
from mlxq.worker.bounded_job import BoundedJob, UnreadableJob, field_problem
from mlxq.worker.stream_writer import REDIS_TRANSIENT, StreamOptions, StreamWriter, retrying

log = logging.getLogger(__name__)

DEAD_LETTERS_MAXLEN = 10_000  # entries kept per queue (approximately)


def reason(conn: redis.Redis, job_id: str, error: BaseException) -> str:
    """Why the job cannot be read: the key's type, or the first field RQ cannot parse (named)."""
    key = keys.rq_job_key(job_id)
    kind = conn.type(key)
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind != "hash":
        return f"{key} is a Redis {kind}, not a hash: not an RQ job"
    if isinstance(error, UnreadableJob):
        return f"{error} of {key}"
    fields: dict[bytes, bytes] = conn.hgetall(key)  # type: ignore[assignment]
    problem = field_problem(fields, BoundedJob.max_payload_bytes)
    if problem is not None:
        return f"{problem} of {key}"
    return f"{key} cannot be read by RQ ({type(error).__name__}: {error})"


class DeadLetters:
    """Puts unreadable jobs aside (see the module docstring); one instance per worker."""

    def __init__(self, conn: redis.Redis, options: StreamOptions) -> None:
        self.conn = conn
        self.options = options

    def put_aside(self, job_id: str, queue: Queue, error: BaseException) -> str:
        """Take the job off `queue`'s intermediate list into its dead-letter stream; end its stream with
        an `error` event. Returns the reason."""
        why = reason(self.conn, job_id, error)
        log.warning("unreadable job put aside job=%s queue=%s reason=%s", job_id, queue.name, why)
        self._record(job_id, queue, why)
        try:
            StreamWriter(self.conn, job_id, self.options).error_once(f"UnreadableJob: {why}")
        except Exception:  # the dead-letter entry is the record; the stream is a courtesy to readers
            log.exception("could not end the stream of an unreadable job job=%s", job_id)
        return why

    def misplaced(self, job_id: str, queue: Queue, origin: str) -> str:
        """Take a job found in `queue` whose hash names another queue as its origin off `queue`'s
        intermediate list, and record it in the dead-letter stream; never run it here, never touch its
        records: the job (maybe another tenant's, its id pushed onto this queue by a producer who may
        push only here) stays as its own queue has it. Returns the reason."""
        why = (
            f"job {job_id} was found in queue {queue.name!r} but belongs to queue {origin!r} (its origin): "
            "not run from here, its records left as they are"
        )
        log.warning("misplaced job dropped job=%s queue=%s origin=%s", job_id, queue.name, origin)
        self._record(job_id, queue, why)
        return why

    def _record(self, job_id: str, queue: Queue, why: str) -> None:
        """Off `queue`'s intermediate list, into its dead-letter stream, in one transaction."""

        def record() -> None:
            with self.conn.pipeline() as pipe:
                pipe.lrem(queue.intermediate_queue_key, 1, job_id)
                pipe.xadd(
                    keys.dead_letter_key(queue.name),
                    {"job_id": job_id, "reason": why},
                    maxlen=DEAD_LETTERS_MAXLEN,
                    approximate=True,
                )
                pipe.execute()

        retrying(self.options)(record)

    def sweep(self, queue: Queue) -> int:
        """Put aside every job in `queue`'s intermediate list that RQ cannot read (before RQ's own
        maintenance reads them); how many."""
        put = 0
        for raw in self.conn.lrange(queue.intermediate_queue_key, 0, -1):
            job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            try:
                queue.fetch_job(job_id)
            except REDIS_TRANSIENT:
                raise
            except Exception as e:
                self.put_aside(job_id, queue, e)
                put += 1
        return put
