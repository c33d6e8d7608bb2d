"""Jobs RQ cannot read (a malformed field of the job hash, a key of another type), written with plain
Redis commands as any producer could: each is put aside with a reason naming the field, its stream ends
with an `error`, and the worker goes on to the job behind it. A worker whose RQ loop quits on an error
exits non-zero."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer
from worker_process import WorkerProcess

from mlxq.jobs import keys
from mlxq.producer import Client, JobFailed
from mlxq.worker.engine import Engine
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.service import WorkerService
from mlxq.worker.settings import WorkerSettings
from mlxq.worker.stream_writer import StreamOptions

REDIS_DB = 8
DATA = json.dumps(["jobs.generate", None, [{"prompt": "hi", "max_tokens": 2}], {}])
GOOD = {"data": DATA, "origin": "default", "status": "queued", "created_at": "2026-01-01T12:00:00.000000Z"}
# Each: how the job is written, and what its dead-letter reason must name.
BAD: dict[str, tuple[dict[str, str] | None, str]] = {
    "iso-created-at": ({**GOOD, "created_at": "2026-01-01T12:00:00+00:00"}, "field 'created_at'"),
    "js-created-at": ({**GOOD, "created_at": "Thu Jan 01 2026 12:00:00 GMT+0000"}, "field 'created_at'"),
    "bad-status": ({**GOOD, "status": "waiting"}, "field 'status'"),
    "bad-timeout": ({**GOOD, "timeout": "soon"}, "field 'timeout'"),
    "bad-retries": ({**GOOD, "retries_left": "many"}, "field 'retries_left'"),
    "bad-intervals": ({**GOOD, "retry_intervals": "[1,"}, "field 'retry_intervals'"),
    "bad-deps": ({**GOOD, "dependency_ids": "{"}, "field 'dependency_ids'"),
    "a-string-key": (None, "is a Redis string, not a hash"),
}


def _eventually(check: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not met in {timeout}s"
        time.sleep(0.05)


def _write_bad(conn: redis.Redis, job_id: str, fields: dict[str, str] | None, queue: str = "default") -> None:
    if fields is None:
        conn.set(keys.rq_job_key(job_id), "x")
    else:
        conn.hset(keys.rq_job_key(job_id), mapping=fields)  # type: ignore[arg-type]


def _dead(conn: redis.Redis, queue: str = "default") -> dict[str, str]:
    return {f[b"job_id"].decode(): f[b"reason"].decode() for _, f in conn.xrange(keys.dead_letter_key(queue))}


def test_unreadable_jobs_are_put_aside_with_a_reason_and_the_job_behind_them_runs(
    worker: WorkerProcess, redis_conn: redis.Redis, redis_url: str
) -> None:
    for job_id, (fields, _) in BAD.items():
        _write_bad(redis_conn, job_id, fields)
        redis_conn.rpush(keys.rq_queue_key("default"), job_id)
    with Client(redis_url) as client:
        canary = client.submit_generate("The capital of France is", max_tokens=3, temperature=0)
        assert canary.result(timeout=60).finish_reason in ("stop", "length")
        # A producer waiting on one learns why at once, from its stream.
        with pytest.raises(JobFailed, match="UnreadableJob: field 'created_at'"):
            client.job("iso-created-at").result(timeout=30)
    _eventually(lambda: len(_dead(redis_conn)) == len(BAD), what="every bad job put aside")
    dead = _dead(redis_conn)
    for job_id, (_, named) in BAD.items():
        assert named in dead[job_id], (job_id, dead[job_id])
        events = [f[b"event"].decode() for _, f in redis_conn.xrange(keys.stream_key(job_id))]
        assert events == ["error"]
        (_, last), *_ = redis_conn.xrevrange(keys.stream_key(job_id), count=1)
        assert named in last[b"message"].decode()
    assert worker.proc.poll() is None  # the worker lives
    queue = Queue("default", connection=redis_conn, serializer=JSONSerializer)
    assert redis_conn.llen(queue.intermediate_queue_key) == 0
    assert redis_conn.hget(keys.rq_job_key("bad-status"), "status") == b"waiting"  # nothing rewritten
    log = worker.log()
    assert "found an unhandled exception" not in log
    assert log.count("unreadable job put aside") == len(BAD)


def test_maintenance_puts_aside_an_unreadable_job_left_in_the_intermediate_list(
    redis_conn: redis.Redis,
) -> None:
    """A worker killed between RQ's BLMOVE and putting the job aside leaves its id in the intermediate
    list: the next worker's maintenance puts it aside instead of dying there, and gives the
    maintenance lock back."""
    queue = Queue("default", connection=redis_conn, serializer=JSONSerializer)
    _write_bad(redis_conn, "left-behind", BAD["iso-created-at"][0])
    redis_conn.rpush(queue.intermediate_queue_key, "left-behind")
    w = MlxqWorker([queue], connection=redis_conn, stream_options=StreamOptions())
    w.clean_registries()
    assert "field 'created_at'" in _dead(redis_conn)["left-behind"]
    assert redis_conn.llen(queue.intermediate_queue_key) == 0
    assert not redis_conn.exists(f"rq:clean_registries:{queue.name}")  # the lock is given back
    assert w.last_cleaned_at is not None


def test_a_worker_whose_loop_quits_on_an_error_exits_non_zero(model_dir: Path, redis_url: str) -> None:
    settings = WorkerSettings(model=str(model_dir), redis_url=redis_url, queues=["default"], _env_file=None)  # type: ignore[call-arg]
    service = WorkerService.start(settings, engine=Engine.load(str(model_dir)))

    class Broken:
        def run(self, first: Any, queue: Queue) -> None:
            raise RuntimeError("a bug in a job component")

    service.worker.runners[keys.GENERATE_FUNC] = Broken()
    with Client(redis_url) as client:
        client.submit_generate("hi", max_tokens=2)
    assert service.work(burst=True) == 1
    assert isinstance(service.worker.fatal_error, RuntimeError)
