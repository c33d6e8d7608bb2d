"""The non-Python recipe of docs/plain-redis.md, run as written: raw Redis commands on the producing
side (no rq, no mlxq), then RQ and a raw XREAD/GET on the reading side."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from conftest import WorkerSide, generate_result
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

REDIS_DB = 13

DOC = Path(__file__).resolve().parents[2] / "docs" / "plain-redis.md"
DOC_JOB_ID = "0c9f4b1e5a7d4e2f8b3a6c1d9e0f2a4b"


def doc_blocks() -> list[list[str]]:
    """The ```redis blocks of the doc, each as its command lines."""
    blocks = re.findall(r"```redis\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    return [[line for line in block.splitlines() if line.strip()] for block in blocks]


def run_as_redis_cli(redis_url: str, lines: list[str]) -> list[object]:
    """Each line as redis-cli would send it (its quoting is shell-like), on one connection."""
    conn = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        return [conn.execute_command(*shlex.split(line)) for line in lines]
    finally:
        conn.close()


@pytest.fixture
def enqueued(redis_url: str) -> str:
    """The doc's job, enqueued with the doc's own commands."""
    replies = run_as_redis_cli(redis_url, doc_blocks()[0])
    assert replies[-1] == [6, 1, 1]  # EXEC: 6 fields set, queue length 1, queue registered
    return DOC_JOB_ID


def test_rq_reads_the_plain_job_back_as_a_jobs_generate_job(enqueued: str, redis_conn: redis.Redis) -> None:
    job = Job.fetch(enqueued, connection=redis_conn, serializer=JSONSerializer)
    payload = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    assert (job.func_name, job.args, job.kwargs) == ("jobs.generate", [payload], {})
    assert (job.origin, job.get_status(), job.timeout) == ("default", JobStatus.QUEUED, 600)
    assert job.enqueued_at is not None and job.enqueued_at.year == 2026
    queue = Queue("default", connection=redis_conn, serializer=JSONSerializer)
    assert queue.job_ids == [enqueued]
    assert [q.name for q in Queue.all(connection=redis_conn)] == ["default"]
    taken = Queue.dequeue_any([queue], timeout=None, connection=redis_conn, serializer=JSONSerializer)
    assert taken is not None and taken[0].id == enqueued and taken[0].args == [payload]


def test_the_job_function_accepts_the_plain_payload(
    enqueued: str, redis_conn: redis.Redis, run_rq_worker: Callable[..., None]
) -> None:
    run_rq_worker()
    job = Job.fetch(enqueued, connection=redis_conn, serializer=JSONSerializer)
    result = job.latest_result()
    # jobs.generate validated the request, then raised NotInWorker: a plain RQ worker ran its body.
    assert result is not None and result.exc_string is not None
    assert result.exc_string.strip().splitlines()[-1].startswith("jobs.errors.NotInWorker")


def test_stream_status_result_and_cancel_with_raw_commands(
    enqueued: str, redis_url: str, redis_conn: redis.Redis, worker_side: WorkerSide
) -> None:
    worker_side.start(enqueued)
    worker_side.tokens(enqueued, "Par", "is")
    worker_side.done(enqueued, generate_result(" Paris"))
    _, xread, status, get, cancel = doc_blocks()

    events: list[dict[str, str]] = []
    last = "0-0"
    while not events or events[-1]["event"] not in ("done", "error"):
        reply = redis_conn.xread({f"mlxq:stream:{enqueued}": last}, block=1000)
        assert reply, "the stream ended without a terminal event"
        for entry_id, fields in reply[0][1]:
            last = entry_id.decode()
            events.append({k.decode(): v.decode() for k, v in fields.items()})
    assert [e["event"] for e in events] == ["token", "token", "done"]
    assert "".join(e.get("text", "") for e in events) == "Paris"
    assert json.loads(events[0]["ids"]) == [100] and events[-1]["finish_reason"] == "stop"

    (first_read,) = run_as_redis_cli(redis_url, xread)
    assert len(first_read[0][1]) == 3  # type: ignore[index]
    assert run_as_redis_cli(redis_url, status) == [b"started"]
    (raw_result,) = run_as_redis_cli(redis_url, get)
    assert json.loads(raw_result)["text"] == " Paris"  # type: ignore[arg-type]
    assert run_as_redis_cli(redis_url, cancel) == [True]
    assert redis_conn.ttl(f"mlxq:cancel:{enqueued}") > 3500


def test_the_recipe_is_the_core_of_what_the_python_clients_write() -> None:
    from mlxq.producer import rq_wire  # the reference; imported here only, never on the producing side

    hset = shlex.split(doc_blocks()[0][1])
    fields = dict(zip(hset[2::2], hset[3::2], strict=True))
    func_name, instance, args, kwargs = json.loads(fields["data"])
    options = rq_wire.JobOptions(job_timeout=600)
    wire = rq_wire.build_job(func_name, args[0], queue="default", options=options)
    assert set(fields) <= set(wire.fields)
    plain = rq_wire.job_data(func_name, args[0], compress=False)
    assert json.loads(plain) == [func_name, instance, args, kwargs]
    for name in ("origin", "status", "timeout"):
        assert wire.fields[name] == fields[name]
