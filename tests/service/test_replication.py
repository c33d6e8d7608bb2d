"""Writes confirmed by replicas (`jobs.replication`, WAIT behind a mark key): a producer's submit is
refused when no replica confirms it in time; a worker's write goes on, said in its log (a replica
outage must not fail jobs). Run against a Redis without replicas, where WAIT always falls short."""

from __future__ import annotations

import logging

import pytest
import redis

from mlxq.jobs import keys
from mlxq.jobs.replication import confirm_replicated, default_replica_acks
from mlxq.producer import Client, ProducerSettings
from mlxq.worker.stream_writer import Replication, StreamOptions, retrying


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
    options = StreamOptions(
        retry_attempts=2, retry_max_wait_s=0.01, replication=Replication(redis_conn, 1, 20)
    )
    calls: list[int] = []

    def write() -> str:
        calls.append(redis_conn.incr("writes"))
        return "written"

    with caplog.at_level(logging.WARNING, logger="mlxq.worker.stream_writer"):
        assert retrying(options)(write) == "written"
    assert calls == [1, 2]  # written again after the shortfall, as after a lost reply
    assert "writes not confirmed by a replica" in caplog.text
