"""RQ's `Job`, read defensively: every field RQ reads checked, and the payload's size, before RQ reads it.

A producer in any language writes job hashes. RQ inflates a job's `data` field (zlib) in full as it
reads the job (1 MB of zlib can hold 1 GiB), and takes some malformed fields that its own bookkeeping
fails on later (a dependency list that is a number), where the error ends the worker. Every job this
worker reads (dequeued, claimed, looked at by RQ's maintenance) is read through `BoundedJob`, whose
`restore` first checks each field RQ reads with RQ's own parser (or a stricter one) and measures the
payload: its stored bytes, and what they inflate to, inflated in steps that stop at the cap. A job that
fails a check cannot be read: `UnreadableJob` names the field, and the job is put aside with that
reason (`dead_letters.py`), never inflated again.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, ClassVar

from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer, resolve_serializer
from rq.utils import now, parse_timeout, str_to_date


class UnreadableJob(ValueError):
    """A job hash with a field this worker will not read (named in the message), or whose payload is
    larger, stored or inflated, than it takes (`MLXQ_MAX_PAYLOAD_BYTES`)."""


def bounded_payload(data: bytes | str, limit: int) -> tuple[bytes | None, str | None]:
    """A job hash's `data` field as RQ reads it (inflated where it is zlib-compressed, else as stored),
    and None; or None and why it is too large. Never inflates past `limit` + 1 bytes."""
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > limit:
        why = (
            f"field 'data' holds {len(raw)} bytes; this worker takes at most {limit} (MLXQ_MAX_PAYLOAD_BYTES)"
        )
        return None, why
    inflater = zlib.decompressobj()
    try:
        inflated = inflater.decompress(raw, limit + 1)
    except zlib.error:
        return raw, None  # not compressed: RQ reads it as it is, and its size was checked above
    if len(inflated) > limit:
        return None, (
            f"field 'data' inflates to more than {limit} bytes ({len(raw)} compressed); this worker takes "
            f"at most {limit} (MLXQ_MAX_PAYLOAD_BYTES)"
        )
    return inflated, None


# Deflate's largest ratio of inflated to stored bytes (a 258-byte match in a 1-bit-per-symbol code):
# stored bytes this many times over within the cap cannot inflate past it.
_DEFLATE_MAX_RATIO = 1032


def payload_size_error(data: bytes | str | None, limit: int) -> str | None:
    """Why `data` (a job hash's `data` field, zlib-compressed or not) is too large, else None. A
    payload too short to inflate past `limit` is not inflated: its size is all that is asked here."""
    if data is None or (isinstance(data, bytes) and len(data) * _DEFLATE_MAX_RATIO <= limit):
        return None
    return bounded_payload(data, limit)[1]


def _json_list(value: bytes) -> Any:
    parsed = json.loads(value.decode())
    if not isinstance(parsed, list) or not all(isinstance(v, str | int | float) for v in parsed):
        raise ValueError("not a JSON list of ids or numbers")
    return parsed


# The form RQ writes its dates in (`rq.utils.utcformat`).
# Hours 00-23 only: ISO 8601's 24:00, which some Pythons' `fromisoformat` takes, goes to RQ's parser.
_RQ_DATE = re.compile(rb"\d{4}-\d{2}-\d{2}T(?:[01]\d|2[0-3]):\d{2}:\d{2}\.\d{6}Z")


def _date(value: bytes) -> datetime:
    """A date field checked as RQ's `str_to_date` reads it: the form RQ writes by a pattern and the
    calendar's ranges (`strptime` costs several times more, and RQ's restore parses the field again),
    any other form by RQ's own parser, so that the same values pass."""
    if _RQ_DATE.fullmatch(value) is None:
        return str_to_date(value)
    # ISO 8601 in RQ's form (UTC, `Z`); the calendar is checked (a 30 February raises ValueError, as
    # strptime does). The `Z` is cut off first: `fromisoformat` takes it from Python 3.11 on only.
    return datetime.fromisoformat(value[:-1].decode()).replace(tzinfo=timezone.utc)


_DATES = ("created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat")  # RQ's job dates
_DATE_KEYS = [(name, name.encode()) for name in _DATES]


def _flag(value: bytes) -> bool:
    return bool(int(value))


def _text(value: bytes) -> str:
    return value.decode()


# The fields `rq.job.Job.restore` reads, in its order, each with RQ's parser (or a stricter one where
# RQ takes a value its own bookkeeping later fails on, such as a dependency list that is no list) and
# what it expects.
_FIELDS: list[tuple[str, Callable[[bytes], Any], str]] = [
    ("origin", _text, "UTF-8 text"),
    ("worker_name", _text, "UTF-8 text"),
    ("description", _text, "UTF-8 text"),
    ("group_id", _text, "UTF-8 text"),
    ("created_at", _date, "a date in RQ's format, e.g. 2026-01-01T12:00:00.000000Z"),
    ("enqueued_at", _date, "a date in RQ's format"),
    ("started_at", _date, "a date in RQ's format"),
    ("ended_at", _date, "a date in RQ's format"),
    ("last_heartbeat", _date, "a date in RQ's format"),
    ("timeout", lambda v: parse_timeout(v.decode()), "a number of seconds"),
    ("result_ttl", int, "an integer"),
    ("failure_ttl", int, "an integer"),
    ("status", lambda v: JobStatus(v.decode()), "one of RQ's job statuses"),
    ("success_callback_name", _text, "UTF-8 text"),
    ("failure_callback_name", _text, "UTF-8 text"),
    ("stopped_callback_name", _text, "UTF-8 text"),
    ("success_callback_timeout", int, "an integer"),
    ("failure_callback_timeout", int, "an integer"),
    ("stopped_callback_timeout", int, "an integer"),
    ("dependency_ids", _json_list, "a JSON list of job ids"),
    ("allow_dependency_failures", _flag, "0 or 1"),
    ("enqueue_at_front", _flag, "0 or 1"),
    ("ttl", int, "an integer"),
    ("number_of_retries", int, "an integer"),
    ("retries_left", int, "an integer"),
    ("retry_intervals", _json_list, "a JSON list of seconds"),
    ("enqueue_at_front_on_retry", _flag, "0 or 1"),
    ("repeats_left", int, "an integer"),
    ("repeat_intervals", _json_list, "a JSON list of seconds"),
    ("rate_limit_key", _text, "UTF-8 text"),
    ("rate_limit_concurrency", int, "an integer"),
]


def field_problem(fields: dict[bytes, bytes], max_payload_bytes: int) -> str | None:
    """The first field of a job hash this worker will not read, named with what it expects; else None."""
    return _checked(fields, max_payload_bytes)[0]


_FIELD_KEYS = [(name.encode(), name, parse, expected) for name, parse, expected in _FIELDS]
_PARSERS = {name.encode(): (name, parse) for name, parse, _ in _FIELDS}


def _checked(fields: dict[bytes, bytes], max_payload_bytes: int) -> tuple[str | None, dict[str, Any]]:
    """`field_problem`, and the values of the fields it parsed by name (the dates among them are what
    the job holds once restored)."""
    if not fields.get(b"origin"):  # RQ would end the job in registries of a queue named ""
        return "field 'origin' is missing: it must name the job's queue", {}
    # The hash's own fields, each parsed once (a hash holds about half of the fields RQ reads); where
    # one fails, the fields are checked again in RQ's order, so the first bad one is named.
    parsed: dict[str, Any] = {}
    try:
        for key, value in fields.items():
            spec = _PARSERS.get(key)
            if spec is not None and value:
                parsed[spec[0]] = spec[1](value)
    except Exception:
        return _checked_in_order(fields)
    return payload_size_error(fields.get(b"data"), max_payload_bytes), parsed


def _checked_in_order(fields: dict[bytes, bytes]) -> tuple[str | None, dict[str, Any]]:
    """`_checked`'s parse, field by field in RQ's order, up to the first field that fails."""
    parsed: dict[str, Any] = {}
    for key, name, parse, expected in _FIELD_KEYS:
        value = fields.get(key)
        if not value:
            continue
        try:
            parsed[name] = parse(value)
        except Exception:
            return f"field {name!r} is {value[:60].decode(errors='replace')!r}, not {expected}", parsed
    raise AssertionError("a field failed its parse, then passed it")  # the parsers are pure


@lru_cache(maxsize=8)
def _serializer(serializer: Any) -> Any:
    return resolve_serializer(serializer)


class BoundedJob(Job):
    """A `Job` that reads a hash only when every field RQ reads holds what RQ expects and its payload is
    within `max_payload_bytes` (stored and inflated); else `UnreadableJob`, naming the field."""

    max_payload_bytes: ClassVar[int] = 16 << 20
    # The hash as read, field by field: a batch's end (`rq_batches`) writes back only the fields whose
    # value RQ's end would change, where RQ rewrites the whole hash. None: not read from a hash.
    stored_fields: dict[bytes, bytes] | None = None
    _payload_read: bytes | None = None  # the payload as restored, where stored in RQ's form
    # A return value and its JSON text as mlxq's writes stored it (what RQ's JSON serializer makes of
    # it), for RQ's end to send as it is (`returned_text`). None: not written by mlxq.
    returned: tuple[Any, bytes] | None = None

    def __init__(self, id: str | None = None, connection: Any = None, serializer: Any = None) -> None:
        # RQ resolves the serializer for every job it makes, checking it against its Protocol at
        # runtime (most of making one); a worker reads every job with the same one: resolved once.
        super().__init__(id, connection=connection)
        self._date_texts: dict[datetime, str] = {}  # dates read from the hash: their text as stored
        try:
            self.serializer = _serializer(serializer)
        except TypeError:  # not hashable: resolved as RQ resolves it
            self.serializer = resolve_serializer(serializer)

    def restore(self, raw_data: Any) -> Any:
        fields = {
            k.encode() if isinstance(k, str) else k: v.encode() if isinstance(v, str) else v
            for k, v in dict(raw_data).items()
        }
        return self.restore_read(fields)

    @classmethod
    def read(
        cls,
        job_id: str,
        fields: dict[bytes, bytes],
        connection: Any,
        serializer: Any,
        parse: Parse | None = None,
    ) -> BoundedJob:
        """A job made for a hash as read from Redis and restored from it (`restore_read`); a hash of
        only the fields RQ's enqueue writes for a plain job (`_PLAIN_KEYS`) by `_restore_plain`, which
        sets what RQ's restore sets from the values the check parsed, not parsing them again. `parse`:
        the payload as a claim inflated it and what RQ's JSON serializer makes of it, which the job
        keeps where its own payload is those bytes (RQ would parse it again when asked its function)."""
        job = cls(job_id, connection=connection, serializer=serializer)
        job.restore_read(fields, fresh=True)
        if parse is not None and job.serializer is JSONSerializer and job._data == parse[0]:
            job._func_name, job._instance, job._args, job._kwargs = parse[1]
        return job

    def restore_read(self, fields: dict[bytes, bytes], fresh: bool = False) -> Any:
        """`restore` of a hash as read from Redis (names and values bytes, as a claim reads them),
        taken as it is: kept as `stored_fields`, so not changed by the caller afterwards. `fresh`: the
        job was just made (nothing restored into it yet), so what a plain hash leaves out keeps the
        value `Job.__init__` gave it, which is what RQ's restore sets for a missing field."""
        problem, parsed = _checked(fields, self.max_payload_bytes)
        if problem is not None:
            raise UnreadableJob(problem)
        dates = [(name, key) for name, key in _DATE_KEYS if name in parsed]
        if fresh and fields.keys() <= _PLAIN_KEYS and b"data" in fields:
            restored = None  # what RQ's restore returns
            self._restore_plain(fields, parsed)
        else:
            # RQ's restore parses dates with strptime; they are read here (checked above, so they
            # parse) and left out of what it reads, which then leaves them unset, set as it would.
            undated = fields.copy()
            for _, key in dates:
                del undated[key]
            restored = super().restore(undated)
            for name, _ in dates:
                setattr(self, name, parsed[name])
        self.stored_fields = fields
        # A date read in RQ's own form is that date's `utcformat` text (years from 1000 on: strftime
        # writes fewer digits below), kept so that RQ's end need not format it again.
        self._date_texts = {
            parsed[name]: fields[key].decode()
            for name, key in dates
            if parsed[name].year >= 1000 and _RQ_DATE.fullmatch(fields[key]) is not None
        }
        payload, stored = self.data, fields.get(b"data", b"")
        inflated = payload != stored  # else RQ read it as it is (not zlib, or a broken stream)
        self._payload_read = payload if inflated and stored[:2] == _RQ_ZLIB else None
        return restored

    def _restore_plain(self, fields: dict[bytes, bytes], parsed: dict[str, Any]) -> None:
        """What `rq.job.Job.restore` sets on a new job from a hash of `_PLAIN_KEYS` only, with `data`,
        each value as RQ parses it (the check parsed them with RQ's parsers: `_FIELDS`). A field RQ
        reads differently from the check (a timeout: RQ parses the stored bytes) is read as RQ reads
        it. `tests/service/test_bounded_job_read.py` holds it against RQ's restore."""
        raw = fields[b"data"]
        try:
            self.data = zlib.decompress(raw)
        except zlib.error:
            self.data = raw
        get = parsed.get
        self.created_at = get("created_at") or now()
        self.origin = get("origin") or ""
        self.worker_name, self.description, self.group_id = (
            get("worker_name"),
            get("description"),
            get("group_id"),
        )
        self.enqueued_at, self.started_at = get("enqueued_at"), get("started_at")
        self.ended_at, self.last_heartbeat = get("ended_at"), get("last_heartbeat")
        self.timeout = parse_timeout(fields[b"timeout"]) if fields.get(b"timeout") else None  # type: ignore[arg-type]
        self.result_ttl, self.failure_ttl, self.ttl = get("result_ttl"), get("failure_ttl"), get("ttl")
        self._status = get("status") or JobStatus.CREATED
        for name in ("success_callback_name", "failure_callback_name", "stopped_callback_name"):
            if name in parsed:
                setattr(self, f"_{name}", parsed[name])
        meta = fields.get(b"meta")
        try:
            self.meta = self.serializer.loads(meta) if meta else {}
        except Exception:  # as RQ keeps a meta its serializer cannot read
            self.meta = {"unserialized": meta}
            self._unreadable_meta = meta
        self.number_of_retries, self.retries_left = get("number_of_retries"), get("retries_left")
        if "retry_intervals" in parsed:
            self.retry_intervals = parsed["retry_intervals"]
        self.enqueue_at_front_on_retry = bool(get("enqueue_at_front_on_retry"))
        self.allow_dependency_failures = get("allow_dependency_failures")
        self.repeats_left, self.repeat_intervals = get("repeats_left"), get("repeat_intervals")
        self.rate_limit_key, self.rate_limit_concurrency = (
            get("rate_limit_key"),
            get("rate_limit_concurrency"),
        )

    def date_text(self, date: datetime, otherwise: Callable[[datetime], str]) -> str:
        """RQ's `utcformat` of `date`: the text it was read as, where it is a date read from the hash
        in RQ's form (UTC), else `otherwise(date)`."""
        text = self._date_texts.get(date) if date.tzinfo is timezone.utc else None
        return text if text is not None else otherwise(date)

    def returned_text(self, value: Any) -> bytes:
        """`value` as the job's serializer writes it (RQ's `serializer.dumps`): the text mlxq's writes
        made of it where `value` is the value they wrote and the serializer is RQ's JSON one (whose
        `dumps` is `json.dumps` as UTF-8), else dumped here."""
        kept = self.returned
        if kept is not None and kept[0] is value and self.serializer is JSONSerializer:
            return kept[1]
        return bytes(self.serializer.dumps(value))

    def payload_as_rq_stores_it(self) -> bool:
        """Whether the job's payload is the one read from its hash, where it was stored compressed as
        RQ stores one (zlib at its default level): RQ's save would write it back compressed again,
        the same bytes where this worker's zlib made them, else the same payload."""
        return self._payload_read is not None and self.data is self._payload_read


# The fields of a hash `_restore_plain` reads: what RQ's enqueue writes for a job with no dependency,
# callback timeout, webhook, result or error, and what a start, a retry or a repeat add. A hash with any
# other field (or an empty `enqueue_at_front`, which RQ's restore fails on) is restored by RQ's restore.
_PLAIN_KEYS = frozenset(
    name.encode()
    for name in (
        "data", "origin", "worker_name", "description", "group_id", "created_at", "enqueued_at",
        "started_at", "ended_at", "last_heartbeat", "timeout", "result_ttl", "failure_ttl", "ttl",
        "status", "success_callback_name", "failure_callback_name", "stopped_callback_name", "meta",
        "number_of_retries", "retries_left", "retry_intervals", "enqueue_at_front_on_retry",
        "allow_dependency_failures", "repeats_left", "repeat_intervals", "rate_limit_key",
        "rate_limit_concurrency",
    )
)  # fmt: skip

# A payload as a claim inflated it, and RQ's JSON serializer's reading of it: (function, instance,
# args, kwargs).
Parse = tuple[bytes, tuple[Any, Any, Any, Any]]

_RQ_ZLIB = b"\x78\x9c"  # the header of a zlib stream at the default level, as RQ's `to_dict` writes one
