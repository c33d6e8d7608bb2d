"""`BoundedJob.read` (a claim's restore of a hash it read) leaves a job as RQ's own restore leaves it,
for any hash of the fields its plain restore reads, and keeps the claim's parse of the payload only
where it is RQ's parse of that payload."""

from __future__ import annotations

import json
import zlib
from typing import Any

import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from rq.job import Job
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.worker.bounded_job import _PLAIN_KEYS, BoundedJob
from mlxq.worker.job_claim import parse_queued

_DATA = json.dumps([keys.SCORE_FUNC, None, [{"rows": []}], {}]).encode()
_VALUES = st.one_of(
    st.sampled_from(
        [
            b"",
            b"0",
            b"1",
            b"-1",
            b"7",
            b" 12 ",
            b"1h",
            b"30m",
            b"x",
            b"queued",
            b"started",
            b"finished",
            b"[]",
            b"[1, 2]",
            b'["a"]',
            b"{}",
            b'{"mlxq_attempt": 2}',
            b"not json",
            b"2026-01-01T12:00:00.000000Z",
            b"2026-01-01T12:00:00Z",
            b"2026-02-30T00:00:00.000000Z",
            b"\xff\xfe",
            _DATA,
            zlib.compress(_DATA),
            zlib.compress(_DATA)[:-3],  # a broken stream: RQ reads it as stored
        ]
    ),
    st.binary(max_size=12),
)
_DATE = [b"2026-01-01T12:00:00.000000Z", b"2026-03-01T12:30:05.123456Z", b"2026-01-01T12:00:00Z"]
_INT = [b"0", b"7", b"-1", b" 12 ", b"86400"]
_TEXT = [b"q", b"a worker", b"jobs.score('x')", "été".encode()]
_LIST = [b"[]", b"[1, 2]", b"[60, 120.5]"]
_GOOD = {
    **{k: _DATE for k in (b"created_at", b"enqueued_at", b"started_at", b"ended_at", b"last_heartbeat")},
    **{k: _INT for k in (b"timeout", b"result_ttl", b"failure_ttl", b"ttl", b"number_of_retries")},
    **{k: _INT for k in (b"retries_left", b"repeats_left", b"rate_limit_concurrency")},
    **{k: _LIST for k in (b"retry_intervals", b"repeat_intervals")},
    **{k: [b"0", b"1"] for k in (b"enqueue_at_front_on_retry", b"allow_dependency_failures")},
    b"status": [b"queued", b"started", b"finished", b"failed", b"deferred"],
    b"meta": [b"{}", b'{"mlxq_attempt": 2}', b"not json"],
    b"data": [_DATA, zlib.compress(_DATA)],
    b"timeout": [b"30", b"1h", b"-1"],
}


def _field(key: bytes) -> st.SearchStrategy[tuple[bytes, bytes]]:
    good = st.sampled_from(_GOOD.get(key, _TEXT))
    value = st.integers(0, 9).flatmap(lambda i: _VALUES if i == 0 else good)  # mostly values RQ reads
    return st.tuples(st.just(key), value)


_HASHES = (
    st.lists(st.sampled_from(sorted(_PLAIN_KEYS)), unique=True, max_size=14)
    .flatmap(lambda names: st.tuples(*[_field(k) for k in names]))
    .map(lambda pairs: {b"data": _DATA, b"origin": b"q", b"status": b"queued", **dict(pairs)})
)
# Set by `BoundedJob` alone (what it keeps of the hash as read), not by RQ's restore; and the client.
_OURS = {"stored_fields", "_date_texts", "_payload_read", "connection"}
_CONN = redis.Redis()  # restoring reads nothing from Redis


def _state(job: Job, created: bool) -> dict[str, Any]:
    state = {k: v for k, v in vars(job).items() if k not in _OURS}
    if not created:  # RQ's restore sets a missing creation time to the time of reading: both "now"
        state.pop("created_at")
    return state


def _restored(fields: dict[bytes, bytes]) -> tuple[Any, Any]:
    conn = _CONN
    rqs: Any
    ours: Any
    try:
        rqs = Job("a", connection=conn, serializer=JSONSerializer)
        rqs.restore(fields)
    except Exception as e:
        rqs = type(e)
    try:
        ours = BoundedJob.read("a", dict(fields), conn, JSONSerializer)
    except Exception as e:
        ours = type(e)
    return rqs, ours


def _read_before(fields: dict[bytes, bytes]) -> Any:
    """The job as the worker read it before `read` (the check, then RQ's restore), or the error's type."""
    job = BoundedJob("a", connection=_CONN, serializer=JSONSerializer)
    try:
        job.restore_read(dict(fields))
    except Exception as e:
        return type(e)
    return job


@settings(max_examples=400, deadline=None)
@given(_HASHES)
def test_a_plain_hash_is_read_as_rqs_restore_reads_it(fields: dict[bytes, bytes]) -> None:
    rqs, ours = _restored(fields)
    before = _read_before(fields)
    if isinstance(ours, type) or isinstance(before, type):  # refused, and for the same reason
        assert ours is before
        return
    assert not isinstance(rqs, type), f"RQ's restore raised {rqs}; the read gave a job"
    created = bool(fields.get(b"created_at"))
    assert _state(ours, created) == _state(rqs, created)
    assert _state(ours, created) == _state(before, created)
    assert ours.stored_fields == before.stored_fields
    assert ours._date_texts == before._date_texts
    assert ours._payload_read == before._payload_read


def test_a_hash_with_other_fields_is_read_by_rqs_restore() -> None:
    fields = {
        b"data": _DATA,
        b"origin": b"q",
        b"status": b"queued",
        b"dependency_id": b"other",
        b"webhooks": b"[]",
        b"enqueue_at_front": b"1",
    }
    rqs, ours = _restored(fields)
    assert _state(ours, False) == _state(rqs, False)
    assert ours._dependency_ids == ["other"]


def test_the_claims_parse_is_kept_where_it_is_rqs() -> None:
    """The job keeps the claim's parse of its payload (RQ would parse it again when asked for its
    function or arguments) only where the payload it restored is the one the claim parsed."""
    conn = _CONN
    for data in (_DATA, zlib.compress(_DATA)):
        fields = {b"data": data, b"origin": b"q", b"status": b"queued"}
        queued = parse_queued("a", data, b"q", "q")
        assert queued is not None and queued.parse is not None
        job = BoundedJob.read("a", fields, conn, JSONSerializer, queued.parse)
        assert job._args is queued.parse[1][2]  # taken, not parsed again
        rqs = Job("a", connection=conn, serializer=JSONSerializer)
        rqs.restore(fields)
        assert (job.func_name, job.instance, job.args, job.kwargs) == (
            rqs.func_name,
            rqs.instance,
            rqs.args,
            rqs.kwargs,
        )
    # A parse of other bytes (the hash changed between the look and the read) is not kept.
    other = json.dumps([keys.SCORE_FUNC, None, [{"rows": [1]}], {}]).encode()
    queued = parse_queued("a", other, b"q", "q")
    assert queued is not None and queued.parse is not None
    job = BoundedJob.read("a", {b"data": _DATA, b"origin": b"q"}, conn, JSONSerializer, queued.parse)
    assert job.args == [{"rows": []}]


def test_a_payload_that_is_not_utf8_is_not_claimed() -> None:
    """RQ's JSON serializer reads a payload as UTF-8: one in another encoding (which `json.loads` of
    bytes would take) is left in the queue for RQ's dequeue, which refuses it with a reason."""
    data = json.dumps([keys.SCORE_FUNC, None, [{"rows": []}], {}]).encode("utf-16")
    assert parse_queued("a", data, b"q", "q") is None
