"""Writes confirmed by replicas (`jobs.replication`, WAIT behind a mark key): a producer's submit is
refused when no replica confirms it in time; a worker's write goes on, said in its log (a replica
outage must not fail jobs). Run against a Redis without replicas, where WAIT always falls short."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_server import PrivateRedis

from mlxq.jobs import keys
from mlxq.jobs.replication import (
    NotReplicated,
    Replicas,
    confirm_replicated,
    default_replica_acks,
    online_replicas,
)
from mlxq.producer import Client, ProducerSettings
from mlxq.worker.stream_writer import StreamOptions, retrying


def test_nothing_is_waited_for_off_sentinel(redis_conn: redis.Redis) -> None:
    assert default_replica_acks(redis_conn) == 0
    confirm_replicated(redis_conn, 0, 10)  # no WAIT at all
    assert not redis_conn.exists(keys.REPLICATION_MARK)


def test_a_submit_no_replica_confirms_stands_with_a_warning(
    redis_url: str, redis_conn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Each try waits for the replica again; when the tries end short, the job is on the primary: the
    submit returns its id (raising would invite the same work submitted twice) and says why it may not
    survive a failover."""
    settings = ProducerSettings(
        replica_acks=1, replica_ack_timeout_ms=20, redis_retry_attempts=2, redis_retry_initial_wait_s=0.01
    )
    with Client(redis_url, settings=settings) as client, caplog.at_level("WARNING", logger="mlxq.producer"):
        job = client.submit_generate("hello", max_tokens=4, job_id="unconfirmed")
    assert job.id == "unconfirmed"
    said = [r.getMessage() for r in caplog.records if "no replica confirmed" in r.getMessage()]
    assert len(said) == 1 and "0 of 1 replica(s)" in said[0], said
    assert redis_conn.exists(keys.REPLICATION_MARK)  # the mark went in, WAIT came back short
    assert redis_conn.exists(keys.rq_job_key("unconfirmed"))  # on the primary: enqueued once, not twice
    assert redis_conn.llen(keys.rq_queue_key("default")) == 1


def test_a_worker_write_no_replica_confirms_goes_on(
    redis_conn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    options = StreamOptions(retry_attempts=2, retry_max_wait_s=0.01, replication=Replicas(redis_conn, 1, 20))
    calls: list[int] = []

    def write() -> str:
        calls.append(redis_conn.incr("writes"))
        return "written"

    with caplog.at_level(logging.WARNING, logger="mlxq.worker.stream_writer"):
        assert retrying(options)(write) == "written"
    assert calls == [1, 2]  # written again after the shortfall, as after a lost reply
    assert "writes not confirmed by a replica" in caplog.text


@pytest.fixture
def primary_with_two_replicas(tmp_path: Path) -> Iterator[tuple[PrivateRedis, list[PrivateRedis]]]:
    (tmp_path / "primary").mkdir()
    primary = PrivateRedis(tmp_path / "primary")
    primary.start()
    replicas = []
    for i in range(2):
        (tmp_path / f"replica-{i}").mkdir()
        replica = PrivateRedis(tmp_path / f"replica-{i}", "--replicaof", "127.0.0.1", str(primary.port))
        replica.start()
        replicas.append(replica)
    conn = redis.Redis(port=primary.port)
    deadline = time.monotonic() + 20
    while len(online_replicas(conn.info("replication"))) < 2:
        assert time.monotonic() < deadline, "the replicas did not come online"
        time.sleep(0.05)
    yield primary, replicas
    for server in [*replicas, primary]:
        server.stop()


def test_writes_wait_for_every_replica_the_primary_lists_and_a_promoted_one_refuses_them(
    primary_with_two_replicas: tuple[PrivateRedis, list[PrivateRedis]],
) -> None:
    """Waiting for every online replica: one that goes down costs one shortfall, then it is forgotten;
    one that becomes a primary (a failover under way) keeps every write here unconfirmed, however many
    replicas are left to acknowledge it, until the writer reaches the new primary."""
    primary, (first, second) = primary_with_two_replicas
    conn = redis.Redis(port=primary.port)
    replicas = Replicas(conn, 1, timeout_ms=300)
    replicas.confirm()
    assert replicas.set.wanted() == 2

    assert first.proc is not None
    first.proc.kill()  # down (a crash): no longer acknowledges
    first.proc.wait(10)
    with pytest.raises(NotReplicated, match="1 of 2"):
        replicas.confirm()
    replicas.confirm()  # looked again: the one that went down is forgotten
    assert replicas.set.wanted() == 1

    redis.Redis(port=second.port).replicaof("NO", "ONE")  # promoted, as a sentinel does
    for _ in range(3):  # however often it is tried, and with no replica left to acknowledge
        with pytest.raises(NotReplicated):
            replicas.confirm()
    with pytest.raises(NotReplicated, match=f"127.0.0.1:{second.port} is a primary now"):
        replicas.confirm()

    new = Replicas(redis.Redis(port=second.port), 1, timeout_ms=300)  # the writer on the new primary
    redis.Redis(port=primary.port).replicaof("127.0.0.1", second.port)  # the old one follows it
    deadline = time.monotonic() + 20
    while True:
        try:
            new.confirm()
            break
        except NotReplicated:
            assert time.monotonic() < deadline
    assert new.set.wanted() == 1


def test_no_replica_setting_means_no_waiting_and_no_looking(redis_conn: redis.Redis) -> None:
    before = int(redis_conn.info("commandstats").get("cmdstat_info", {"calls": 0})["calls"])
    Replicas(redis_conn, 0).confirm()
    after = int(redis_conn.info("commandstats").get("cmdstat_info", {"calls": 0})["calls"])
    assert after - before == 1  # only this test's own INFO
    assert not redis_conn.exists(keys.REPLICATION_MARK)


def test_a_bulk_run_waits_for_replicas_as_a_submit_does(
    redis_url: str, redis_conn: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bulk run's enqueues wait for the replicas too (WAIT after each transaction of jobs); when none
    confirms, its jobs stand with the submit's warning, each enqueued once. (No worker here: the run is
    stopped once its jobs are queued.)"""
    settings = ProducerSettings(
        replica_acks=1, replica_ack_timeout_ms=20, redis_retry_attempts=2, redis_retry_initial_wait_s=0.01
    )
    rows = [{"custom_id": str(i), "prompt": "a", "candidates": ["b"]} for i in range(6)]
    stop = threading.Event()
    waits = int(redis_conn.info("commandstats").get("cmdstat_wait", {"calls": 0})["calls"])

    def stop_once_queued() -> None:
        deadline = time.monotonic() + 30
        while redis_conn.llen(keys.rq_queue_key("bulk")) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()

    threading.Thread(target=stop_once_queued, daemon=True).start()
    with Client(redis_url, settings=settings) as client, caplog.at_level("WARNING", logger="mlxq.producer"):
        summary = client.score_dataset(rows, tmp_path / "out.jsonl", queue="bulk", rows_per_job=2, stop=stop)
    assert summary.succeeded == 0
    said = [r.getMessage() for r in caplog.records if "no replica confirmed" in r.getMessage()]
    assert len(said) == 1 and "(and 2 more)" in said[0], said
    assert int(redis_conn.info("commandstats")["cmdstat_wait"]["calls"]) - waits >= 2  # tried, then again
    job_keys = [k for k in redis_conn.scan_iter(match="rq:job:*") if b":dependents" not in k]
    assert len(job_keys) == 3  # written once, found there on the retry
