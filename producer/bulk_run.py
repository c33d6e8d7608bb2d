"""The loop of one bulk run: jobs out, at most `in_flight` at a time; their ends in, in any order.

Many jobs are enqueued per round trip and their streams are read together with one blocking `XREAD`;
RQ's status is asked every few seconds for jobs that end without a terminal event. A failed job's rows
are sent again one per job, so one bad row fails alone. Rows come in and results go out through
`bulk_files`; what a row and a job are is `bulk_kinds`'. The loop sees a client only as a `BulkTarget`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import redis
from pydantic import ValidationError
from redis.client import Pipeline

from mlxq.jobs import keys
from mlxq.jobs.replication import NotReplicated, Replicas, unreplicated_warning
from mlxq.jobs.schema import ErrorEvent, StreamEvent

from . import cancellation, job_state, payload, rq_wire
from .bulk_files import OrderedOutput, RowState, Slot
from .bulk_kinds import BulkKind, RowNotDone
from .bulk_progress import ProgressLine
from .connection import RetryPolicy
from .tail import START_ID, decode_entries, first_terminal
from .tenant import SHARED, Tenant

log = logging.getLogger(__name__)

READ_BLOCK_MS = 100
STATUS_EVERY_S = 2.0
_ONLY_ROW = re.compile(r"\brow 0: ")


@dataclass(frozen=True)
class BulkOptions:
    """How a dataset is cut into jobs and how many may be outstanding."""

    rows_per_job: int = 16  # rows a job carries, 1..the kind's most (generation: always 1)
    in_flight: int = 64
    queue: str | None = None  # None: the client's queue
    retry_errors: bool = True  # on a rerun, run rows again that the errors file holds

    def __post_init__(self) -> None:
        if self.in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {self.in_flight}")


@dataclass(frozen=True)
class BulkTarget:
    """Where a run sends its jobs: all it takes from a client, so that bulk never imports one.

    The connection is sync: a run is file I/O plus one blocking `XREAD`, so the async client runs it in
    a thread on a sync connection of its own.
    """

    connection: redis.Redis
    retry: RetryPolicy  # the client's: cancels use it as it is, the run's own reads a patient copy
    queue: str  # the client's queue, unless `BulkOptions.queue` names another
    job_options: rq_wire.JobOptions  # the settings' RQ options for every job of the run
    tenant: Tenant = SHARED  # the client's key space: job ids and queue names
    replicas: Replicas | None = None  # the replicas each enqueue waits for (`jobs.replication`)


@dataclass(eq=False)
class _Job:
    id: str
    slots: list[Slot]
    last_id: str = START_ID


class BulkRun:
    """The submit/collect loop of one run, over rows read lazily from the input."""

    def __init__(
        self,
        target: BulkTarget,
        kind: BulkKind,
        options: BulkOptions,
        rows: Iterator[Slot],
        output: OrderedOutput,
        progress: ProgressLine,
        stop: threading.Event,
    ) -> None:
        self.target = target
        self.conn = target.connection
        self.call = target.retry.patient().call  # a run of hours outlives a Redis restart
        self.kind = kind
        self.options = options
        self.queue = target.tenant.queue(options.queue) if options.queue else target.queue
        self.rows = rows
        self.output = output
        self.progress = progress
        self.stop = stop
        # Rows kept in memory from the first undecided one on (the output is in input order): enough
        # to fill every job slot `kind.window_jobs` times over before a slow row stops the reading.
        self.window_cap = (kind.window_jobs * options.in_flight + 1) * options.rows_per_job
        self.pending: deque[Slot] = deque()
        self.singles: deque[Slot] = deque()  # rows of failed jobs, sent again one per job
        self.outstanding: dict[str, _Job] = {}
        self.exhausted = False
        self.window_full = False
        self.jobs = 0
        self._status_at = time.monotonic() + STATUS_EVERY_S

    def run(self) -> bool:
        """Run every row; False if `stop` was set first (outstanding jobs are then cancelled)."""
        try:
            while not self.stop.is_set():
                self._fill()
                self._submit()
                if self.exhausted and not (self.pending or self.singles or self.outstanding):
                    return True
                self._collect()
                self.output.commit()
                self.progress.update(self.output.counts)
            return False
        finally:
            self._cancel_outstanding()
            self.output.commit()

    # --- submitting ------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Read rows until every free job slot can be filled (or the window is full)."""
        want = (self.options.in_flight - len(self.outstanding)) * self.options.rows_per_job
        self.window_full = False
        while not self.exhausted and len(self.pending) < want and not self.stop.is_set():
            if len(self.output) >= self.window_cap:
                self.output.commit()  # skipped and malformed lines at the front leave at once
                if len(self.output) >= self.window_cap:
                    self.window_full = True
                    return
            slot = next(self.rows, None)
            if slot is None:
                self.exhausted = True
                return
            self.output.add(slot)
            if slot.row is not None and slot.state is RowState.PENDING:
                self.pending.append(slot)

    def _next_rows(self) -> tuple[list[Slot], bool]:
        """The rows of the next job and whether it goes to the front of the queue."""
        if self.singles:
            return [self.singles.popleft()], True
        n = self.options.rows_per_job
        if len(self.pending) >= n or (self.pending and (self.exhausted or self.window_full)):
            return [self.pending.popleft() for _ in range(min(n, len(self.pending)))], False
        return [], False

    def _submit(self) -> None:
        """Enqueue as many jobs as there are free slots, all in one transaction."""
        batch: list[tuple[_Job, rq_wire.WireJob]] = []
        while len(self.outstanding) + len(batch) < self.options.in_flight:
            slots, retried = self._next_rows()
            if not slots:
                break
            request = self.kind.request([s.row for s in slots])
            options = replace(self.target.job_options, at_front=True) if retried else self.target.job_options
            wire = rq_wire.build_job(
                self.kind.func,
                payload.wire_payload(request),
                queue=self.queue,
                options=options,
                tenant=self.target.tenant,
            )
            batch.append((_Job(wire.id, slots), wire))
        if not batch:
            return
        self._enqueue([wire for _, wire in batch])
        for job, _ in batch:
            self.outstanding[job.id] = job
        self.jobs += len(batch)
        log.debug("bulk enqueued jobs=%d outstanding=%d", len(batch), len(self.outstanding))

    def _enqueue(self, wires: list[rq_wire.WireJob]) -> None:
        """One MULTI/EXEC for all (retried patiently: a run outlives a Redis restart), then the
        replicas' confirmation under the client's own retries, as a single submit waits for it. Every
        retry first checks whether the jobs are there. Should the confirmation's retries end short, the
        jobs stand with a warning, as a single submit's do."""
        tries = 0

        def write() -> None:
            nonlocal tries
            tries += 1
            if tries > 1 and self.conn.exists(*(w.key for w in wires)):
                return  # the transaction is all or nothing: one job there means all are
            pipe = self.conn.pipeline(transaction=True)
            for wire in wires:
                rq_wire.queue_commands(pipe, wire)
            pipe.execute()

        self.call(write)
        replicas = self.target.replicas
        if replicas is None:
            return

        def confirm() -> None:
            write()  # after a shortfall the jobs may be on a primary going away: written where missing
            replicas.confirm()

        try:
            replicas.confirm()
        except NotReplicated:
            try:
                self.target.retry.call(confirm)
            except NotReplicated as e:
                log.warning("%s", unreplicated_warning(f"{wires[0].id} (and {len(wires) - 1} more)", e))

    # --- collecting ------------------------------------------------------------------------------

    def _collect(self) -> None:
        """Wait briefly for any outstanding job's terminal event; take the results of those that ended."""
        if not self.outstanding:
            return
        by_key = {keys.stream_key(job.id): job for job in self.outstanding.values()}
        streams = {key: job.last_id for key, job in by_key.items()}
        reply = self.call(self.conn.xread, streams, block=READ_BLOCK_MS)  # type: ignore[arg-type]
        ended: dict[str, StreamEvent] = {}
        for key, entries in _stream_entries(reply):
            job = by_key[key]
            job.last_id, end = first_terminal(entries)
            if end is not None:
                ended[job.id] = end.event
        self._conclude(ended)
        if time.monotonic() >= self._status_at:
            self._status_at = time.monotonic() + STATUS_EVERY_S
            self._check_status()

    def _conclude(self, ended: Mapping[str, StreamEvent]) -> None:
        """Read (and delete: the rows are ours now) the results and streams of jobs that ended."""
        if not ended:
            return
        ids = list(ended)

        def build(pipe: Pipeline) -> None:
            for job_id in ids:
                pipe.get(keys.result_key(job_id))
                pipe.delete(keys.result_key(job_id), keys.stream_key(job_id))

        replies = self._pipelined(build)
        for i, job_id in enumerate(ids):
            job = self.outstanding.pop(job_id)
            event = ended[job_id]
            if isinstance(event, ErrorEvent):
                self._failed(job, job_state.last_line(event.message) or "the job failed")
            else:
                self._finished(job, replies[2 * i])

    def _finished(self, job: _Job, raw: bytes | None) -> None:
        if raw is None:
            return self._failed(job, "the job finished but its result key is gone")
        try:
            results = self.kind.results(raw)
        except ValidationError as e:
            return self._failed(job, f"its result does not validate: {e}")
        except RowNotDone as e:
            return self._failed(job, str(e))
        if len(results) != len(job.slots):
            return self._failed(job, f"its result has {len(results)} rows for {len(job.slots)}")
        for slot, row in zip(job.slots, results, strict=True):
            slot.finished(row)
        return None

    def _failed(self, job: _Job, reason: str) -> None:
        """A one-row job's row fails with the reason; a bigger job's rows go again, one per job."""
        if len(job.slots) == 1:
            job.slots[0].failed(_ONLY_ROW.sub("", reason, count=1))
            return
        log.info(
            "bulk job failed, rows resent one per job job=%s rows=%d reason=%s",
            job.id,
            len(job.slots),
            reason,
        )
        self.singles.extend(job.slots)

    def _check_status(self) -> None:
        """Jobs RQ reports over without a terminal event seen (never reached the worker, lost, expired)."""
        jobs = list(self.outstanding.values())
        if not jobs:
            return
        raw = self._pipelined(lambda pipe: [pipe.hget(keys.rq_job_key(j.id), "status") for j in jobs])
        statuses = [rq_wire.decode_status(s) for s in raw]
        over = [(j, s) for j, s in zip(jobs, statuses, strict=True) if s in job_state.ENDED]
        if not over:
            return

        def build(pipe: Pipeline) -> None:
            for job, _ in over:
                pipe.xrevrange(keys.stream_key(job.id), count=1)
                pipe.xrevrange(rq_wire.results_key(job.id), count=1)

        replies = self._pipelined(build)
        ended: dict[str, StreamEvent] = {}
        for i, (job, status) in enumerate(over):
            last = decode_entries(replies[2 * i] or [])
            if last and last[0].terminal:
                ended[job.id] = last[0].event
                continue
            del self.outstanding[job.id]
            if status == job_state.MISSING:
                self._failed(job, "the job vanished: its RQ job expired or was deleted before it ended")
            else:
                text = rq_wire.failure_text(rq_wire.latest_result(job.id, replies[2 * i + 1]))
                self._failed(job, job_state.failure(job.id, status, text).reason)
        self._conclude(ended)

    def _pipelined(self, build: Callable[[Pipeline], object]) -> list[Any]:
        """Run the commands `build` queues in one round trip; built anew on each retry."""

        def once() -> list[Any]:
            pipe = self.conn.pipeline(transaction=False)
            build(pipe)
            return pipe.execute()

        return self.call(once)

    def _cancel_outstanding(self) -> None:
        """Cancel what is still out (queued: never runs; running: asked to stop); its rows stay undone."""
        cancelled = 0
        for job_id in list(self.outstanding):
            try:
                cancellation.cancel_job(self.conn, self.target.retry, job_id)
            except redis.RedisError as e:  # Redis is gone: the rest would fail the same way, slowly
                log.warning("could not cancel outstanding jobs=%d error=%s", len(self.outstanding), e)
                break
            del self.outstanding[job_id]
            cancelled += 1
        if cancelled:
            log.info("bulk stopped; cancelled outstanding jobs=%d", cancelled)
        self.outstanding.clear()


def _stream_entries(reply: Any) -> Iterator[tuple[str, list[Any]]]:
    """(stream key, entries) pairs of an XREAD reply on several streams (RESP2 list or RESP3 map)."""
    if not reply:
        return
    pairs = reply.items() if isinstance(reply, Mapping) else reply
    for key, entries in pairs:
        if len(entries) == 1 and isinstance(entries[0], list):
            entries = entries[0]  # RESP3 nests the entry list once more
        yield (key.decode() if isinstance(key, bytes) else key), entries
