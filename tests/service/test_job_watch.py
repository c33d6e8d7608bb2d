"""The job watch's cancel polling: one MGET for every watched job, EXISTS where the user may not MGET."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job

from mlxq.jobs import keys
from mlxq.worker import job_watch
from mlxq.worker.job_runs import Run
from mlxq.worker.job_watch import JobWatch

REDIS_DB = 9


class _Worker:
    """What the watch needs of an RQ worker: its connection and heartbeats (none here)."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection

    def maintain_heartbeats(self, job: Job, execution: Any) -> None:
        pass


def _jobs(conn: redis.Redis, n: int) -> list[Run]:
    queue = Queue("watch", connection=conn)
    return [Run(Job.create(func=print, connection=conn), queue, None) for _ in range(n)]  # type: ignore[arg-type]


def _cancel_some(conn: redis.Redis, runs: list[Run]) -> set[str]:
    cancelled = {run.job.id for run in runs[1::3]}
    for job_id in cancelled:
        conn.set(keys.cancel_key(job_id), "1")
    return cancelled


def test_cancel_keys_of_all_watched_jobs_are_read_in_one_command(redis_conn: redis.Redis) -> None:
    runs = _jobs(redis_conn, 10)
    cancelled = _cancel_some(redis_conn, runs)
    before = redis_conn.info("commandstats")
    with JobWatch(_Worker(redis_conn), runs, beat_s=60, poll_s=60) as watch:  # polls once on entry
        assert watch.cancelled == cancelled
    after = redis_conn.info("commandstats")
    calls = {k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in ("cmdstat_mget",)}
    assert calls == {"cmdstat_mget": 1}
    assert after.get("cmdstat_exists", {"calls": 0}) == before.get("cmdstat_exists", {"calls": 0})


def test_a_user_without_mget_still_sees_every_cancel(
    redis_url: str, redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ACL written before the worker needed MGET: the watch falls back to EXISTS, and says so."""
    monkeypatch.setattr(job_watch, "_mget_refused", False)
    user, password = f"mlxq-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rights = {"keys": ["*"], "channels": ["*"], "commands": ["+@all", "-mget"]}
    redis_conn.acl_setuser(user, enabled=True, passwords=[f"+{password}"], **rights)
    conn = redis.Redis.from_url(redis_url, username=user, password=password)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            conn.mget(["x"])
        runs = _jobs(redis_conn, 7)
        cancelled = _cancel_some(redis_conn, runs)
        with JobWatch(_Worker(conn), runs[:4], beat_s=60, poll_s=60) as watch:
            watch.add(runs[4:])
            assert watch.cancelled == cancelled
        assert job_watch._mget_refused
    finally:
        conn.close()
        redis_conn.acl_deluser(user)
