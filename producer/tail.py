"""Following a job's stream: the reading logic both clients share, with no I/O of its own.

A reader issues `XREAD BLOCK` from its last id (at most `READ_BLOCK_MS` at a time) and, between blocks,
asks RQ for the job's status, because a job that fails before the worker reaches its stream never gets
a terminal event. `Follower` decides what to read next and when to ask; the clients do the reading.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxq.jobs.schema import DoneEvent, ErrorEvent, StreamEvent, parse_event

from .settings import READ_BLOCK_MS

START_ID = "0-0"
"""Read from the start: `$` would miss whatever the worker wrote before the read was issued."""

STATUS_EVERY_S = 1.0
FRESH_BLOCK_MS = 100
"""A fresh job's first read: short, so that a reader whose caller has gone meanwhile (a client that hung up
on the gateway) gives its connection back whole soon after (`AsyncJobHandle.stream`'s `fresh`)."""

RESULT_GRACE_S = 1.0
"""How long to look for the result after a `done` event (the worker writes both in one pipeline)."""

RESULT_POLL_S = 0.05


@dataclass(frozen=True)
class StreamItem:
    """One stream entry: its id (save it to resume with `stream(from_id=...)`) and its parsed event."""

    stream_id: str
    event: StreamEvent

    @property
    def terminal(self) -> bool:
        """True for `done` and `error`: nothing follows them."""
        return isinstance(self.event, DoneEvent | ErrorEvent)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def decode_entries(entries: list[Any]) -> list[StreamItem]:
    """Stream entries as redis-py returns them (`[(id, {field: value})]`, bytes or str) → items."""
    items = []
    for entry_id, fields in entries:
        decoded = {_text(k): _text(v) for k, v in fields.items()}
        items.append(StreamItem(stream_id=_text(entry_id), event=parse_event(decoded)))
    return items


def newest(entries: list[Any] | None) -> tuple[str, StreamItem | None]:
    """From the reply of `XREVRANGE <stream> + - COUNT 1`: the id to follow the stream from, and the
    newest item if it is terminal. The terminal event is always last, so older entries need no reading."""
    items = decode_entries(entries or [])
    if not items:
        return START_ID, None
    return items[0].stream_id, items[0] if items[0].terminal else None


_TERMINAL_EVENTS = {"done", "error"}


def first_terminal(entries: list[Any]) -> tuple[str, StreamItem | None]:
    """For a reader that waits only for a job's end: the id to read on from after `entries` (as
    redis-py returns them, at least one) and their first terminal item, if any. Token events are
    passed over unparsed."""
    for entry_id, fields in entries:
        if _text(fields.get(b"event", fields.get("event", b""))) in _TERMINAL_EVENTS:
            (item,) = decode_entries([(entry_id, fields)])
            return item.stream_id, item
    return _text(entries[-1][0]), None


def decode_xread(reply: Any) -> list[StreamItem]:
    """The entries of an `XREAD` reply on one stream (RESP2 list or RESP3 map) → items."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, Mapping) else [entries for _, entries in reply]
    items: list[StreamItem] = []
    for entries in streams:
        if len(entries) == 1 and isinstance(entries[0], list):
            entries = entries[0]  # RESP3 nests the entry list once more; entries themselves are tuples
        items.extend(decode_entries(entries))
    return items


@dataclass
class Deadline:
    """A point in monotonic time after which a wait gives up; `timeout=None` never does."""

    timeout: float | None
    clock: Callable[[], float] = time.monotonic
    _end: float = field(init=False)

    def __post_init__(self) -> None:
        self._end = math.inf if self.timeout is None else self.clock() + max(self.timeout, 0.0)

    def remaining(self) -> float:
        return max(self._end - self.clock(), 0.0)

    def expired(self) -> bool:
        return self.clock() >= self._end

    def check(self, what: str) -> None:
        """Raise `TimeoutError` naming `what` once the deadline has passed."""
        if self.expired():
            raise TimeoutError(f"{what}: no answer within {self.timeout} s")


@dataclass
class Follower:
    """Where a reader is in one stream, and when it owes RQ a status check."""

    last_id: str = START_ID
    deadline: Deadline = field(default_factory=lambda: Deadline(None))
    ended: bool = False
    fresh: bool = False
    """The reader enqueued the job a moment ago: it cannot be over yet (see `block_ms`)."""
    _next_status_at: float = field(default=0.0, init=False)
    _read_once: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.fresh:  # queued a moment ago: RQ's status is not worth a round trip while events come
            self._next_status_at = self.deadline.clock() + STATUS_EVERY_S

    def block_ms(self) -> int | None:
        """How long the next XREAD may block: None (not at all) the first time, so that a job that is
        already over is seen at once, or `FRESH_BLOCK_MS` for a fresh job (nothing to see yet); then at
        most a second, never past the deadline, at least 1 ms."""
        if not self._read_once:
            self._read_once = True
            if not self.fresh:
                return None
            return max(1, int(min(FRESH_BLOCK_MS, self.deadline.remaining() * 1000)))
        return max(1, int(min(READ_BLOCK_MS, self.deadline.remaining() * 1000)))

    def first_read(self) -> bool:
        """Whether no read was made yet (`block_ms` counts them)."""
        return not self._read_once

    def accept(self, items: list[StreamItem]) -> list[StreamItem]:
        """Take newly read items: moves `last_id`, keeps nothing after a terminal event."""
        kept: list[StreamItem] = []
        for item in items:
            if self.ended:
                break
            kept.append(item)
            self.last_id = item.stream_id
            self.ended = item.terminal
        return kept

    def status_due(self, got_items: bool) -> bool:
        """After an empty read, or a second after the last check, the reader asks RQ for the status."""
        clock = self.deadline.clock()
        if got_items and clock < self._next_status_at:
            return False
        self._next_status_at = clock + STATUS_EVERY_S
        return True
