"""A Sentinel failover under load loses nothing: a real primary, replica and three sentinels on
loopback ports (`down-after-milliseconds 1000`), a worker and a producer on the `redis+sentinel://`
URL, jobs submitted without pause while the primary is shut down (and later comes back as a replica)
or demoted by `SENTINEL FAILOVER` (the worker's connections then meet READONLY). Every submit goes
through under the producer's default retries and the worker lives; when the primary goes away
every job finishes, each token once."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_server import SentinelSet

from mlxq.jobs.schema import TokenEvent
from mlxq.producer import Client, JobHandle

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    ha = SentinelSet(tmp_path / "ha", down_after_ms=1000)
    yield ha
    ha.stop()


class Submitter:
    """Submits a short generation job every `every_s` until stopped; notes how long each submit took."""

    def __init__(self, client: Client, no_eos: dict[int, float], every_s: float = 0.05) -> None:
        self.client = client
        self.no_eos = no_eos
        self.every_s = every_s
        self.handles: list[Any] = []
        self.times: list[tuple[float, float]] = []
        self.errors: list[BaseException] = []
        self.longest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Submitter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(self.every_s):
            started = time.monotonic()
            try:
                handle = self.client.submit_generate(
                    f"job {i}", max_tokens=12, temperature=0, logit_bias=self.no_eos
                )
                self.handles.append(handle)
                self.times.append((started, time.monotonic()))
            except Exception as e:  # what the test asserts never happens
                self.errors.append(e)
            self.longest_s = max(self.longest_s, time.monotonic() - started)
            i += 1


def _ride_out(
    sentinels: SentinelSet,
    model_dir: Path,
    no_eos: dict[int, float],
    spawn_worker: Any,
    fail_over: Callable[[SentinelSet], None],
) -> dict[str, Any]:
    """Jobs flowing through a failover: every job submitted finishes, each token once."""
    worker = spawn_worker(model_dir, sentinels.url, MLXQ_STREAM_FLUSH_TOKENS="1")
    worker.wait_ready()
    old = sentinels.primary_port()
    with Client(sentinels.url) as client:
        long_job: JobHandle[Any] = client.submit_generate(
            "a long one", max_tokens=400, temperature=0, logit_bias=no_eos
        )
        next(i for i in long_job.stream(timeout=60) if isinstance(i.event, TokenEvent))
        with Submitter(client, no_eos) as submitter:
            time.sleep(1.0)
            began = time.monotonic()
            fail_over(sentinels)
            while sentinels.primary_port() == old:
                assert time.monotonic() - began < 30, "no failover"
                time.sleep(0.05)
            switched = time.monotonic()
            # Jobs keep coming after the switch (the replicas follow the new primary; the first submits
            # there wait until one has caught up): at least 6 s and 10 jobs of it.
            time.sleep(6.0)
            while sum(t0 > switched for t0, _ in list(submitter.times)) < 10:
                assert time.monotonic() - switched < 60, "submits stopped after the switch"
                time.sleep(0.1)
        handles = [long_job, *submitter.handles]
        after = [h for h, (t0, _) in zip(submitter.handles, submitter.times, strict=True) if t0 > switched]
        # Every job finishes: the worker works through the backlog the failover left (a hundred jobs or
        # so, more on a loaded host), and RQ's end follows each result by a moment.
        deadline = time.monotonic() + 240
        while any(h.status() != "finished" for h in handles):
            assert time.monotonic() < deadline, [h.status() for h in handles]
            time.sleep(0.2)
        results = [h.result(timeout=30) for h in handles]
        streams = [
            [i.event for i in h.stream(timeout=30) if isinstance(i.event, TokenEvent)] for h in handles
        ]
        outcomes = [h.status() for h in handles]
    assert submitter.errors == [], "a submit failed under the default retries"
    assert len(after) >= 10, "too few jobs after the switch to say anything"
    for result, events in zip(results, streams, strict=True):
        indexes = [e.index for e in events]
        assert indexes == sorted(set(indexes)), "a token event was written twice"
        assert [i for e in events for i in e.ids] == result.token_ids, "a token is missing from the stream"
        assert "".join(e.text for e in events) == result.text
    assert worker.proc.poll() is None, f"the worker died in the failover:\n{worker.log()}"
    return {
        "jobs": len(handles),
        "finished": outcomes.count("finished"),
        "lost": outcomes.count("missing"),
        "failed": outcomes.count("failed"),
        "switch_s": round(switched - began, 2),
        "longest_submit_s": round(submitter.longest_s, 2),
    }


@pytest.mark.timeout(600)  # a failover, then its backlog on a loaded host: `_ride_out`
def test_jobs_ride_out_the_primary_shutting_down_and_returning_as_a_replica(
    sentinels: SentinelSet,
    model_dir: Path,
    no_eos: dict[int, float],
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    """The primary goes away (SHUTDOWN); the sentinels promote a replica; the old primary comes back
    and is made a replica. Nothing is lost: each submit waits for a replica to hold the job (WAIT)."""

    returns: list[threading.Thread] = []
    old_ports: list[int] = []

    def shut_down(ha: SentinelSet) -> None:
        old = ha.primary
        old_ports.append(old.port)
        # no retries: redis-py retries a command whose connection closed (SHUTDOWN's does, by design)
        # with backoff, and a SHUTDOWN sent again would stop the old primary once it is back
        once = redis.Redis(port=old.port, retry=Retry(NoBackoff(), 0))
        threading.Thread(target=once.shutdown, daemon=True).start()

        def come_back() -> None:  # once the sentinels moved on, the old primary returns: as a replica
            while ha.primary_port() == old.port:
                time.sleep(0.1)
            assert old.proc is not None
            old.proc.wait(30)
            old.start()

        returns.append(threading.Thread(target=come_back, daemon=True))
        returns[-1].start()

    figures = _ride_out(sentinels, model_dir, no_eos, spawn_worker, shut_down)
    # the old primary is back before the servers are stopped (a return racing the teardown's
    # shutdown failed the thread, not the jobs)
    (back,) = returns
    back.join(60)
    assert not back.is_alive()
    assert redis.Redis(port=old_ports[0]).ping()  # back, and still up (no SHUTDOWN sent twice)
    assert figures["finished"] == figures["jobs"]
    reliability_report["sentinel_failover_shutdown"] = figures


@pytest.mark.timeout(600)  # a failover, then its backlog on a loaded host: `_ride_out`
def test_a_sentinel_failover_with_the_old_primary_still_up_is_ridden_out(
    sentinels: SentinelSet,
    model_dir: Path,
    no_eos: dict[int, float],
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    """`SENTINEL FAILOVER`: the old primary stays up, taking writes and feeding the other replica until
    the sentinels demote it, and that replica follows the new primary too. Writes wait for every
    replica, and while the promoted one says primary nothing written to the old one counts, so the
    submits and the worker's writes of the switch window are done again on the new primary: nothing is
    lost, and the worker lives through READONLY replies."""
    figures = _ride_out(
        sentinels,
        model_dir,
        no_eos,
        spawn_worker,
        lambda ha: ha.sentinel().execute_command("SENTINEL", "FAILOVER", ha.name),
    )
    assert figures["finished"] == figures["jobs"]
    reliability_report["sentinel_failover_command"] = figures
