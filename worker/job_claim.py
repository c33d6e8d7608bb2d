"""Claiming more queued jobs for a batch, safely, beside RQ's own dequeue.

RQ hands a worker one job at a time. To batch, we look at the next ids waiting in a queue, let a
`pick` callback choose among the well-formed mlxq jobs there (score jobs up to a row budget, generation
jobs up to free batch slots), and move each chosen id from the queue to RQ's intermediate list in one
Lua call (exactly where RQ's own dequeue puts a job it pops). The hashes a look reads come back from
one script call too (`_READ`), not a pipeline of one command a job. A job another worker took meanwhile is
simply not there to move; a job we moved but never started (we were killed) is found by a worker's
maintenance and put back at the head of its queue (`Maintenance.requeue_stuck`).
So nothing is run twice and nothing is lost. The caller then starts each
claimed job through RQ (`prepare_execution`, `prepare_job_execution(remove_from_intermediate_queue=True)`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job

from mlxq.jobs import keys
from mlxq.worker.bounded_job import BoundedJob, Parse, bounded_payload
from mlxq.worker.dead_letters import DeadLetters
from mlxq.worker.stream_writer import REDIS_TRANSIENT

log = logging.getLogger(__name__)

_MIN_PART = 16  # ids a look reads at least at a time (a few more than the choice needs: fewer trips)

_MOVE = """
local moved = {}
for i, id in ipairs(ARGV) do
  if redis.call('LREM', KEYS[1], 1, id) == 1 then
    moved[#moved + 1] = id
  end
end
if #moved > 0 then
  redis.call('RPUSH', KEYS[2], unpack(moved))
end
return moved
"""


# Each key's hash, as HGETALL gives it (false for a key that holds no hash): one call for the hashes
# of a look where a pipeline of HGETALLs has the client pack, send and parse one command a job.
_READ = """
local hashes = {}
for i, key in ipairs(KEYS) do
  local ok, fields = pcall(redis.call, 'HGETALL', key)
  hashes[i] = ok and fields
end
return hashes
"""


@dataclass(frozen=True)
class QueuedJob:
    """A queued job as stored by RQ's JSON serializer: an mlxq function and its one argument, and the
    payload as inflated with what RQ's JSON serializer makes of it (`parse`: the claimed job keeps it,
    `BoundedJob.read`, where RQ would parse it again)."""

    id: str
    func: str
    payload: Any
    parse: Parse | None = None


def parse_queued(job_id: str, data: bytes | None, origin: bytes | None, queue: str) -> QueuedJob | None:
    """The job in RQ's `data` field if it is an mlxq job with exactly one argument, else None.

    Anything else (pickle, another function, extra arguments, a payload over the worker's size limit,
    which is never inflated here, a job whose origin is another queue) is left in the queue for RQ's own
    dequeue, where the worker rejects it, puts it aside or drops it, with a reason.
    """
    if not data or origin is None or origin.decode(errors="replace") != queue:
        return None  # a job of another queue (its id pushed here) is RQ's dequeue's to drop
    raw, _too_large = bounded_payload(data, BoundedJob.max_payload_bytes)  # inflated once, at most the cap
    if raw is None:
        return None
    try:
        parsed = json.loads(raw.decode())  # as RQ's JSON serializer reads it (UTF-8 only)
        func, _instance, args, kwargs = parsed
    except (ValueError, TypeError):
        return None
    if func not in keys.JOB_FUNCS or kwargs or not isinstance(args, list) or len(args) != 1:
        return None
    return QueuedJob(job_id, func, args[0], (raw, tuple(parsed)))


class QueueHeads:
    """The ids at the head of queues, read in a round trip the caller makes anyway (a `Rider` of
    `RqBatches.start`: a generation batch's first look at its queues rides in its first job's start),
    for `JobClaimer.claim` to choose from without reading them again. A queue whose read failed has no
    entry in `ids` (its claim reads it)."""

    def __init__(self, queues: list[Queue], scan: int) -> None:
        self.queues = queues
        self.scan = scan
        self.ids: dict[str, list[str]] = {}  # queue name -> its first ids, in queue order

    def queue(self, pipe: Any, runs: list[Any]) -> None:
        for queue in self.queues:
            pipe.lrange(queue.key, 0, self.scan - 1)

    def replied(self, replies: list[Any]) -> None:
        self.ids = {
            queue.name: [_text(i) for i in reply]
            for queue, reply in zip(self.queues, replies, strict=True)
            if isinstance(reply, list)
        }


class JobClaimer:
    """Moves chosen queued jobs from a queue into RQ's intermediate list for this worker."""

    def __init__(
        self, conn: redis.Redis, serializer: Any, scan: int = 128, dead_letters: DeadLetters | None = None
    ) -> None:
        self.conn = conn
        self.serializer = serializer
        self.dead_letters = dead_letters  # where a claimed job RQ cannot read goes (else: left for RQ)
        self.scan = scan  # queued ids looked at per claim
        self._move = conn.register_script(_MOVE)
        self._read_hashes = conn.register_script(_READ)
        # Parsed `data` of the ids seen at the head of the queue last time: a queued job's data does
        # not change, and with a backlog most of the window is the same from one claim to the next
        # (a generation batch claims every few steps; each look read and parsed 128 jobs).
        self._seen: dict[str, QueuedJob | None] = {}
        self._seen_in = ""  # the queue `_seen` was read from (a job is parsed against its queue)

    def heads(self, queues: list[Queue]) -> QueueHeads:
        """The ids at the head of `queues`, to read in a round trip of the caller's (a `Rider`)."""
        return QueueHeads(queues, self.scan)

    def claim(
        self, queue: Queue, pick: Callable[[QueuedJob], bool], limit: int, head: list[str] | None = None
    ) -> list[Job]:
        """Up to `limit` jobs, in queue order, for which `pick` says yes (it may keep a budget).

        The queue's head is read as far as the choice needs, a part at a time (mostly one round trip):
        a job chosen from the part read by this look starts from the hash read, not read again. `head`:
        the queue's first ids as just read (`heads`), where this look need not read them itself."""
        if limit <= 0:
            return []
        ids = head if head is not None else [_text(i) for i in self.conn.lrange(queue.key, 0, self.scan - 1)]
        if not ids:
            return []
        if queue.name != self._seen_in:
            self._seen, self._seen_in = {}, queue.name
        self._seen = {job_id: self._seen[job_id] for job_id in ids if job_id in self._seen}
        chosen: list[str] = []
        fresh: dict[str, dict[bytes, bytes]] = {}
        at = 0
        while at < len(ids) and len(chosen) < limit:
            part = ids[at : at + max(limit - len(chosen), _MIN_PART)]
            at += len(part)
            fresh.update(self._read(part, queue.name))
            for job_id in part:
                queued = self._seen[job_id]
                if queued is not None and len(chosen) < limit and pick(queued):
                    chosen.append(job_id)
        if not chosen:
            return []
        moved = [_text(m) for m in self._move(keys=[queue.key, queue.intermediate_queue_key], args=chosen)]
        return self._fetch(moved, queue, fresh)

    def _read(self, ids: list[str], queue: str) -> dict[str, dict[bytes, bytes]]:
        """Read and parse into `_seen` the ids of `ids` not seen before; the hashes read, by id. An id
        whose key is no hash (WRONGTYPE) is not claimed: RQ's dequeue meets it and puts it aside."""
        new = [job_id for job_id in ids if job_id not in self._seen]
        fresh: dict[str, dict[bytes, bytes]] = {}
        if not new:
            return fresh
        for job_id, flat in zip(new, self._read_hashes(keys=[keys.rq_job_key(i) for i in new]), strict=True):
            if flat is None:  # WRONGTYPE: not a hash
                self._seen[job_id] = None
                continue
            pairs = iter(flat)
            fields = dict(zip(pairs, pairs, strict=True))
            self._seen[job_id] = parse_queued(job_id, fields.get(b"data"), fields.get(b"origin"), queue)
            if fields:
                fresh[job_id] = fields
        return fresh

    def _fetch(self, ids: list[str], queue: Queue, fresh: dict[str, dict[bytes, bytes]]) -> list[Job]:
        """The claimed jobs: those whose hash this look read restored from it, the others (read by an
        earlier look: the job may have run and come back since, its hash rewritten) read in one round
        trip (one by one if that fails). One RQ cannot read is put aside (`DeadLetters`).

        A hash read just before the move gives the job RQ's fetch after it would: a queued job's hash
        is written by a cancel (RQ's `Job.cancel` takes the id off the queue first, so the move does
        not take it) or when the job is queued again, which takes longer than a look."""
        found: list[Job | None] = [None] * len(ids)
        for i, job_id in enumerate(ids):
            if job_id in fresh:
                queued = self._seen.get(job_id)
                parse = queued.parse if queued is not None else None
                found[i] = _restored(job_id, fresh[job_id], self.conn, self.serializer, parse)
        stale = [job_id for job_id, job in zip(ids, found, strict=True) if job is None]
        if stale:
            try:
                fetched = dict(
                    zip(
                        stale,
                        BoundedJob.fetch_many(stale, connection=self.conn, serializer=self.serializer),
                        strict=True,
                    )
                )
                found = [job if job is not None else fetched[i] for i, job in zip(ids, found, strict=True)]
            except Exception:  # a job RQ cannot restore: find it alone below
                pass
        jobs = []
        for job_id, job in zip(ids, found, strict=True):
            try:
                jobs.append(job or BoundedJob.fetch(job_id, connection=self.conn, serializer=self.serializer))
            except NoSuchJobError as e:  # deleted meanwhile: nothing to run; leave it to RQ's cleanup
                log.warning("claimed job vanished job=%s error=%s", job_id, e)
            except REDIS_TRANSIENT:
                raise
            except Exception as e:
                if self.dead_letters is None:
                    log.warning("claimed job cannot be read job=%s error=%s", job_id, e)
                else:
                    self.dead_letters.put_aside(job_id, queue, e)
        return jobs


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _restored(
    job_id: str, fields: dict[bytes, bytes], conn: redis.Redis, serializer: Any, parse: Parse | None
) -> Job | None:
    """The job of a hash read from Redis, as RQ's `fetch` restores it, with the claim's parse of its
    payload; None if it cannot be (then it is fetched alone, which says why)."""
    try:
        return BoundedJob.read(job_id, fields, conn, serializer, parse)
    except Exception:
        return None
