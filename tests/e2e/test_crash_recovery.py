"""Crash test: three workers over mixed generation and score jobs, killed (SIGKILL) at random times (a
third of the kills aimed at a worker running jobs, a third at one inside registry maintenance), each
restarted at once under a new name. Every job ends exactly once: finished (its result key, RQ's result
and its stream's one `done` agree), or failed with a reason (its stream ends with `error`, no result),
a retried run announced by `restart`; no job is left `started` by a dead worker a minute after the
last kill; a maintenance lease left by a killed worker lapses within its TTL.

`MLXQ_CRASH_KILLS` sets the number of kills (default 30).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.producer import Client
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

REDIS_DB = 13
KILLS = int(os.environ.get("MLXQ_CRASH_KILLS", "30"))
WORKERS = 3
WAVE = 30  # jobs submitted before each kill
# Heartbeat TTL and maintenance lease 1 * 3 + 5 = 8 s; maintenance every second, so kills land in it.
FAST = {
    "MLXQ_HEARTBEAT_S": "1",
    "MLXQ_MAINTENANCE_INTERVAL_S": "1",
    "MLXQ_WORKER_TTL_S": "20",
    "MLXQ_LOG_LEVEL": "WARNING",
}
LEASE_S = 8
LOCK = "rq:clean_registries:default"
NO_EOS = {0: -100.0, 2: -100.0}  # the tiny tokenizer's end tokens: generations run their full length

pytestmark = pytest.mark.slow


def _submit(client: Client, rng: random.Random, i: int) -> tuple[str, str]:
    retry = rng.choice([0, 0, 1, 2])
    if rng.random() < 0.6:
        job = client.submit_generate(
            f"Job {i} says", max_tokens=rng.randint(1, 96), temperature=0, logit_bias=NO_EOS, retry=retry
        )
        return job.id, "generate"
    rows = [
        {"prompt": f"Row {j} of job {i} is", "candidates": [" a", " b"]} for j in range(rng.randint(1, 3))
    ]
    return client.submit_score(rows, retry=retry).id, "score"


def _holder(conn: redis.Redis) -> str | None:
    """The worker holding the maintenance lease of the queue, by name (its token is `<name>:<random>`)."""
    token = conn.get(LOCK)
    return token.decode().rsplit(":", 1)[0] if token else None


def _state(conn: redis.Redis, name: str) -> str:
    return (conn.hget(f"rq:worker:{name}", "state") or b"").decode()


def _running(conn: redis.Redis, name: str) -> list[str]:
    """The jobs RQ records as being run by the worker `name` (its executions: `<job id>:<execution>`)."""
    return [e.decode().split(":")[0] for e in conn.smembers(f"rq:worker:{name}:executions")]


class Recoveries:
    """Watches, from a thread of its own, the jobs a killed worker was running until each leaves
    `started` under that worker (ended finished or failed, or queued again for a retry): the delays."""

    def __init__(self, redis_url: str) -> None:
        self.conn = redis.Redis.from_url(redis_url)
        self.pending: list[tuple[str, str, float]] = []  # job id, dead worker, when it was killed
        self.delays: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def killed(self, job_ids: list[str], worker: str, at: float) -> None:
        with self._lock:
            self.pending.extend((job_id, worker, at) for job_id in job_ids)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                pending = list(self.pending)
            if not pending:
                continue
            states = _statuses(self.conn, [job_id for job_id, _, _ in pending])
            now = time.monotonic()
            with self._lock:
                for entry, (status, worker) in zip(pending, states, strict=True):
                    if status != "started" or worker != entry[1]:
                        self.pending.remove(entry)
                        self.delays.append(now - entry[2])

    def wait(self, timeout: float) -> list[tuple[str, str, float]]:
        """Until every watched job recovered or `timeout` passed; the jobs left."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.1)
        self._stop.set()
        self._thread.join()
        self.conn.close()
        return self.pending


def _statuses(conn: redis.Redis, ids: list[str]) -> list[tuple[str, str]]:
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(keys.rq_job_key(job_id), ["status", "worker_name"])
        return [((s or b"").decode(), (w or b"").decode()) for s, w in pipe.execute()]


def _check_job(conn: redis.Redis, job_id: str, kind: str) -> tuple[str, bool]:
    """One job's records agree; returns its status and whether a run of it was restarted."""
    entries = [
        {k.decode(): v.decode() for k, v in f.items()} for _, f in conn.xrange(keys.stream_key(job_id))
    ]
    events = [e["event"] for e in entries]
    since_restart = 0
    for event in events:  # never two ends of one run: a second one only after a `restart`
        since_restart = 0 if event == "restart" else since_restart + (event in ("done", "error"))
        assert since_restart <= 1, (job_id, events)
    status = conn.hget(keys.rq_job_key(job_id), "status")
    stored = conn.get(keys.result_key(job_id))
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    latest = job.latest_result()
    assert latest is not None, (job_id, status, events)
    if status == b"finished":
        assert stored is not None and events[-1:] == ["done"], (job_id, events)
        assert latest.type == Result.Type.SUCCESSFUL and latest.return_value == json.loads(stored)
        if kind == "generate":  # the last run's text, as streamed, is the result's
            last_run = (
                entries[len(events) - 1 - events[::-1].index("restart") :] if "restart" in events else entries
            )
            text = "".join(e["text"] for e in last_run if e["event"] == "token")
            assert text == json.loads(stored)["text"], (job_id, events)
    else:
        assert status == b"failed", (job_id, status, events)
        assert stored is None and "done" not in events and events[-1:] == ["error"], (job_id, events)
        assert latest.type == Result.Type.FAILED and latest.exc_string, job_id
    return status.decode(), "restart" in events


def test_thirty_kills_every_job_ends_exactly_once(
    tmp_path: Path,
    redis_url: str,
    redis_conn: redis.Redis,
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    model = write_random_checkpoint(tmp_path / "tiny", {"max_position_embeddings": 256})
    rng = random.Random(27)
    serial = iter(range(10_000))

    def spawn(slot: int) -> Any:
        name = f"w{slot}-{next(serial)}"  # a new name per process: a dead one's jobs stay recognisable
        return name, spawn_worker(model, redis_url, "--name", name, name=name, **FAST)

    workers = [spawn(slot) for slot in range(WORKERS)]
    dead: set[str] = set()
    jobs: dict[str, str] = {}
    in_maintenance = 0
    last_kill = time.monotonic()
    recoveries = Recoveries(redis_url)
    lease_lapsed_s: list[float] = []
    t0 = time.monotonic()
    with Client(redis_url) as client:
        for _ in range(3 * WAVE):
            job_id, kind = _submit(client, rng, len(jobs))
            jobs[job_id] = kind
        for k in range(KILLS):
            for _ in range(WAVE):
                job_id, kind = _submit(client, rng, len(jobs))
                jobs[job_id] = kind
            time.sleep(rng.uniform(0.5, 3.0))
            slot = rng.randrange(WORKERS)
            if k % 3 == 1 or k == KILLS - 1:  # aimed at a worker running jobs, where there is one
                busy = [i for i, (name, _) in enumerate(workers) if _state(redis_conn, name) == "busy"]
                slot = rng.choice(busy) if busy else slot
            if k % 3 == 2:  # aimed at maintenance: the next worker seen holding the lease
                names = {name: i for i, (name, _) in enumerate(workers)}
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    holder = _holder(redis_conn)
                    if holder in names:
                        slot = names[holder]
                        break
            name, victim = workers[slot]
            running = _running(redis_conn, name)
            victim.signal(signal.SIGKILL)
            killed_at = last_kill = time.monotonic()
            victim.wait(10)
            dead.add(name)
            recoveries.killed(running, name, killed_at)
            if _holder(redis_conn) == name:  # killed inside maintenance, its lease left behind
                in_maintenance += 1
                while _holder(redis_conn) == name:
                    assert time.monotonic() - killed_at < LEASE_S + 2, (
                        "a dead worker's lease outlived its TTL"
                    )
                    time.sleep(0.05)
                lease_lapsed_s.append(time.monotonic() - killed_at)
            workers[slot] = spawn(slot)
    kill_phase_s = last_kill - t0
    assert not recoveries.wait(60 - (time.monotonic() - last_kill)), "jobs of killed workers not recovered"
    assert max(recoveries.delays, default=0) < 60, "a killed worker's job recovered after more than a minute"

    ids = list(jobs)
    abandoned_left_s = None
    while True:  # until no job is left `started` by a dead worker
        left = [
            j
            for j, (s, w) in zip(ids, _statuses(redis_conn, ids), strict=True)
            if s == "started" and w in dead
        ]
        if not left:
            abandoned_left_s = time.monotonic() - last_kill
            break
        assert time.monotonic() - last_kill < 60, (
            f"{len(left)} jobs still started by dead workers: {left[:5]}"
        )
        time.sleep(0.2)
    while True:  # every job ends (a job whose dequeue was lost to a kill waits out RQ's minute)
        statuses = [s for s, _ in _statuses(redis_conn, ids)]
        if all(s in ("finished", "failed") for s in statuses):
            break
        waiting = {s: statuses.count(s) for s in set(statuses)}
        assert time.monotonic() - last_kill < 180, f"jobs not ended: {waiting}"
        time.sleep(0.5)
    all_ended_s = time.monotonic() - last_kill

    ends = [_check_job(redis_conn, job_id, kind) for job_id, kind in jobs.items()]
    assert redis_conn.llen(keys.rq_queue_key("default")) == 0
    assert redis_conn.zcard("rq:wip:default") == 0
    assert redis_conn.llen("rq:queue:default:intermediate") == 0
    assert len(lease_lapsed_s) == in_maintenance and all(s <= LEASE_S + 1 for s in lease_lapsed_s)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    ended_by_recovery = logs.count("abandoned job had finished")
    finished = sum(status == "finished" for status, _ in ends)
    reliability_report["crash_recovery"] = {
        "jobs": len(jobs),
        "generate": sum(kind == "generate" for kind in jobs.values()),
        "kills": KILLS,
        "kills_inside_maintenance": in_maintenance,
        "jobs_running_in_killed_workers": len(recoveries.delays),
        "recovered_after_kill_s_median_max": [
            round(statistics.median(recoveries.delays or [0]), 1),
            round(max(recoveries.delays or [0]), 1),
        ],
        "lease_lapsed_after_kill_s": [round(s, 1) for s in lease_lapsed_s],
        "kill_phase_s": round(kill_phase_s, 1),
        "abandoned_recovered_after_last_kill_s": round(abandoned_left_s, 1),
        "all_ended_after_last_kill_s": round(all_ended_s, 1),
        "finished": finished,
        "failed": len(ends) - finished,
        "restarted": sum(restarted for _, restarted in ends),
        "finished_by_recovery": ended_by_recovery,
        "requeued_taken_never_started": logs.count("requeued a job taken but never started"),
    }
    print(reliability_report["crash_recovery"])
