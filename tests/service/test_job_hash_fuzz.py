"""Every field of an RQ job hash, and the key's type, drawn at random and written with plain Redis
commands as any producer could: the worker never quits; each job is run (here: refused, a bare worker
runs no kind) or put aside with a reason; the job queued behind them all is reached."""

from __future__ import annotations

import json
import uuid
import zlib
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import Queue
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.stream_writer import StreamOptions

REDIS_DB = 7
FIELDS = [
    "created_at",
    "enqueued_at",
    "started_at",
    "ended_at",
    "last_heartbeat",
    "origin",
    "description",
    "timeout",
    "result_ttl",
    "failure_ttl",
    "ttl",
    "status",
    "dependency_ids",
    "dependency_id",
    "allow_dependency_failures",
    "enqueue_at_front",
    "meta",
    "number_of_retries",
    "retries_left",
    "retry_intervals",
    "enqueue_at_front_on_retry",
    "repeats_left",
    "repeat_intervals",
    "worker_name",
    "group_id",
    "result",
    "exc_info",
    "webhooks",
    "rate_limit_key",
    "rate_limit_concurrency",
    "success_callback_name",
    "success_callback_timeout",
    "failure_callback_timeout",
    "data",
]
GOOD_DATA = json.dumps(["jobs.score", None, [{"rows": []}], {}])

values = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.sampled_from(
        [
            "",
            "-1",
            "0",
            "1e309",
            "nan",
            "queued",
            "started",
            "[]",
            "{}",
            "[1,",
            "null",
            "2026-01-01T12:00:00+00:00",
            "2026-01-01T12:00:00.000000Z",
            "Thu Jan 01 2026",
        ]
    ),
    st.just(zlib.compress(b'["jobs.score", null, [{"rows": []}], {}]')),
)
hashes = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6).map(
    lambda d: {"data": GOOD_DATA, "origin": "fuzz", "status": "queued", **d}
)
keys_of_other_types = st.sampled_from(["string", "list", "set", "zset", "stream", "missing"])


def _write(conn: redis.Redis, job_id: str, kind: str, fields: dict[str, Any]) -> None:
    key = keys.rq_job_key(job_id)
    if kind == "hash":
        conn.hset(key, mapping=fields)
    elif kind == "string":
        conn.set(key, "x")
    elif kind == "list":
        conn.rpush(key, "x")
    elif kind == "set":
        conn.sadd(key, "x")
    elif kind == "zset":
        conn.zadd(key, {"x": 1})
    elif kind == "stream":
        conn.xadd(key, {"x": "1"})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    jobs=st.lists(st.tuples(st.one_of(st.just("hash"), keys_of_other_types), hashes), min_size=1, max_size=8)
)
def test_no_job_hash_stops_the_worker(
    redis_conn: redis.Redis, jobs: list[tuple[str, dict[str, Any]]]
) -> None:
    redis_conn.flushdb()
    queue = Queue("fuzz", connection=redis_conn, serializer=JSONSerializer)
    ids = []
    for kind, fields in jobs:
        job_id = f"fuzz-{uuid.uuid4().hex}"
        _write(redis_conn, job_id, kind, fields)
        redis_conn.rpush(queue.key, job_id)
        ids.append(job_id)
    canary = queue.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    w = MlxqWorker([queue], connection=redis_conn, stream_options=StreamOptions())
    w.work(burst=True)
    assert w.fatal_error is None, repr(w.fatal_error)
    assert canary.get_status(refresh=True) == "failed"  # reached: refused, as a bare worker runs nothing
    assert redis_conn.llen(queue.key) == 0
    dead = {f[b"job_id"].decode() for _, f in redis_conn.xrange(keys.dead_letter_key("fuzz"))}
    for job_id in ids:  # each: put aside, or read and ended by RQ's own lifecycle, or gone
        if job_id in dead:
            continue
        status = (
            redis_conn.hget(keys.rq_job_key(job_id), "status")
            if redis_conn.type(keys.rq_job_key(job_id)) == b"hash"
            else None
        )
        assert status in (
            None,
            b"failed",
            b"finished",
            b"canceled",
            b"stopped",
            b"deferred",
            b"scheduled",
            b"started",
            b"queued",
        ), (job_id, status)
    w.clean_registries()  # RQ's maintenance over what is left: never quits either


@pytest.mark.parametrize("status", ["", "created"])
def test_a_queued_job_whose_status_says_it_never_started_is_run(redis_conn: redis.Redis, status: str) -> None:
    """A job in the queue whose status is empty or `created` (RQ reads both as created: never started)
    is run, not mistaken for one taken again and dropped (found by the fuzz test above)."""
    redis_conn.flushdb()
    queue = Queue("fuzz", connection=redis_conn, serializer=JSONSerializer)
    job_id = f"fuzz-{uuid.uuid4().hex}"
    _write(redis_conn, job_id, "hash", {"data": GOOD_DATA, "origin": "fuzz", "status": status})
    redis_conn.rpush(queue.key, job_id)
    w = MlxqWorker([queue], connection=redis_conn, stream_options=StreamOptions())
    w.work(burst=True)
    assert redis_conn.hget(keys.rq_job_key(job_id), "status") == b"failed"  # run: a bare worker refuses it
