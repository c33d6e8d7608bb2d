"""Faults on purpose: workers killed mid-job, a job's dequeue lost. Every job ends finished, failed with
a reason, or retried."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from rq.intermediate_queue import IntermediateQueue

from mlxq.jobs import keys
from mlxq.jobs.schema import RestartEvent, TokenEvent
from mlxq.producer import Client, JobFailed

REDIS_DB = 6
NO_EOS = {0: -100.0, 2: -100.0}  # the tiny tokenizer's <|endoftext|> and <|im_end|>
# Fast failure detection for tests: heartbeat TTL 1*3+5 = 8 s, maintenance every 2 s, idle wake-ups 5 s.
FAST = {"MLXQ_HEARTBEAT_S": "1", "MLXQ_MAINTENANCE_INTERVAL_S": "2", "MLXQ_WORKER_TTL_S": "20"}


def _kill_mid_generation(spawn: Any, model_dir: Path, redis_url: str, client: Client, retry: int) -> Any:
    doomed = spawn(model_dir, redis_url, name="doomed", **FAST)
    doomed.wait_ready()
    job = client.submit_generate(
        "The capital of France is", max_tokens=1500, temperature=0, logit_bias=NO_EOS, retry=retry
    )
    next(i for i in job.stream(timeout=30) if isinstance(i.event, TokenEvent))
    doomed.signal(signal.SIGKILL)
    doomed.wait(10)
    return job


def test_a_killed_workers_job_is_retried_and_its_stream_says_restart(
    model_dir: Path, redis_url: str, client: Client, spawn_worker: Any
) -> None:
    job = _kill_mid_generation(spawn_worker, model_dir, redis_url, client, retry=1)
    t0 = time.monotonic()
    spawn_worker(model_dir, redis_url, name="rescuer", **FAST)
    result = job.result(timeout=90)
    assert time.monotonic() - t0 < 60, "the abandoned job was noticed too late"
    events = [i.event for i in job.stream(timeout=10)]
    kinds = [type(e).__name__ for e in events]
    restart = kinds.index("RestartEvent")
    assert isinstance(events[restart], RestartEvent) and events[restart].attempt == 2
    after = [e for e in events[restart:] if isinstance(e, TokenEvent)]
    assert "".join(t.text for t in after) == result.text  # a tailer that drops earlier text is right
    assert result.finish_reason == "length" and result.usage.completion_tokens == 1500
    # The first attempt's prompt was in no cache of the rescuer: it recomputed it.
    assert result.usage.cached_tokens == 0


def test_a_killed_workers_job_without_retries_fails_with_a_reason(
    model_dir: Path, redis_url: str, client: Client, spawn_worker: Any
) -> None:
    job = _kill_mid_generation(spawn_worker, model_dir, redis_url, client, retry=0)
    spawn_worker(model_dir, redis_url, name="rescuer", **FAST)
    with pytest.raises(JobFailed, match="AbandonedJobError"):
        job.result(timeout=90)
    deadline = time.monotonic() + 10  # RQ's record of the failure follows the stream's `error` event
    while job.status() != "failed" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.status() == "failed"


def test_a_poison_job_fails_after_its_retries_and_the_worker_lives(
    model_dir: Path, redis_url: str, client: Client, spawn_worker: Any
) -> None:
    # Too long for the context: every attempt fails the same way, bounded by the retry count.
    poison = client.submit_generate("word " * 5000, max_tokens=2, retry=2)
    good = client.submit_generate("hello", max_tokens=2, temperature=0, logit_bias=NO_EOS)
    worker = spawn_worker(model_dir, redis_url, "--burst", **FAST)
    assert worker.wait(60) == 0
    with pytest.raises(JobFailed, match="context length is 4096"):
        poison.result(timeout=10)
    assert good.result(timeout=10).usage.completion_tokens == 2
    assert worker.log().count("ContextTooLong") >= 3  # first try + 2 retries


def test_a_job_whose_dequeue_was_lost_runs_after_the_next_maintenance(
    model_dir: Path, redis_url: str, client: Client, spawn_worker: Any
) -> None:
    """Redis moved the job to RQ's intermediate list for a worker that never got the reply (Redis
    restarting). A minute later a worker's maintenance finds it there, never started: it goes back to
    its queue and runs, where RQ would fail it ("stuck in intermediate queue")."""
    conn = client.connection
    job = client.submit_generate("hello", max_tokens=3, temperature=0, logit_bias=NO_EOS)
    intermediate = IntermediateQueue(keys.rq_queue_key(client.queue), connection=conn)
    assert conn.lmove(intermediate.queue_key, intermediate.key, "LEFT", "RIGHT") == job.id.encode()
    conn.set(intermediate.get_first_seen_key(job.id), time.time() - 120)  # a minute ago
    worker = spawn_worker(model_dir, redis_url, name="rescuer", **FAST)
    assert job.result(timeout=60).usage.completion_tokens == 3
    deadline = time.monotonic() + 10  # RQ's end of the job follows its `done` event
    while job.status() != "finished" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.status() == "finished"
    assert "requeued a job taken but never started" in worker.log()
