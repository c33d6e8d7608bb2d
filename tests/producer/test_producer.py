"""The producer against real Redis and real RQ; the worker's side is played by `worker_side` or by
a plain `rq.SimpleWorker` where RQ's own lifecycle is what is tested."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from conftest import WorkerSide, generate_result, score_result
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from mlxq.jobs import errors, keys
from mlxq.jobs.schema import DoneEvent, GenerateRequest, GenerateResult, RestartEvent, ScoreResult, TokenEvent
from mlxq.producer import CancelOutcome, Client, JobFailed, JobNotFound, JobOptions, ProducerSettings, rq_wire
from mlxq.producer.connection import RetryPolicy, redact_url

REDIS_DB = 11

FAST_RETRY = {"redis_retry_initial_wait_s": 0.01, "redis_retry_max_wait_s": 0.02}


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    with Client(redis_url, settings=ProducerSettings(**FAST_RETRY)) as c:
        yield c


def fetch(conn: redis.Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def returns_a_generate_result(payload: dict[str, Any]) -> dict[str, Any]:
    """Test-only RQ job function: finishes like a generation job but writes no stream."""
    return generate_result(text=payload["prompt"].upper()).model_dump(mode="json")


# --- submission ------------------------------------------------------------------------------------


def test_submit_generate_enqueues_an_rq_json_job(client: Client, redis_conn: redis.Redis) -> None:
    handle = client.submit_generate(
        "Hi",
        max_tokens=5,
        temperature=0,
        job_timeout=30,
        result_ttl=60,
        failure_ttl=90,
        retry=2,
        meta={"u": 1},
    )
    job = fetch(redis_conn, handle.id)
    assert (job.func_name, job.args, job.kwargs) == (
        "jobs.generate",
        [{"prompt": "Hi", "max_tokens": 5, "temperature": 0.0}],
        {},
    )
    assert (job.origin, job.timeout, job.result_ttl, job.failure_ttl) == ("default", 30, 60, 90)
    assert (job.retries_left, job.meta, job.get_status()) == (2, {"u": 1}, JobStatus.QUEUED)
    assert Queue("default", connection=redis_conn).job_ids == [handle.id]
    assert redis_conn.smembers(keys.RQ_QUEUES_SET) == {b"rq:queue:default"}
    assert len(handle.id) == 32 and handle.status() == "queued"


def test_wire_job_is_equivalent_to_rq_enqueue(client: Client, redis_conn: redis.Redis) -> None:
    payload = {"prompt": "Hi", "max_tokens": 5}
    options = {"job_timeout": 60, "result_ttl": 100, "failure_ttl": 200, "meta": {"a": [1]}}
    client.enqueue(
        keys.GENERATE_FUNC, payload, JobOptions(**options, retry=Retry(max=2, interval=[1, 5])), job_id="ours"
    )
    rq_queue = Queue("default", connection=redis_conn, serializer=JSONSerializer)
    rq_queue.enqueue(
        keys.GENERATE_FUNC, payload, job_id="rqs", retry=Retry(max=2, interval=[1, 5]), **options
    )

    volatile = {b"created_at", b"enqueued_at", b"description"}
    ours = {k: v for k, v in redis_conn.hgetall("rq:job:ours").items() if k not in volatile}
    theirs = {k: v for k, v in redis_conn.hgetall("rq:job:rqs").items() if k not in volatile and v != b""}
    assert ours == theirs
    a, b = fetch(redis_conn, "ours"), fetch(redis_conn, "rqs")
    for attr in ("func_name", "args", "kwargs", "origin", "timeout", "result_ttl", "failure_ttl", "meta"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert (a.retries_left, a.retry_intervals) == (b.retries_left, b.retry_intervals) == (2, [1, 5])
    assert a.enqueued_at is not None and a.created_at is not None
    assert rq_queue.job_ids == ["ours", "rqs"]


@pytest.mark.parametrize("chars", [1, 150, 183, 184, 185, 400, 200_000])
def test_the_description_is_the_call_cut_at_its_limit_whatever_the_payload_size(chars: int) -> None:
    """RQ's description: the call as text, cut at `DESCRIPTION_MAX_CHARS`, without encoding the rest of a
    long payload (the cut the same as of the whole call's text, non-ASCII text as it is)."""
    payload = {
        "rows": [{"prompt": ("é" + "x" * 9) * (chars // 10) + "y" * (chars % 10), "candidates": [" a"]}]
    }
    built = rq_wire.build_job(keys.SCORE_FUNC, payload, queue="default").fields["description"]
    call = f"{keys.SCORE_FUNC}({json.dumps(payload, ensure_ascii=False)})"
    limit = rq_wire.DESCRIPTION_MAX_CHARS
    assert built == (call if len(call) <= limit else call[: limit - 4] + "...)")
    assert len(built) <= limit


def test_at_front_and_queue_name(client: Client, redis_conn: redis.Redis) -> None:
    first = client.submit_generate("a")
    second = client.submit_generate("b", at_front=True)
    other = client.submit_generate("c", queue="bulk")
    assert Queue("default", connection=redis_conn).job_ids == [second.id, first.id]
    assert Queue("bulk", connection=redis_conn).job_ids == [other.id]


def test_requests_are_validated_before_enqueueing(client: Client, redis_conn: redis.Redis) -> None:
    with pytest.raises(errors.InvalidRequest, match="max_tokens"):
        client.submit_generate("Hi", max_tokens=0)
    with pytest.raises(errors.InvalidRequest, match="exactly one of"):
        client.submit_generate("Hi", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(errors.InvalidRequest, match="max_token"):
        client.submit_generate("Hi", max_token=3)
    # A lone surrogate (a JSON escape without its pair) is not text a tokenizer takes: named, with where.
    with pytest.raises(
        errors.InvalidRequest, match=r"prompt: is not valid Unicode: a lone surrogate U\+D83D at character 3"
    ):
        client.submit_generate("Hi \ud83d")
    with pytest.raises(errors.InvalidRequest, match=r"rows\.0\.candidates\.1: is not valid Unicode"):
        client.submit_score([{"prompt": "Hi", "candidates": [" a", " \udc00"]}])
    with pytest.raises(errors.InvalidRequest, match=r"messages\.0: field 'name' is not valid Unicode"):
        client.submit_generate(messages=[{"role": "user", "content": "Hi", "name": ["ok", "\ud800"]}])
    assert redis_conn.dbsize() == 0
    job = client.submit_generate(json.loads('"Hi \\ud83d\\ude42"'))  # JSON's pair: one character, fine
    assert job.status() == "queued"


def test_submit_accepts_messages_a_request_object_and_score_rows(
    client: Client, redis_conn: redis.Redis
) -> None:
    chat = client.submit_generate(messages=[{"role": "user", "content": "Hi"}], stop="\n")
    ready = client.submit_generate(GenerateRequest(prompt="x", seed=3))
    score = client.submit_score([{"prompt": "2+2=", "candidates": ["4", "5"]}])
    assert fetch(redis_conn, chat.id).args == [
        {"messages": [{"role": "user", "content": "Hi"}], "stop": ["\n"]}
    ]
    assert fetch(redis_conn, ready.id).args == [{"prompt": "x", "seed": 3}]
    job = fetch(redis_conn, score.id)
    assert (job.func_name, job.args) == (
        "jobs.score",
        [{"rows": [{"prompt": "2+2=", "candidates": ["4", "5"]}]}],
    )


def test_a_retried_submission_is_never_enqueued_twice(
    client: Client, redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_execute = redis.client.Pipeline.execute
    lost: list[bool] = []

    def reply_lost_once(self: redis.client.Pipeline, raise_on_error: bool = True) -> list[Any]:
        out = real_execute(self, raise_on_error)
        if not lost:  # the transaction ran, but the client never hears back
            lost.append(True)
            raise redis.ConnectionError("connection reset while reading the reply")
        return out

    monkeypatch.setattr(redis.client.Pipeline, "execute", reply_lost_once)
    handle = client.submit_generate("once", job_id="fixed-id")
    client.submit_generate("once", job_id="fixed-id")  # a caller's own retry with the same id
    assert lost == [True]
    assert Queue("default", connection=redis_conn).job_ids == [handle.id] == ["fixed-id"]


def test_connection_errors_are_retried_a_bounded_number_of_times() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise redis.ConnectionError("down")
        return "up"

    policy = RetryPolicy(attempts=3, initial_wait_s=0.01, max_wait_s=0.02)
    assert policy.call(flaky) == "up" and len(calls) == 3
    # redis-py's ValueError from a connection buffer closed under a reading thread is a dropped
    # connection too; any other ValueError is a bug and is raised at once.
    closed: list[int] = []

    def closed_under_us() -> str:
        closed.append(1)
        if len(closed) < 2:
            raise ValueError("I/O operation on closed file.")
        return "up"

    assert policy.call(closed_under_us) == "up" and len(closed) == 2
    with pytest.raises(ValueError, match="bad value"):
        policy.call(lambda: (_ for _ in ()).throw(ValueError("bad value")))
    settings = ProducerSettings(redis_retry_attempts=2, **FAST_RETRY)
    started = time.monotonic()
    with Client("redis://127.0.0.1:1/0", settings=settings) as dead, pytest.raises(redis.ConnectionError):
        dead.submit_generate("Hi")
    assert time.monotonic() - started < 2
    # Bulk runs (hours long) ride out a Redis restart or failover: ~30 s of tries; a longer policy stays.
    patient = RetryPolicy().patient()
    assert (patient.attempts, patient.max_wait_s) == (12, 5.0)
    waits = [min(patient.max_wait_s, patient.initial_wait_s * 2**i) for i in range(patient.attempts - 1)]
    assert 25 < sum(waits) < 45
    assert RetryPolicy(attempts=20, max_wait_s=9.0).patient() == RetryPolicy(20, 0.1, 9.0, say_waits=True)


def test_settings_and_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXQ_QUEUE", "bulk")
    monkeypatch.setenv("MLXQ_JOB_TIMEOUT", "120")
    settings = ProducerSettings()
    assert (settings.queue, settings.job_timeout, settings.redis_url) == (
        "bulk",
        120,
        "redis://127.0.0.1:6379/0",
    )
    with pytest.raises(ValueError, match="socket_timeout_s"):
        ProducerSettings(socket_timeout_s=0.5)
    assert redact_url("rediss://app:s3cret@redis.example:6380/2") == "rediss://app:***@redis.example:6380/2"
    tls = Client("rediss://redis.example:6380/2").connection.connection_pool
    unix = Client("unix:///run/redis.sock?db=3").connection.connection_pool
    assert tls.connection_class.__name__ == "SSLConnection"
    assert unix.connection_kwargs["path"] == "/run/redis.sock" and unix.connection_kwargs["db"] == 3


def test_acl_user_and_password_from_the_url(redis_url: str, redis_conn: redis.Redis) -> None:
    user = f"mlxq-test-{time.monotonic_ns()}"
    redis_conn.acl_setuser(user, enabled=True, passwords=["+pw-1"], keys=["*"], commands=["+@all"])
    try:
        authed_url = redis_url.replace("redis://", f"redis://{user}:pw-1@")
        with Client(authed_url) as authed:
            assert authed.connection.acl_whoami() == user
            assert authed.submit_generate("Hi").status() == "queued"
    finally:
        redis_conn.acl_deluser(user)


# --- reading streams and results -------------------------------------------------------------------


def test_stream_text_deltas_and_result(client: Client, worker_side: WorkerSide) -> None:
    handle = client.submit_generate("Capital of France?")
    worker_side.start(handle.id)
    ids = worker_side.tokens(handle.id, "Pa", "ris", ".")
    done_id = worker_side.done(handle.id, generate_result("Paris."))

    items = list(handle.stream(timeout=2))
    assert [i.stream_id for i in items] == [*ids, done_id]
    assert [type(i.event) for i in items] == [TokenEvent] * 3 + [DoneEvent]
    assert items[-1].terminal and not items[0].terminal
    assert "".join(handle.text_deltas(timeout=2)) == "Paris."
    result = handle.result(timeout=2)
    assert isinstance(result, GenerateResult) and result.text == "Paris."
    assert result.usage.cached_tokens == 4


def test_stream_resumes_after_a_saved_id(client: Client, worker_side: WorkerSide) -> None:
    handle = client.submit_generate("Hi")
    first, second = worker_side.tokens(handle.id, "a", "b")
    worker_side.tokens(handle.id, "c", index=2)
    worker_side.done(handle.id)
    resumed = list(handle.stream(from_id=second, timeout=2))
    assert [getattr(i.event, "text", None) for i in resumed] == ["c", None]
    from_first = list(handle.stream(from_id=first, timeout=2))
    assert from_first[0].event == TokenEvent(text="b", ids=[101], index=1)
    assert from_first[1:] == resumed


def test_restart_event_starts_the_text_over(client: Client, worker_side: WorkerSide) -> None:
    handle = client.submit_generate("Hi", retry=1)
    worker_side.tokens(handle.id, "wro", "ng")
    worker_side.restart(handle.id, attempt=2)
    worker_side.tokens(handle.id, "ri", "ght")
    worker_side.done(handle.id, generate_result("right"))
    shown: list[str] = []

    def drop_shown(event: RestartEvent) -> None:
        assert event.attempt == 2
        shown.clear()

    for delta in handle.text_deltas(timeout=2, on_restart=drop_shown):
        shown.append(delta)
    assert "".join(shown) == "right"
    assert RestartEvent(attempt=2) in [i.event for i in handle.stream(timeout=2)]
    assert handle.result(timeout=2).text == "right"


@pytest.mark.timeout(10)
def test_result_and_stream_wait_for_a_done_event_written_later(
    client: Client, worker_side: WorkerSide
) -> None:
    handle = client.submit_generate("Hi")
    worker_side.start(handle.id)
    worker_side.tokens(handle.id, "x")
    timer = threading.Timer(0.3, worker_side.done, (handle.id, generate_result("late")))
    timer.start()
    try:
        started = time.monotonic()
        assert handle.result().text == "late"  # no timeout: waits as long as it takes
        assert time.monotonic() - started < 2
    finally:
        timer.join()
    assert [type(i.event) for i in handle.stream()] == [TokenEvent, DoneEvent]


def test_score_result_and_handles_by_id(client: Client, worker_side: WorkerSide) -> None:
    handle = client.submit_score([{"prompt": "2+2=", "candidates": ["4", "5"]}])
    worker_side.done(handle.id, score_result())
    assert isinstance(handle.result(timeout=2), ScoreResult)
    assert isinstance(client.job(handle.id).result(timeout=2), ScoreResult)


def test_error_event_raises_job_failed_with_the_reason(client: Client, worker_side: WorkerSide) -> None:
    handle = client.submit_generate("Hi")
    worker_side.tokens(handle.id, "par")
    worker_side.error(
        handle.id, "ContextTooLong: prompt is 9000 tokens but the model's context length is 8192"
    )
    with pytest.raises(errors.JobFailed, match="prompt is 9000 tokens") as info:
        handle.result(timeout=2)
    assert info.value.reason.startswith("ContextTooLong")
    with pytest.raises(JobFailed):
        list(handle.text_deltas(timeout=2))
    assert list(handle.stream(timeout=2))[-1].terminal


def test_a_job_failing_in_a_real_rq_worker_reports_rqs_reason(
    client: Client, run_rq_worker: Callable[..., None]
) -> None:
    handle = client.submit_generate("Hi")
    run_rq_worker()  # a plain RQ worker runs the body of jobs.generate: it raises NotInWorker
    assert handle.status() == "failed"
    with pytest.raises(errors.JobFailed) as info:
        handle.result(timeout=3)
    failure = info.value
    assert isinstance(failure, JobFailed) and failure.status == "failed"
    assert failure.reason.startswith("jobs.errors.NotInWorker: mlxq jobs run inside an mlxq worker process")
    assert "Traceback" in failure.details and failure.reason in failure.details
    with pytest.raises(JobFailed, match="NotInWorker"):
        list(handle.stream(timeout=3))


def test_a_finished_job_without_stream_gives_rqs_return_value(
    client: Client, redis_conn: redis.Redis, run_rq_worker: Callable[..., None]
) -> None:
    job = Queue(connection=redis_conn, serializer=JSONSerializer).enqueue(
        returns_a_generate_result, {"prompt": "hi"}
    )
    run_rq_worker()
    started = time.monotonic()
    assert client.job(job.id).result(timeout=3) == generate_result("HI")
    assert list(client.job(job.id).stream(timeout=3)) == []
    assert time.monotonic() - started < 1


def test_timeouts(client: Client) -> None:
    handle = client.submit_generate("Hi")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.3)
    with pytest.raises(TimeoutError):
        list(handle.stream(timeout=0.2))
    assert time.monotonic() - started < 1.5


def test_unknown_jobs(client: Client) -> None:
    ghost = client.job("no-such-job")
    assert ghost.status() == "missing"
    with pytest.raises(JobNotFound):
        ghost.result(timeout=2)
    assert ghost.cancel() == CancelOutcome.MISSING


# --- cancellation ----------------------------------------------------------------------------------


def test_cancel_a_queued_job_so_it_never_runs(
    client: Client, redis_conn: redis.Redis, run_rq_worker: Callable[..., None]
) -> None:
    handle = client.submit_generate("Hi")
    assert handle.cancel() == CancelOutcome.CANCELED
    run_rq_worker()  # would fail the job with NotInWorker if it ran
    assert handle.status() == JobStatus.CANCELED.value
    assert handle.id in CanceledJobRegistry("default", connection=redis_conn).get_job_ids()
    assert Queue("default", connection=redis_conn).job_ids == []
    with pytest.raises(JobFailed, match="canceled before it ran"):
        handle.result(timeout=2)
    assert handle.cancel() == CancelOutcome.ALREADY_OVER


def test_cancel_a_started_job_asks_the_worker_to_stop(
    client: Client, redis_conn: redis.Redis, worker_side: WorkerSide
) -> None:
    handle = client.submit_generate("Hi")
    worker_side.start(handle.id)
    assert handle.cancel() == CancelOutcome.REQUESTED
    assert redis_conn.get(keys.cancel_key(handle.id)) == b"1"
    assert 3500 < redis_conn.ttl(keys.cancel_key(handle.id)) <= 3600
    assert handle.status() == "started"  # RQ's state is the worker's to change
    worker_side.done(handle.id, generate_result("Par", finish_reason="cancelled"))
    assert handle.result(timeout=2).finish_reason == "cancelled"
    assert handle.cancel() == CancelOutcome.REQUESTED  # RQ still says started: harmless


def test_a_job_id_whose_key_holds_no_hash_reads_as_missing(client: Client, redis_conn: redis.Redis) -> None:
    """`SET rq:job:<id> x` (a key of another type): the handle says `missing` instead of raising Redis's
    WRONGTYPE, and cancelling it finds no such job; a worker puts such an id aside."""
    redis_conn.set(keys.rq_job_key("not-a-hash"), "x")
    handle = client.job("not-a-hash")
    assert handle.status() == "missing"
    assert handle.cancel() == CancelOutcome.MISSING
    with pytest.raises(JobNotFound):
        handle.result(timeout=2)


def test_a_long_runs_retries_say_why_it_stalls(caplog: pytest.LogCaptureFixture) -> None:
    """Bulk runs use the patient policy: each wait for Redis is a warning line, not silence; a
    submit's quick policy stays quiet."""
    fails = iter([redis.ConnectionError("refused"), redis.ConnectionError("refused")])

    def flaky() -> str:
        error = next(fails, None)
        if error is not None:
            raise error
        return "ok"

    with caplog.at_level(logging.WARNING, logger="mlxq.producer"):
        assert RetryPolicy(attempts=3, initial_wait_s=0.01).patient().call(flaky) == "ok"
        fails = iter([redis.ConnectionError("refused")])
        assert RetryPolicy(attempts=3, initial_wait_s=0.01).call(flaky) == "ok"
    said = [r.getMessage() for r in caplog.records if r.name == "mlxq.producer"]
    assert len(said) == 2 and all("redis unreachable; trying again in" in s for s in said), said
    assert "(try 2 of 12)" in said[0] and "error=refused" in said[0]
