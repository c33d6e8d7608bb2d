"""`BoundedJob`'s date check takes exactly the date texts RQ's own parser takes, and reads them alike."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import str_to_date, utcformat

from mlxq.worker.bounded_job import BoundedJob, _date, field_problem

_TEXTS = [
    b"2026-02-30T00:00:00.000000Z",  # no such day
    b"2026-01-01T24:00:00.000000Z",
    b"2026-01-01T23:59:60.000000Z",
    b"2026-13-01T00:00:00.000000Z",
    b"0000-01-01T00:00:00.000000Z",
    b"2026-01-01T00:00:00Z",  # RQ's older form
    b"2026-1-1T0:0:0.5Z",  # unpadded: only strptime's form takes it
    b"2026-01-01T00:00:00.000000",  # no Z
    b"2026-01-01 00:00:00.000000Z",
    b"\xd9\xa2026-01-01T00:00:00.000000Z",  # a non-ASCII digit
    b"2026-01-01T00:00:00.0000001Z",
    b"nonsense",
]


def _read(parse: object, text: bytes) -> datetime | str:
    try:
        return parse(text)  # type: ignore[operator,no-any-return]
    except (ValueError, UnicodeDecodeError) as e:
        return type(e).__name__


@pytest.mark.parametrize("text", _TEXTS)
def test_odd_dates_pass_or_fail_as_rqs_parser(text: bytes) -> None:
    assert _read(_date, text) == _read(str_to_date, text)


def test_dates_rq_writes_read_as_rqs_parser_reads_them() -> None:
    start = datetime(2024, 2, 28, 23, 59, 58, 999_999, tzinfo=timezone.utc)
    for step in range(0, 400_000, 997):
        text = utcformat(start + timedelta(seconds=step * 61, microseconds=step)).encode()
        assert _date(text) == str_to_date(text)


def test_a_bad_date_field_is_named() -> None:
    fields = {b"origin": b"q", b"enqueued_at": b"2026-02-30T00:00:00.000000Z"}
    problem = field_problem(fields, 1 << 20)
    assert problem is not None and "'enqueued_at'" in problem


def test_a_restored_job_has_the_dates_rqs_restore_gives() -> None:
    conn = redis.Redis()  # restoring reads nothing from Redis
    stamp = utcformat(datetime(2026, 3, 1, 12, 30, 5, 123_456, tzinfo=timezone.utc)).encode()
    for dated in (
        [],
        ["created_at"],
        ["created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat"],
    ):
        fields = {b"origin": b"q", b"data": b'["jobs.score", null, [{}], {}]', b"status": b"queued"}
        fields.update({name.encode(): stamp for name in dated})
        ours = BoundedJob("a", connection=conn, serializer=JSONSerializer)
        rqs = Job("a", connection=conn, serializer=JSONSerializer)
        ours.restore(fields)
        rqs.restore(fields)
        for name in ("enqueued_at", "started_at", "ended_at", "last_heartbeat", "origin", "args"):
            assert getattr(ours, name) == getattr(rqs, name), name
        if dated:
            assert ours.created_at == rqs.created_at
        else:  # both "now" (RQ's restore sets a missing creation time to the time of reading)
            assert ours.created_at is not None and rqs.created_at is not None


def test_a_read_jobs_dates_give_the_text_rqs_utcformat_gives() -> None:
    """`BoundedJob.date_text` (RQ's end saves a job's dates as text) gives a date read in RQ's form back
    as it was read, which is what `utcformat` makes of it; other dates go to `utcformat`."""
    conn = redis.Redis()  # restoring reads nothing from Redis
    texts = [
        b"2026-03-01T12:30:05.123456Z",
        b"1000-01-01T00:00:00.000000Z",
        b"0999-12-31T23:59:59.999999Z",  # strftime writes this year with three digits
        b"2026-03-01T12:30:05Z",  # RQ's older form: read, never given back as read
    ]
    for text in texts:
        fields = {b"origin": b"q", b"data": b'["jobs.score", null, [{}], {}]', b"created_at": text}
        job = BoundedJob("a", connection=conn, serializer=JSONSerializer)
        job.restore(fields)
        assert job.created_at is not None
        assert job.date_text(job.created_at, utcformat) == utcformat(job.created_at)
        assert (job.date_text(job.created_at, lambda d: "") == text.decode()) == (
            text == texts[0] or text == texts[1]
        )
    # The same instant as the first text, in another zone: RQ formats its own fields, not UTC's.
    job = BoundedJob("a", connection=conn, serializer=JSONSerializer)
    job.restore({b"origin": b"q", b"data": b'["jobs.score", null, [{}], {}]', b"created_at": texts[0]})
    other = datetime(2026, 3, 1, 13, 30, 5, 123_456, tzinfo=timezone(timedelta(hours=1)))
    assert other == job.created_at
    assert job.date_text(other, utcformat) == utcformat(other) != texts[0].decode()


class _Unhashable(dict):  # type: ignore[type-arg]
    """A serializer object that cannot be a key (a dict with the two methods RQ asks for)."""

    @staticmethod
    def dumps(value: object) -> bytes:
        return JSONSerializer.dumps(value)

    @staticmethod
    def loads(value: bytes) -> object:
        return JSONSerializer.loads(value)


def test_a_jobs_serializer_is_resolved_as_rq_resolves_it() -> None:
    """`BoundedJob` resolves its serializer once for all jobs (RQ checks it against its Protocol for
    each): the same serializer comes out, and a bad one fails as RQ's `Job` fails with it."""
    conn = redis.Redis()  # making a job reads nothing from Redis
    unhashable = _Unhashable()
    for serializer in (JSONSerializer, "rq.serializers.JSONSerializer", None, unhashable):
        ours = BoundedJob("a", connection=conn, serializer=serializer)
        assert ours.serializer is Job("a", connection=conn, serializer=serializer).serializer
    for bad in (object(), "no_such_module.Serializer"):
        with pytest.raises(Exception) as rqs:  # whatever RQ raises: the same here
            Job("a", connection=conn, serializer=bad)
        with pytest.raises(type(rqs.value)):
            BoundedJob("a", connection=conn, serializer=bad)
