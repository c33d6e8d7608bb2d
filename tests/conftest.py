"""Shared fixtures, in sections. Add new ones to the section they belong to (or a new section).

Redis: tests use a real server. `redis_url`/`redis_conn` give a DB index of the test module's own,
flushed before and after each test: a module sets `REDIS_DB = N` (default 9) so that modules run by
parallel pytest processes never flush each other's keys. The server is `MLXQ_TEST_REDIS_SERVER`
(default `redis://127.0.0.1:6379`, no DB in it). DB 0 is never used.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.jobs.schema import (
    DoneEvent,
    ErrorEvent,
    GenerateResult,
    RestartEvent,
    ScoreResult,
    Timings,
    TokenEvent,
    Usage,
)
from mlxq.producer import Client
from mlxq.worker.rq_worker import MlxqWorker

# --- Redis -----------------------------------------------------------------------------------------

REDIS_SERVER = os.environ.get("MLXQ_TEST_REDIS_SERVER", "redis://127.0.0.1:6379").rstrip("/")
DEFAULT_TEST_DB = 9


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of an empty test DB (the module's `REDIS_DB`, default 9), flushed again afterwards."""
    db = int(getattr(request.module, "REDIS_DB", DEFAULT_TEST_DB))
    if db == 0:
        raise ValueError("tests never use Redis DB 0: set REDIS_DB to another index")
    url = f"{REDIS_SERVER}/{db}"
    conn = redis.Redis.from_url(url)
    try:
        conn.ping()
    except redis.ConnectionError as e:
        pytest.fail(f"these tests need a Redis server at {REDIS_SERVER} ({e})")
    conn.flushdb()
    try:
        yield url
    finally:
        conn.flushdb()
        conn.close()


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    """A client (bytes replies, as RQ needs) on the test DB of `redis_url`."""
    conn = redis.Redis.from_url(redis_url)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    """A producer `Client` on the test DB (a module may define its own, e.g. with other settings)."""
    with Client(redis_url) as c:
        yield c


@pytest.fixture
def suffix_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of the suffix batches every `PrefixScorer` makes from now on, in order."""
    from mlxq.worker.engine.scoring import PrefixScorer  # needs MLX: imported only where a test asks for it

    groups: list[int] = []
    batches = PrefixScorer._batches

    def recorded(self: PrefixScorer, leaves: list[Any], prefix: int) -> list[list[Any]]:
        out = batches(self, leaves, prefix)
        groups.extend(len(g) for g in out)
        return out

    monkeypatch.setattr(PrefixScorer, "_batches", recorded)
    return groups


# --- RQ ---------------------------------------------------------------------------------------------


class _PlainWorker(SimpleWorker):
    """RQ's SimpleWorker, whose exit does not wait out its command thread (`MlxqWorker.unsubscribe`:
    with redis-py 8.2 a burst worker could take a minute to return)."""

    unsubscribe = MlxqWorker.unsubscribe


@pytest.fixture
def run_rq_worker(redis_conn: redis.Redis) -> Callable[..., None]:
    """Run a plain `rq.SimpleWorker` (JSON serializer) in this process until the queues are empty.

    RQ installs its own SIGINT/SIGTERM handlers and leaves them behind; they are put back afterwards
    so a later test's Ctrl-C is a KeyboardInterrupt again.
    """

    def run(*queue_names: str) -> None:
        queues = [
            Queue(n, connection=redis_conn, serializer=JSONSerializer) for n in queue_names or ["default"]
        ]
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            _PlainWorker(queues, connection=redis_conn, serializer=JSONSerializer).work(burst=True)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    return run


# --- The worker's side of the Redis contract, simulated (for producer tests) -----------------------


def generate_result(text: str = "Paris.", finish_reason: str = "stop") -> GenerateResult:
    """A plausible finished generation, as a worker would return it."""
    return GenerateResult.model_validate(
        {
            "text": text,
            "finish_reason": finish_reason,
            "token_ids": [1, 2, 3],
            "usage": Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4),
            "timings": Timings(ttft_s=0.05, decode_tokens_per_s=42.5, total_s=0.2),
            "model": "tiny",
        }
    )


def score_result() -> ScoreResult:
    return ScoreResult.model_validate(
        {
            "rows": [{"logits": [2.0, 1.0], "logprobs": [-0.3, -1.3], "input_tokens": 3, "cached_tokens": 0}],
            "input_tokens": 3,
            "cached_tokens": 0,
        }
    )


class WorkerSide:
    """Writes what an mlxq worker writes for a job, as the contract says: stream events, result key."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    def _add(self, job_id: str, fields: dict[str, str]) -> str:
        entry_id = self.conn.xadd(keys.stream_key(job_id), fields)  # type: ignore[arg-type]
        return entry_id.decode()

    def tokens(self, job_id: str, *texts: str, index: int = 0) -> list[str]:
        """One `token` event per text; returns their stream ids."""
        return [
            self._add(job_id, TokenEvent(text=t, ids=[100 + i], index=index + i).fields())
            for i, t in enumerate(texts)
        ]

    def restart(self, job_id: str, attempt: int = 1) -> str:
        return self._add(job_id, RestartEvent(attempt=attempt).fields())

    def error(self, job_id: str, message: str) -> str:
        return self._add(job_id, ErrorEvent(message=message).fields())

    def done(self, job_id: str, result: GenerateResult | ScoreResult | None = None) -> str:
        """The result key and the `done` event, in one transaction (as the worker's stream writer)."""
        result = result if result is not None else generate_result()
        if isinstance(result, GenerateResult):
            usage = result.usage
            event = DoneEvent(
                finish_reason=result.finish_reason,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                ttft_s=result.timings.ttft_s,
                decode_tokens_per_s=result.timings.decode_tokens_per_s,
                total_s=result.timings.total_s,
            )
        else:
            event = DoneEvent(
                finish_reason="stop",
                prompt_tokens=result.input_tokens,
                completion_tokens=0,
                cached_tokens=result.cached_tokens,
            )
        pipe = self.conn.pipeline(transaction=True)
        pipe.xadd(keys.stream_key(job_id), event.fields())  # type: ignore[arg-type]
        pipe.set(keys.result_key(job_id), result.model_dump_json(), ex=3600)
        entry_id = pipe.execute()[0]
        return str(entry_id.decode())

    def start(self, job_id: str) -> None:
        """Take the job off its queue and mark it `started`, as a worker does when it takes it."""
        job = Job.fetch(job_id, connection=self.conn, serializer=JSONSerializer)
        self.conn.lrem(keys.rq_queue_key(job.origin), 0, job_id)
        job.set_status(JobStatus.STARTED)


@pytest.fixture
def worker_side(redis_conn: redis.Redis) -> WorkerSide:
    """Plays the worker's part of the Redis contract in producer tests."""
    return WorkerSide(redis_conn)


# --- Real worker processes -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_stray_workers() -> Iterator[None]:
    """Whatever worker processes a test started and left running (it failed before stopping them)
    are killed when it ends; those of module-scoped fixtures (running before it began) are left."""
    module = sys.modules.get("worker_process")
    before = set(module.WorkerProcess.RUNNING) if module else set()
    yield
    module = sys.modules.get("worker_process")
    if module:
        module.WorkerProcess.stop_all(keep=before)


@pytest.fixture
def spawn_worker(tmp_path: Any) -> Iterator[Any]:
    """Start real `mlxq worker` processes (see tests/worker_process.py); all are killed at teardown,
    even when the test fails half-way, so no stray worker takes a later test's jobs."""
    from worker_process import WorkerProcess

    started: list[WorkerProcess] = []

    def spawn(model_dir: Any, redis_url: str, *args: str, name: str = "worker", **env: str) -> WorkerProcess:
        w = WorkerProcess(model_dir, redis_url, tmp_path / f"{name}-{len(started)}.log", *args, **env)
        started.append(w)
        return w

    yield spawn
    for w in started:
        w.stop()


# --- Reliability figures, reported at the end of the run ---------------------------------------------

_RELIABILITY: dict[str, Any] = {}


@pytest.fixture(scope="session", autouse=True)
def _session_garbage_shown() -> Iterator[None]:
    """At the session's end, garbage still held in reference cycles is collected with its
    `ResourceWarning`s shown rather than raised. A worker's `gc.freeze` (`WorkerService.work`) keeps
    what a test's worker made out of the collector's passes until it stops, and what it leaves in
    cycles (RQ's objects hold bound methods of themselves) may wait for a full collection that only
    pytest's last one runs, after every test, where an unclosed connection fails the whole run with
    no test to name. Collected here first, it is printed with what allocated it (under
    `PYTHONTRACEMALLOC`); a leak inside a test still fails that test."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()


@pytest.fixture(scope="session")
def reliability_report() -> dict[str, Any]:
    """Tests put measured figures here (faults survived, inputs tried, load, memory slope); they are
    printed at the end of the run and written to `.pytest_cache/mlxq-reliability.json`."""
    return _RELIABILITY


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RELIABILITY:
        return
    import json
    from pathlib import Path

    terminalreporter.section("mlxq reliability figures")
    for name, figures in sorted(_RELIABILITY.items()):
        terminalreporter.write_line(f"{name}: {json.dumps(figures)}")
    out = Path(str(terminalreporter.config.rootpath)) / ".pytest_cache" / "mlxq-reliability.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(_RELIABILITY, indent=2))


# --- Models and private servers --------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random-weight Llama checkpoint (2 layers, 4096-token context) with a trained tokenizer.
    Modules that need another shape define their own `model_dir`."""
    from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 4096})


@pytest.fixture(scope="session")
def no_eos(model_dir: Any) -> dict[int, float]:
    """A `logit_bias` that keeps the tiny model from ending early (its EOS ids at -100)."""
    from mlxq.worker.engine.text.tokenizer import Tokenizer

    return {i: -100.0 for i in Tokenizer.from_dir(model_dir).eos_ids}


@pytest.fixture
def private_redis(tmp_path: Any) -> Iterator[Any]:
    """A `redis-server` of the test's own (append-only, fsync always) that the test may restart."""
    import shutil

    from redis_server import PrivateRedis

    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


# --- worker processes and engines shared by several modules ---------------------------------------------


@pytest.fixture
def worker(model_dir: Any, redis_url: str, tmp_path: Any) -> Iterator[Any]:
    """A worker process serving the queue `default` with the test module's model and Redis, ready (a
    module may define its own `worker`)."""
    from worker_process import WorkerProcess

    w = WorkerProcess(model_dir, redis_url, tmp_path / "worker.log", "--queue", "default")
    w.wait_ready()
    yield w
    w.stop()


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    """Engines a test loaded through `engines.closed_after_test` (tests/engines.py) are closed when it
    ends; a test that loaded none imports nothing here (no MLX for the producer tests)."""
    yield
    module = sys.modules.get("engines")
    if module is not None:
        module.close_engines()
