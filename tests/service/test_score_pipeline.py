"""The score pipeline (`ScoreJobs` with `ScoreAhead` and the finalizer): batches of one-row jobs, the
next claimed and started while one runs, give every job one result, equal to a run without the
pipeline, and leave RQ's records as that run leaves them; batches follow one another without RQ's
dequeue; the claim ahead stands back for a queue served first and for a job it passed over."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend

from mlxq.jobs import keys
from mlxq.jobs.schema import ScoreRequest
from mlxq.producer import Client
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.engine import START_FROM
from mlxq.worker.job_claim import QueuedJob
from mlxq.worker.score_ahead import ScoreAhead
from mlxq.worker.score_claim import ClaimBudget, ScorePicker
from mlxq.worker.score_phases import ScorePhases
from mlxq.worker.service import WorkerService
from mlxq.worker.settings import WorkerSettings

REDIS_DB = 2
JOBS = 120
BATCH_JOBS = 8
WORDS = ["red", "blue", "green", "small", "large", "old", "new", "quiet", "loud", "warm"]

# Fields that differ from job to job (times, payload, the worker that ran it), compared as set or not.
_PER_JOB = {
    "created_at",
    "started_at",
    "ended_at",
    "last_heartbeat",
    "enqueued_at",
    "data",
    "description",
    "worker_name",
}


def _rows(i: int) -> list[dict[str, Any]]:
    a, b = WORDS[i % len(WORDS)], WORDS[(i * 7 + 3) % len(WORDS)]
    return [{"prompt": f"The {a} house by the {b} tree, number {i}, is", "candidates": [" the", " a"]}]


def _work(model_dir: Path, redis_url: str, engine: Engine, pipeline: bool) -> WorkerService:
    settings = WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir),
        redis_url=redis_url,
        queues=["default"],
        warm_up=False,
        score_batch_jobs=BATCH_JOBS,
        score_pipeline=pipeline,
        _env_file=None,
    )
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        service = WorkerService.start(settings, engine=engine)
        assert service.work(burst=True) == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return service


def _ended_state(conn: redis.Redis, job_id: str) -> dict[str, Any]:
    """What RQ and mlxq keep of an ended job, without its times, ids and payload."""
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    stored = conn.hgetall(job.key)
    events = [f[b"event"].decode() for _, f in conn.xrange(keys.stream_key(job_id))]
    return {
        "status": job.get_status(refresh=True),
        "fields": {k.decode() for k in stored},
        "values": {k: v for k, v in stored.items() if k.decode() not in _PER_JOB},
        "timing fields set": {k: bool(stored.get(k.encode())) for k in ("started_at", "ended_at")},
        "ttl": conn.ttl(job.key) > 0,
        "results": [r.type for r in Result.all(job, serializer=JSONSerializer)],
        "result fields": [sorted(f) for _, f in conn.xrange(f"rq:results:{job.id}")],
        "finished registry": job.id in job.finished_job_registry,
        "started registry": job.id in job.started_job_registry,
        "executions": conn.exists(f"rq:executions:{job.id}"),
        "events": events,  # one `done`, after the job's tokens (none for a score job)
        "result key": conn.exists(keys.result_key(job_id)),
    }


def _queue_records(conn: redis.Redis) -> dict[str, int]:
    """What `rq info` reads of the queue: waiting, started, finished, failed, and the intermediate list."""
    q = Queue("default", connection=conn)
    return {
        "queued": q.count,
        "started": q.started_job_registry.count,
        "finished": q.finished_job_registry.count,
        "failed": q.failed_job_registry.count,
        "intermediate": conn.llen(q.intermediate_queue_key),
    }


def _close(a: Any, b: Any) -> bool:
    """Equal up to float rounding (1e-4), key by key (batch neighbours may change a sum's order)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(k == "cached_tokens" or _close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= 1e-4
    return bool(a == b)


def test_pipelined_batches_give_each_job_one_result_equal_to_a_run_without_the_pipeline(
    model_dir: Path, redis_url: str, redis_conn: redis.Redis, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine.load(str(model_dir), EngineOptions())
    runs: dict[bool, tuple[list[str], WorkerService, dict[str, int]]] = {}
    for pipeline in (False, True):
        before = _queue_records(redis_conn)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mlxq.worker.score_claim"):
            ids = [client.submit_score(_rows(i)).id for i in range(JOBS)]
            service = _work(model_dir, redis_url, engine, pipeline)
        ahead = sum("score batch claimed ahead=" in r.getMessage() for r in caplog.records)
        after = _queue_records(redis_conn)
        counts = {k: after[k] - before[k] for k in after}
        assert counts == {"queued": 0, "started": 0, "finished": JOBS, "failed": 0, "intermediate": 0}
        runs[pipeline] = (ids, service, {"ahead": ahead})

    (serial_ids, serial, serial_seen), (piped_ids, piped, piped_seen) = runs[False], runs[True]
    stats = piped.stats.latest
    batches = int(stats["score_batches"])
    assert batches >= JOBS // BATCH_JOBS and int(stats["score_jobs"]) == JOBS
    # RQ handed over the first job only: every later batch was claimed ahead, beside the one before.
    assert piped_seen["ahead"] == batches - 1 and serial_seen["ahead"] == 0
    assert float(stats["score_aside_s"]) > 0 and float(stats["score_waited_s"]) >= 0
    assert float(serial.stats.latest["score_aside_s"]) == 0

    for i, (a, b) in enumerate(zip(serial_ids, piped_ids, strict=True)):
        expected = client.job(a).result(timeout=5).model_dump(mode="json")
        got = client.job(b).result(timeout=5).model_dump(mode="json")
        assert _close(got, expected), (i, got, expected)
        state, serial_state = _ended_state(redis_conn, b), _ended_state(redis_conn, a)
        assert state == serial_state, i
        assert state["events"] == ["done"] and state["status"] == "finished", state
        assert state["results"] == [Result.Type.SUCCESSFUL] and not state["started registry"]
    for name in (serial.worker.name, piped.worker.name):  # the worker's index of executions emptied
        assert redis_conn.scard(f"rq:worker:{name}:executions") == 0


def test_batches_taken_ahead_are_tokenized_off_the_main_thread_with_the_same_ids(
    model_dir: Path, redis_url: str, redis_conn: redis.Redis, client: Client
) -> None:
    """Every batch but the one RQ hands over is validated and tokenized on the helper thread that took
    it, with a tokenizer of its own (one clone, made once), never on the main thread; the ids are those
    the engine's own tokenizer gives on the main thread, special-token text read as the control token
    where the job allows it and split into ordinary tokens where it does not."""
    engine = Engine.load(str(model_dir), EngineOptions())
    real = engine.score_tokens_many
    calls: list[tuple[bool, Any, list[ScoreRequest], list[Any]]] = []

    def score_tokens_many(requests: Any, tokenizer: Any = None) -> Any:
        got = real(requests, tokenizer)
        calls.append((threading.current_thread() is threading.main_thread(), tokenizer, list(requests), got))
        return got

    engine.score_tokens_many = score_tokens_many  # type: ignore[method-assign]
    special = "<|im_start|>"
    special_id = engine.tokenizer.backend.token_to_id(special)
    for i in range(JOBS):
        rows = _rows(i)
        rows[0]["prompt"] = f"{special}user {rows[0]['prompt']}" if i % 3 else rows[0]["prompt"]
        client.submit_score(rows, allow_special_tokens=i % 2 == 0)
    _work(model_dir, redis_url, engine, pipeline=True)

    on_main = [c for c in calls if c[0]]
    aside = [c for c in calls if not c[0]]
    assert len(on_main) == 1 and on_main[0][1] is None  # the batch RQ handed over: tokenized in turn
    assert sum(len(requests) for _, _, requests, _ in calls) == JOBS and len(aside) >= JOBS // BATCH_JOBS - 1
    clones = {id(tokenizer) for _, tokenizer, _, _ in aside}
    assert len(clones) == 1 and id(engine.tokenizer) not in clones
    ways = set()
    for _, _, requests, got in aside:
        assert real(requests) == got  # the engine's own tokenizer, here on the main thread
        for request, rows in zip(requests, got, strict=True):
            if special in request.rows[0].prompt:
                prompt_ids = rows[0][0]
                assert (special_id in prompt_ids) == request.allow_special_tokens
                ways.add(request.allow_special_tokens)
    assert ways == {True, False}  # special-token text both ways went through the helper thread


def test_the_batch_tokenized_on_the_main_thread_starts_its_shared_prefix_first(
    model_dir: Path, redis_url: str, redis_conn: redis.Redis, client: Client
) -> None:
    """The batch RQ hands over is tokenized on the main thread: the prefix its first rows share is
    started on the device before the rest is tokenized (`Engine.start_shared_prefix`); batches taken
    ahead, tokenized on the helper thread, start nothing. Every job's result is the engine's alone."""
    engine = Engine.load(str(model_dir), EngineOptions(start_shared_prefix=True))
    real_start, real_tokens = engine.start_shared_prefix, engine.score_tokens_many
    events: list[tuple[str, bool, int, int]] = []

    def start(requests: Any) -> int:
        n = real_start(requests)
        events.append(("start", threading.current_thread() is threading.main_thread(), len(requests), n))
        return n

    def tokens(requests: Any, tokenizer: Any = None) -> Any:
        events.append(("tokenize", threading.current_thread() is threading.main_thread(), len(requests), 0))
        return real_tokens(requests, tokenizer)

    engine.start_shared_prefix = start  # type: ignore[method-assign]
    engine.score_tokens_many = tokens  # type: ignore[method-assign]
    document = " ".join(WORDS * 40) + "."
    rows = [
        [{"prompt": f"{document} Number {i} is", "candidates": [" the", " a"]}] for i in range(3 * BATCH_JOBS)
    ]
    ids = [client.submit_score(r).id for r in rows]
    _work(model_dir, redis_url, engine, pipeline=True)

    on_main = [e for e in events if e[1]]
    assert [e[0] for e in on_main] == ["start", "tokenize"] and on_main[0][2] == on_main[1][2] == BATCH_JOBS
    assert on_main[0][3] >= START_FROM
    assert all(e[0] == "tokenize" for e in events if not e[1])
    alone = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0))
    for job_id, r in zip(ids, rows, strict=True):
        got = client.job(job_id).result(timeout=5).model_dump(mode="json")
        want = alone.score(ScoreRequest.model_validate({"rows": r})).model_dump(mode="json")
        assert _close(got, want), (got, want)


def _queued(job_id: str, func: str = keys.SCORE_FUNC, rows: int = 1) -> QueuedJob:
    return QueuedJob(job_id, func, {"rows": [{"prompt": "a", "candidates": ["b"]}] * rows})


def test_a_claim_that_passes_a_queued_job_over_says_so() -> None:
    budget = ClaimBudget(max_rows=4, max_jobs=3)
    in_order = ScorePicker(budget)
    assert [in_order(_queued(f"s{i}")) for i in range(4)] == [True, True, True, False]
    assert not in_order.passed_over  # the budget ran out: nothing after the refusal was taken
    jumped = ScorePicker(budget)
    took = [jumped(q) for q in (_queued("s0"), _queued("g", keys.GENERATE_FUNC), _queued("s1"))]
    assert took == [True, False, True] and jumped.passed_over
    too_big = ScorePicker(budget)
    assert [too_big(q) for q in (_queued("s0", rows=3), _queued("s1", rows=2), _queued("s2"))] == [
        True,
        False,
        True,
    ]
    assert too_big.passed_over


class _Host:
    """The part of `JobHost` the claim ahead reads before it claims: the queues, in priority order."""

    def __init__(self, queues: list[Queue]) -> None:
        self.queues = queues


def test_nothing_is_claimed_ahead_while_a_queue_served_first_has_jobs_or_workers_are_suspended(
    redis_conn: redis.Redis,
) -> None:
    high, low = (Queue(name, connection=redis_conn, serializer=JSONSerializer) for name in ("high", "low"))
    for _ in range(3):
        low.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "a", "candidates": ["b"]}]},))
    high.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": "a", "candidates": ["b"]}]},))

    class NoClaims:
        def claim_batch(self, queue: Queue) -> tuple[list[Job], bool]:
            raise AssertionError(f"claimed from {queue.name} while a queue served first had jobs")

    ahead = ScoreAhead(_Host([high, low]), NoClaims(), ScorePhases(), prepare=lambda runs: [])  # type: ignore[arg-type]
    try:
        taken = ahead.take(low, watch=None).result(timeout=5)  # type: ignore[arg-type]
    finally:
        ahead.close()
    assert taken.runs == [] and taken.last
    assert low.count == 3 and high.count == 1  # nothing moved
    assert not ahead._stand_back(high)  # the first queue has none before it
    suspend(redis_conn)
    assert ahead._stand_back(high)
    resume(redis_conn)
    assert not ahead._stand_back(high)


def test_a_stop_that_breaks_off_a_batch_requeues_the_batch_taken_ahead_untouched(
    model_dir: Path, redis_url: str, redis_conn: redis.Redis, client: Client
) -> None:
    """A stop that raises out of the running batch (RQ's cold stop, SystemExit): the batch taken beside it
    never ran, so it goes back to the head of its queue, in order and untouched (its job hashes as the
    producer left them, no attempt, no event, no result); the broken-off batch is left to abandoned-job
    recovery, as RQ leaves a job its worker stopped inside; the rest stay queued; nothing sits claimed."""
    engine = Engine.load(str(model_dir), EngineOptions())
    real = engine.score_many
    calls = [0]

    def score_many(jobs: Any, interrupt: Any = None) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # the second batch: by now the third was taken beside it
            raise SystemExit("cold stop")
        return real(jobs, interrupt)

    engine.score_many = score_many  # type: ignore[method-assign]
    ids = [client.submit_score(_rows(i)).id for i in range(6 * BATCH_JOBS)]
    as_submitted = {j: redis_conn.hgetall(keys.rq_job_key(j)) for j in ids}
    with pytest.raises(SystemExit):
        _work(model_dir, redis_url, engine, pipeline=True)

    statuses = [Job.fetch(j, connection=redis_conn, serializer=JSONSerializer).get_status() for j in ids]
    batches = [statuses[k : k + BATCH_JOBS] for k in range(0, len(ids), BATCH_JOBS)]
    assert batches[0] == ["finished"] * BATCH_JOBS
    assert batches[1] == ["started"] * BATCH_JOBS  # broken off: recovered when its heartbeat lapses
    assert batches[2] == ["queued"] * BATCH_JOBS  # taken ahead, never scored: back in the queue
    assert all(s == "queued" for b in batches[3:] for s in b)
    requeued = ids[2 * BATCH_JOBS : 3 * BATCH_JOBS]
    queue = Queue("default", connection=redis_conn)
    assert queue.get_job_ids() == [*requeued, *ids[3 * BATCH_JOBS :]]  # at the head, in order
    for job_id in requeued:
        assert redis_conn.hgetall(keys.rq_job_key(job_id)) == as_submitted[job_id]
        state = _ended_state(redis_conn, job_id)
        assert state["events"] == [] and state["results"] == [] and not state["result key"]
        assert not state["started registry"] and not state["executions"]
    records = _queue_records(redis_conn)
    assert (records["queued"], records["started"], records["intermediate"]) == (4 * BATCH_JOBS, BATCH_JOBS, 0)
    assert records["failed"] == 0
