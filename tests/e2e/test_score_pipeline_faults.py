"""A pipelined score worker stopped while it holds a batch taken ahead (claimed and started beside the
one it runs): killed (SIGKILL), every job still ends exactly once, recovered by another worker; asked
to stop (SIGTERM, a warm shutdown), it scores what it took, takes nothing more, and exits with no job
left started or claimed."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.producer import Client

REDIS_DB = 4
JOBS = 400
BATCH_JOBS = 8
FAST = {  # heartbeat TTL 1 * 3 + 5 = 8 s; maintenance every second
    "MLXQ_HEARTBEAT_S": "1",
    "MLXQ_MAINTENANCE_INTERVAL_S": "1",
    "MLXQ_WORKER_TTL_S": "20",
    "MLXQ_LOG_LEVEL": "WARNING",
    "MLXQ_WARM_UP": "0",
    "MLXQ_SCORE_BATCH_JOBS": str(BATCH_JOBS),
}

pytestmark = pytest.mark.slow


def _submit(client: Client, n: int, retry: int = 0) -> list[str]:
    rows = [{"prompt": "The house by the tree is", "candidates": [" the", " a"]}]
    return [client.submit_score(rows, retry=retry).id for _ in range(n)]


def _running(conn: redis.Redis, name: str) -> list[str]:
    """The jobs RQ records as being run by the worker `name` (its executions: `<job id>:<execution>`)."""
    return [e.decode().split(":")[0] for e in conn.smembers(f"rq:worker:{name}:executions")]


def _taken_ahead(conn: redis.Redis, name: str, timeout: float = 60.0) -> list[str]:
    """Once the worker runs more jobs than one batch holds (a batch taken ahead, started beside the one
    it scores), the jobs it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.scard(f"rq:worker:{name}:executions") > BATCH_JOBS:
            running = _running(conn, name)
            if len(running) > BATCH_JOBS:
                return running
        time.sleep(0.001)
    raise AssertionError("the worker never held a batch taken ahead")


def _statuses(conn: redis.Redis, ids: list[str]) -> list[str]:
    pipe = conn.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(keys.rq_job_key(job_id), "status")
    return [(s or b"").decode() for s in pipe.execute()]


def _events(conn: redis.Redis, job_id: str) -> list[str]:
    return [f[b"event"].decode() for _, f in conn.xrange(keys.stream_key(job_id))]


def _finished_once(conn: redis.Redis, job_id: str) -> None:
    """The job finished once: its result key, RQ's result and its stream's one `done` agree (a run
    the worker's death cut short is followed by a `restart` before the next)."""
    events = _events(conn, job_id)
    since_restart = 0
    for event in events:
        since_restart = 0 if event == "restart" else since_restart + (event in ("done", "error"))
        assert since_restart <= 1, (job_id, events)
    assert events[-1:] == ["done"], (job_id, events)
    stored = conn.get(keys.result_key(job_id))
    latest = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).latest_result()
    assert stored is not None and latest is not None and latest.type == Result.Type.SUCCESSFUL, job_id
    assert latest.return_value == json.loads(stored), job_id


def _no_job_held(conn: redis.Redis) -> None:
    q = Queue("default", connection=conn)
    assert q.started_job_registry.count == 0
    assert conn.llen(q.intermediate_queue_key) == 0


def test_a_worker_killed_with_a_batch_taken_ahead_loses_no_job(
    tmp_path: Path, model_dir: Path, redis_url: str, redis_conn: redis.Redis, spawn_worker: Any
) -> None:
    with Client(redis_url) as client:
        ids = _submit(client, JOBS, retry=2)
    victim = spawn_worker(model_dir, redis_url, "--name", "victim", name="victim", **FAST)
    running = _taken_ahead(redis_conn, "victim")
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    assert len(running) > BATCH_JOBS  # two batches held at once: one scored, one taken ahead
    at_kill = _statuses(redis_conn, running)
    assert set(at_kill) <= {"started", "finished"} and "started" in at_kill  # left to be recovered

    spawn_worker(model_dir, redis_url, "--name", "rescuer", name="rescuer", **FAST)
    deadline = time.monotonic() + 150  # a heartbeat TTL, or RQ's minute for a job caught mid-claim
    while True:
        statuses = _statuses(redis_conn, ids)
        if all(s in ("finished", "failed") for s in statuses):
            break
        left = {s: statuses.count(s) for s in set(statuses)}
        assert time.monotonic() < deadline, f"jobs not ended after the kill: {left}"
        time.sleep(0.5)
    assert statuses == ["finished"] * JOBS, {s: statuses.count(s) for s in set(statuses)}
    for job_id in ids:
        _finished_once(redis_conn, job_id)
    _no_job_held(redis_conn)
    assert Queue("default", connection=redis_conn).count == 0


def test_a_warm_shutdown_scores_the_batch_taken_ahead_and_takes_no_more(
    tmp_path: Path, model_dir: Path, redis_url: str, redis_conn: redis.Redis, spawn_worker: Any
) -> None:
    with Client(redis_url) as client:
        ids = _submit(client, JOBS)
    worker = spawn_worker(model_dir, redis_url, "--name", "stopping", name="stopping", **FAST)
    running = _taken_ahead(redis_conn, "stopping")
    # One command, right before the signal: a batch of the tiny model takes a few milliseconds.
    finished = Queue("default", connection=redis_conn).finished_job_registry.key
    already = {j.decode() for j in redis_conn.zrange(finished, 0, -1)}
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.log()

    statuses = dict(zip(ids, _statuses(redis_conn, ids), strict=True))
    assert set(statuses.values()) <= {"finished", "queued"}, set(statuses.values())
    assert all(statuses[job_id] == "finished" for job_id in running)  # what it held, it scored
    done = [job_id for job_id in ids if statuses[job_id] == "finished"]
    for job_id in done:
        _finished_once(redis_conn, job_id)
    # Beside those it held, at most one batch taken before the stop came in: then it took no more.
    assert len(set(done) - already - set(running)) <= BATCH_JOBS, (len(done), len(already), len(running))
    assert all(_events(redis_conn, j) == [] for j in ids if statuses[j] == "queued")
    _no_job_held(redis_conn)
    assert Queue("default", connection=redis_conn).count == JOBS - len(done)

    # The jobs it left queued are run by the next worker, each once.
    _next_worker_runs_each_once(model_dir, redis_url, redis_conn, spawn_worker, ids)


def test_a_cold_stop_puts_the_batch_taken_ahead_back_untouched(
    tmp_path: Path, model_dir: Path, redis_url: str, redis_conn: redis.Redis, spawn_worker: Any
) -> None:
    """Two stop signals at once (a cold stop: the second asks running jobs to end now) while the worker
    holds a batch taken ahead: what it was scoring ends, the batch taken ahead never runs and goes back
    to the head of the queue untouched (its job hashes as submitted, no event, no result, no attempt),
    nothing fails, nothing is left started or claimed; the next worker runs every job once."""
    with Client(redis_url) as client:  # more than the other tests: the queue must outlast a slow moment
        ids = _submit(client, 3 * JOBS)
    as_submitted = {job_id: redis_conn.hgetall(keys.rq_job_key(job_id)) for job_id in ids}
    worker = spawn_worker(model_dir, redis_url, "--name", "cold", name="cold", **FAST)
    finished = Queue("default", connection=redis_conn).finished_job_registry
    deadline = time.monotonic() + 60
    while finished.count < 2 * BATCH_JOBS:  # past its first batches: batch after batch taken ahead
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.001)
    # Paused (SIGSTOP) while it holds a batch taken ahead: seen again once paused, as the moment between
    # the look and the pause may fall between batches (on a busy machine, more than a batch's time).
    while True:
        _taken_ahead(redis_conn, "cold")
        worker.signal(signal.SIGSTOP)
        running = _running(redis_conn, "cold")
        if len(running) > BATCH_JOBS:
            break
        worker.signal(signal.SIGCONT)
        assert time.monotonic() < deadline + 60, worker.log()
    # Both signals pending at once (the process paused while they are sent), so the worker handles
    # them together wherever its loop is; two signal numbers, as two of one kind would count as one.
    worker.signal(signal.SIGTERM)
    worker.signal(signal.SIGINT)
    worker.signal(signal.SIGCONT)
    assert worker.wait(60) == 0, worker.log()
    put_back = re.search(r"requeued jobs started but never run jobs=(\d+) first=(\S+)", worker.log())
    assert put_back is not None, (worker.log(), _statuses(redis_conn, running))

    statuses = dict(zip(ids, _statuses(redis_conn, ids), strict=True))
    assert set(statuses.values()) <= {"finished", "queued"}, set(statuses.values())
    queued = [job_id for job_id in ids if statuses[job_id] == "queued"]
    # Claims take the queue's head in order and the batch taken ahead went back to the head in order:
    # what finished is the first jobs submitted, the queue the rest in submission order.
    assert [j for j in ids if statuses[j] == "finished"] == ids[: len(ids) - len(queued)]
    waiting = [j.decode() for j in redis_conn.lrange(Queue("default", connection=redis_conn).key, 0, -1)]
    assert waiting == queued and waiting[0] == put_back.group(2)
    assert 0 < int(put_back.group(1)) <= BATCH_JOBS and len(running) > BATCH_JOBS
    for job_id in queued:  # put back or never taken: as the producer left it
        assert redis_conn.hgetall(keys.rq_job_key(job_id)) == as_submitted[job_id], job_id
        assert _events(redis_conn, job_id) == [] and not redis_conn.exists(keys.result_key(job_id))
    for job_id in ids:
        if statuses[job_id] == "finished":
            _finished_once(redis_conn, job_id)
    _no_job_held(redis_conn)
    assert Queue("default", connection=redis_conn).failed_job_registry.count == 0

    _next_worker_runs_each_once(model_dir, redis_url, redis_conn, spawn_worker, ids)


def _next_worker_runs_each_once(
    model_dir: Path, redis_url: str, redis_conn: redis.Redis, spawn_worker: Any, ids: list[str]
) -> None:
    """A fresh burst worker runs every job left queued: then each job finished exactly once, none held."""
    after = spawn_worker(model_dir, redis_url, "--burst", "--name", "after", name="after", **FAST)
    assert after.wait(120) == 0, after.log()
    assert _statuses(redis_conn, ids) == ["finished"] * len(ids)
    for job_id in ids:
        _finished_once(redis_conn, job_id)
    _no_job_held(redis_conn)
