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
    lossless: bool = True,
) -> dict[str, Any]:
    """Jobs flowing through a failover. `lossless`: every job submitted finishes, each token once;
    else only those submitted after the switch must (the others are counted)."""
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
            time.sleep(6.0)  # jobs keep coming after the switch (the replicas follow the new primary)
        handles = [long_job, *submitter.handles]
        after = [h for h, (t0, _) in zip(submitter.handles, submitter.times, strict=True) if t0 > switched]
        must = handles if lossless else after
        deadline = time.monotonic() + 90
        while any(h.status() != "finished" for h in must):  # RQ's end follows the result by a moment
            assert time.monotonic() < deadline, [h.status() for h in must]
            time.sleep(0.2)
        results = [h.result(timeout=30) for h in must]
        streams = [[i.event for i in h.stream(timeout=30) if isinstance(i.event, TokenEvent)] for h in must]
        outcomes = [h.status() for h in handles]
    assert submitter.errors == [], "a submit failed under the default retries"
    assert len(after) >= 10, "too few jobs after the switch to say anything"
    for result, events in zip(results, streams, strict=True):
        indexes = [e.index for e in events]
        assert indexes == sorted(set(indexes)), "a token event was written twice"
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


def test_jobs_ride_out_the_primary_shutting_down_and_returning_as_a_replica(
    sentinels: SentinelSet,
    model_dir: Path,
    no_eos: dict[int, float],
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    """The primary goes away (SHUTDOWN); the sentinels promote a replica; the old primary comes back
    and is made a replica. Nothing is lost: each submit waits for a replica to hold the job (WAIT)."""

    def shut_down(ha: SentinelSet) -> None:
        old = ha.primary
        threading.Thread(target=lambda: redis.Redis(port=old.port).shutdown(), daemon=True).start()

        def come_back() -> None:  # once the sentinels moved on, the old primary returns: as a replica
            while ha.primary_port() == old.port:
                time.sleep(0.1)
            assert old.proc is not None
            old.proc.wait(30)
            old.start()

        threading.Thread(target=come_back, daemon=True).start()

    figures = _ride_out(sentinels, model_dir, no_eos, spawn_worker, shut_down)
    assert figures["finished"] == figures["jobs"]
    reliability_report["sentinel_failover_shutdown"] = figures


@pytest.mark.xfail(
    reason="known gap: in a SENTINEL FAILOVER the old primary stays a writable primary (still feeding the "
    "other replica, so WAIT 1 is met) until the sentinels demote it; a job written to it in that window, "
    "even after the switch, is lost when it and that replica follow the new primary",
    strict=False,
)
def test_a_sentinel_failover_with_the_old_primary_still_up_is_ridden_out(
    sentinels: SentinelSet,
    model_dir: Path,
    no_eos: dict[int, float],
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    """`SENTINEL FAILOVER`: the old primary stays up and is demoted under the worker's connections,
    which meet READONLY and move to the new primary; the worker lives and serves every job submitted
    after the switch. Writes the old primary took in the switch window itself can be lost (Redis
    replicates asynchronously, and a replica it still feeds is re-pointed too): counted, not asserted."""
    figures = _ride_out(
        sentinels,
        model_dir,
        no_eos,
        spawn_worker,
        lambda ha: ha.sentinel().execute_command("SENTINEL", "FAILOVER", ha.name),
        lossless=False,
    )
    reliability_report["sentinel_failover_command"] = figures
