"""Reading a job (its status, its events, its result) written once for both clients, as steps.

Each read is a generator of steps: a `Call` is a Redis command whose reply is sent back in (or whose
error is thrown in), a `Pause` a wait before polling again, a `StreamItem` an event for the caller.
The sync handle drives them with `items`/`run` on redis-py, the async one with `aitems`/`arun` on
redis.asyncio, each making its calls under its client's retry policy; what a read means (when to ask RQ
for the status, what a job that ended without a terminal event failed with, where a result is looked
for) lives here only. `tail.Follower` decides what to read next; this module reads it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from rq.results import Result

from mlxq.jobs import keys
from mlxq.jobs.schema import DoneEvent, ErrorEvent

from . import job_state, rq_wire
from .errors import JobFailed, JobNotFound
from .queue_check import waiting_note, workers_key
from .tail import RESULT_GRACE_S, RESULT_POLL_S, Deadline, Follower, StreamItem, decode_xread, newest

R = TypeVar("R")


@dataclass(frozen=True)
class Call:
    """One Redis command: `method` of the client's connection with `args` and `kwargs`. `whole`: an async
    driver runs it to its end even if its caller is cancelled meanwhile (`AsyncJobHandle.stream`)."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    whole: bool = False


@dataclass(frozen=True)
class Pause:
    """Wait `seconds` before the next step."""

    seconds: float


Step = Call | Pause | StreamItem
Steps = Generator[Step, Any, R]


# --- the reads -------------------------------------------------------------------------------------


def status(job_id: str) -> Steps[str]:
    """RQ's status of the job (`queued`, `started`, `finished`, `failed`, ...) or `missing`."""
    try:
        raw = yield Call("hget", (keys.rq_job_key(job_id), "status"))
    except redis.ResponseError as e:
        return rq_wire.status_after(e)
    return rq_wire.decode_status(raw)


def follow(job_id: str, follower: Follower, whole_reads: bool = False) -> Steps[None]:
    """The job's events from `follower`'s last id, ending after `done` or `error`. Between blocking reads
    RQ's status is asked: a job that ended without a terminal event raises why (`JobFailed`,
    `JobNotFound`). `TimeoutError` at the follower's deadline, saying where the job waits if no worker
    serves its queue. `whole_reads`: see `Call.whole`."""
    key = keys.stream_key(job_id)
    while not follower.ended:
        whole = whole_reads or (follower.fresh and follower.first_read())
        read = Call("xread", ({key: follower.last_id},), {"block": follower.block_ms()}, whole=whole)
        items = follower.accept(decode_xread((yield read)))
        for item in items:
            yield item
        if not follower.ended and follower.status_due(bool(items)):
            now = yield from status(job_id)
            if now in job_state.ENDED:
                # The worker writes its last event before RQ's status changes: read what is left.
                rest = yield Call("xread", ({key: follower.last_id},))
                for item in follower.accept(decode_xread(rest)):
                    yield item
                if not follower.ended:
                    yield from _ended_without_event(job_id, now)
                    return
        if not follower.ended:
            try:
                follower.deadline.check(f"job {job_id}")
            except TimeoutError as e:
                raise (yield from _explained(job_id, e)) from None


def result(job_id: str, parse: Callable[[Any], R], timeout: float | None) -> Steps[R]:
    """Wait for the job to end and return its result parsed by `parse`; `JobFailed` if it failed."""
    deadline = Deadline(timeout)
    raw = yield Call("get", (keys.result_key(job_id),))
    if raw is not None:
        return parse(raw)
    last_id, end = newest((yield Call("xrevrange", (keys.stream_key(job_id),), {"count": 1})))
    if end is None:
        end = yield from _until_terminal(follow(job_id, Follower(last_id=last_id, deadline=deadline)))
    if end is None:
        return (yield from _fetched_result(job_id, parse, wait_s=0.0))
    if isinstance(end.event, ErrorEvent):
        raise (yield from event_failure(job_id, end.event))
    assert isinstance(end.event, DoneEvent)
    return (yield from _fetched_result(job_id, parse, wait_s=RESULT_GRACE_S))


def event_failure(job_id: str, event: ErrorEvent) -> Steps[JobFailed]:
    """The failure an `error` event stands for, with RQ's exception text where it has one."""
    return job_state.event_failure(job_id, event.message, (yield from _failure_text(job_id)))


def _ended_without_event(job_id: str, now: str) -> Steps[None]:
    """The job is over but its stream has no terminal event: RQ says why (or it all expired)."""
    if now in job_state.UNSUCCESSFUL:
        raise job_state.failure(job_id, now, (yield from _failure_text(job_id)))
    if now == job_state.MISSING and not (yield Call("exists", (keys.result_key(job_id),))):
        raise JobNotFound(job_id)


def _fetched_result(job_id: str, parse: Callable[[Any], R], wait_s: float) -> Steps[R]:
    """The result key, else RQ's return value; looked for up to `wait_s` seconds."""
    deadline = Deadline(wait_s)
    while True:
        raw = yield Call("get", (keys.result_key(job_id),))
        found = raw if raw is not None else rq_wire.return_value((yield from _latest_rq_result(job_id)))
        if found is not None:
            return parse(found)
        if deadline.expired():
            raise JobNotFound(job_id)
        yield Pause(RESULT_POLL_S)


def _latest_rq_result(job_id: str) -> Steps[Result | None]:
    entries = yield Call("xrevrange", (rq_wire.results_key(job_id),), {"count": 1})
    return rq_wire.latest_result(job_id, entries)


def _failure_text(job_id: str) -> Steps[str | None]:
    return rq_wire.failure_text((yield from _latest_rq_result(job_id)))


def _explained(job_id: str, error: TimeoutError) -> Steps[TimeoutError]:
    """`error`, or a TimeoutError that also says the job is still queued where no worker serves it."""
    try:
        raw, origin = yield Call("hmget", (keys.rq_job_key(job_id), ["status", "origin"]))
        queue = origin.decode() if isinstance(origin, bytes) else None
        workers = int((yield Call("scard", (workers_key(queue),)))) if queue is not None else 0
    except redis.RedisError:
        return error
    note = waiting_note(job_id, rq_wire.decode_status(raw), queue, workers)
    return TimeoutError(f"{error}; {note}") if note else error


def _until_terminal(steps: Steps[None]) -> Steps[StreamItem | None]:
    """`steps`' calls and pauses, its items kept back: its first terminal item (the rest of `steps`
    left unread), or None if it ended without one."""
    reply: Any = None
    error: Exception | None = None
    while True:
        ended, step = _advanced(steps, reply, error)
        if ended:
            return None
        reply, error = None, None
        if isinstance(step, StreamItem):
            if step.terminal:
                steps.close()
                return step
            continue
        try:
            reply = yield step
        except Exception as e:  # the call failed: `steps` handles it or raises it
            error = e


def _advanced(steps: Steps[Any], reply: Any, error: Exception | None) -> tuple[bool, Any]:
    """`steps` moved on by `reply` (or `error` thrown in): (False, its next step), or (True, what it
    returned)."""
    try:
        return False, (steps.send(reply) if error is None else steps.throw(error))
    except StopIteration as end:
        return True, end.value


def _kept(steps: Steps[R], out: list[R]) -> Steps[None]:
    """`steps`, with what it returns appended to `out` (an async generator cannot return a value)."""
    out.append((yield from steps))


# --- drivers ---------------------------------------------------------------------------------------


def items(steps: Steps[Any], do: Callable[[Call], Any]) -> Iterator[StreamItem]:
    """Drive `steps` on a sync connection: `do` makes each call; the items are yielded."""
    reply: Any = None
    error: Exception | None = None
    while True:
        ended, step = _advanced(steps, reply, error)
        if ended:
            return
        reply, error = None, None
        if isinstance(step, StreamItem):
            yield step
        elif isinstance(step, Pause):
            time.sleep(step.seconds)
        else:
            try:
                reply = do(step)
            except Exception as e:  # thrown into `steps`: a read that expects it handles it
                error = e


def run(steps: Steps[R], do: Callable[[Call], Any]) -> R:
    """Drive a read that yields no items (`status`, `result`) to its value."""
    out: list[R] = []
    for item in items(_kept(steps, out), do):
        raise AssertionError(f"a read without items yielded {item}")
    return out[0]


async def aitems(steps: Steps[Any], do: Callable[[Call], Awaitable[Any]]) -> AsyncIterator[StreamItem]:
    """`items` on an asyncio connection: `do` is awaited for each call."""
    reply: Any = None
    error: Exception | None = None
    while True:
        ended, step = _advanced(steps, reply, error)
        if ended:
            return
        reply, error = None, None
        if isinstance(step, StreamItem):
            yield step
        elif isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
        else:
            try:
                reply = await do(step)
            except Exception as e:  # thrown into `steps`: a read that expects it handles it
                error = e


async def arun(steps: Steps[R], do: Callable[[Call], Awaitable[Any]]) -> R:
    """`run` on an asyncio connection."""
    out: list[R] = []
    async for item in aitems(_kept(steps, out), do):
        raise AssertionError(f"a read without items yielded {item}")
    return out[0]
