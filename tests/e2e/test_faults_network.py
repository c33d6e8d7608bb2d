"""More faults on purpose: Redis unreachable, Redis restarted under bulk scoring, workers killed or
stopped in the middle of a score batch. Every job ends finished, failed with a reason, or still queued."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import CuttableProxy, PrivateRedis

from mlxq.jobs import keys
from mlxq.jobs.schema import TokenEvent
from mlxq.producer import Client

REDIS_DB = 1
NO_EOS = {0: -100.0, 2: -100.0}
FAST = {"MLXQ_HEARTBEAT_S": "1", "MLXQ_MAINTENANCE_INTERVAL_S": "2", "MLXQ_WORKER_TTL_S": "20"}
LONG = "Queues hold jobs; workers take jobs from queues and write results. " * 12

needs_server = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


@needs_server
def test_generation_survives_redis_being_unreachable(
    model_dir: Path, private_redis: PrivateRedis, spawn_worker: Any, reliability_report: dict[str, Any]
) -> None:
    proxy = CuttableProxy(private_redis.port)
    try:
        worker = spawn_worker(model_dir, proxy.url, MLXQ_STREAM_FLUSH_TOKENS="1")
        worker.wait_ready()
        with Client(proxy.url) as client:
            job = client.submit_generate(
                "The capital of France is", max_tokens=2500, temperature=0, logit_bias=NO_EOS
            )
            next(i for i in job.stream(timeout=30) if isinstance(i.event, TokenEvent))
            proxy.cut(3.0)
            result = job.result(timeout=120)
            tokens = [i.event for i in job.stream(timeout=30) if isinstance(i.event, TokenEvent)]
        assert result.finish_reason == "length" and result.usage.completion_tokens == 2500
        indexes = [t.index for t in tokens]
        assert indexes == sorted(set(indexes)), "a token event was written twice"
        assert "".join(t.text for t in tokens) == result.text
        assert worker.proc.poll() is None
        reliability_report.setdefault("faults", []).append("redis unreachable 3 s mid-generation")
    finally:
        proxy.close()


@needs_server
def test_bulk_scoring_survives_a_redis_restart(
    model_dir: Path,
    private_redis: PrivateRedis,
    tmp_path: Path,
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    """Redis (with its append-only file) restarts under a bulk run. A job whose dequeue Redis did but
    whose reply the restart lost sits in RQ's intermediate list until a worker's maintenance, a minute
    on, puts it back in its queue: fast maintenance here keeps that within the test's wait."""
    spawn_worker(model_dir, private_redis.url, **FAST).wait_ready()
    rows = [
        {"custom_id": f"r{i}", "prompt": f"{LONG[: 40 + i % 50]} {i}", "candidates": [" the", " a"]}
        for i in range(400)
    ]
    out = tmp_path / "out.jsonl"
    summary: list[Any] = []

    def run() -> None:  # the run's own error is the test's failure, not a stray thread's warning
        try:
            summary.append(client.score_dataset(rows, out, rows_per_job=4, in_flight=8))
        except Exception as e:
            summary.append(e)

    with Client(private_redis.url) as client:
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(1.0)
        private_redis.restart(down_s=1.0)
        thread.join(180)
    assert summary and not isinstance(summary[0], Exception), summary
    assert summary[0].succeeded == 400 and summary[0].failed == 0, summary
    ids = [line.split('"custom_id": "')[1].split('"')[0] for line in out.read_text().splitlines()]
    assert ids == [f"r{i}" for i in range(400)]
    reliability_report.setdefault("faults", []).append("redis restarted during bulk scoring")


def _long_score_jobs(client: Client, n: int, retry: int) -> list[Any]:
    rows = [{"prompt": f"{LONG}{i} {j}", "candidates": [" the", " a"]} for j in range(3) for i in range(1)]
    return [
        client.submit_score([{**r, "prompt": f"{r['prompt']} job {k}"} for r in rows], retry=retry)
        for k in range(n)
    ]


def _wait_started(conn: redis.Redis, jobs: list[Any], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(conn.hget(keys.rq_job_key(j.id), "status") == b"started" for j in jobs):
        assert time.monotonic() < deadline, "no job started"
        time.sleep(0.01)


def test_a_worker_killed_mid_score_batch_loses_no_job(
    model_dir: Path,
    redis_url: str,
    redis_conn: redis.Redis,
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    with Client(redis_url) as client:
        retried = _long_score_jobs(client, 6, retry=1)
        doomed = spawn_worker(model_dir, redis_url, name="doomed", **FAST)
        _wait_started(redis_conn, retried)
        doomed.signal(signal.SIGKILL)
        doomed.wait(10)
        spawn_worker(model_dir, redis_url, name="rescuer", **FAST)
        results = [j.result(timeout=120) for j in retried]
    assert all(len(r.rows) == 3 for r in results)
    reliability_report.setdefault("faults", []).append("worker SIGKILLed mid score batch")


def test_sigterm_during_a_score_batch_finishes_it_and_leaves_the_rest_queued(
    model_dir: Path, redis_url: str, redis_conn: redis.Redis, spawn_worker: Any
) -> None:
    with Client(redis_url) as client:
        jobs = _long_score_jobs(client, 40, retry=0)
        worker = spawn_worker(model_dir, redis_url, MLXQ_SCORE_BATCH_JOBS="8")
        _wait_started(redis_conn, jobs)
        worker.signal(signal.SIGTERM)
        assert worker.wait(60) == 0
        statuses = [client.job(j.id).status() for j in jobs]
    assert set(statuses) <= {"finished", "queued"}, statuses
    assert "finished" in statuses
    queued = redis_conn.lrange(keys.rq_queue_key("default"), 0, -1)
    assert len(queued) == statuses.count("queued")  # every unfinished job is still retrievable
