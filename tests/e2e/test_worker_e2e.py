"""End to end: real Redis, real worker processes, a tiny real checkpoint, the producer client."""

from __future__ import annotations

import json
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from rq import Callback, Queue
from rq.serializers import JSONSerializer
from worker_process import WorkerProcess

from mlxq.jobs import keys
from mlxq.jobs.schema import DoneEvent, TokenEvent
from mlxq.producer import Client, JobFailed

REDIS_DB = 11
PROMPT = "The capital of France is Paris. " * 4


@pytest.fixture
def worker(model_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    # One job at a time: these tests reason about which job is queued while another runs.
    w = WorkerProcess(
        model_dir, redis_url, tmp_path / "worker.log", "--queue", "default", MLXQ_MAX_BATCH_SEQUENCES="1"
    )
    w.wait_ready()
    yield w
    w.stop()


def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _stream(conn: redis.Redis, job_id: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in conn.xrange(keys.stream_key(job_id))]


def test_generation_streams_the_text_it_returns(
    worker: WorkerProcess, client: Client, no_eos: dict[int, float]
) -> None:
    job = client.submit_generate(PROMPT, max_tokens=40, temperature=0, logit_bias=no_eos)
    items = list(job.stream(timeout=30))
    result = job.result(timeout=30)
    tokens = [i.event for i in items if isinstance(i.event, TokenEvent)]
    done = items[-1].event
    assert isinstance(done, DoneEvent)
    assert "".join(t.text for t in tokens) == result.text
    assert [i for t in tokens for i in t.ids] == result.token_ids
    assert [t.index for t in tokens] == sorted({t.index for t in tokens})
    assert done.completion_tokens == result.usage.completion_tokens == 40
    assert done.prompt_tokens == result.usage.prompt_tokens > 10
    assert result.finish_reason == done.finish_reason == "length"
    assert result.timings.queued_s is not None and 0 <= result.timings.queued_s < 30
    _eventually(lambda: job.status() == "finished")  # RQ's bookkeeping follows the result key
    # The same job, submitted again, finds its prompt in the warm prefix cache.
    again = client.submit_generate(PROMPT, max_tokens=40, temperature=0, logit_bias=no_eos).result(timeout=30)
    assert again.usage.cached_tokens == result.usage.prompt_tokens - 1
    assert again.token_ids == result.token_ids
    assert "generate done job=" in worker.log() and "cached_tokens=" in worker.log()


def test_chat_and_score_jobs(worker: WorkerProcess, client: Client) -> None:
    chat = client.submit_generate(messages=[{"role": "user", "content": "Hello!"}], max_tokens=5).result(30)
    assert chat.usage.prompt_tokens > 5 and chat.finish_reason in ("stop", "length")
    rows = [
        {"prompt": PROMPT + "The capital of France is", "candidates": [" the", " a"]},
        {"prompt": PROMPT + "The capital of Italy is", "candidates": [" the"]},
    ]
    scored = client.submit_score(rows).result(timeout=30)
    assert [len(r.logits) for r in scored.rows] == [2, 1]
    assert all(lp < 0 for r in scored.rows for lp in r.logprobs)
    assert scored.rows[1].cached_tokens > 0  # shares the long prefix with row 0


def test_score_jobs_queued_together_are_batched_and_a_bad_one_fails_alone(
    model_dir: Path, redis_url: str, client: Client, tmp_path: Path
) -> None:
    row = {"prompt": PROMPT + "The capital of France is", "candidates": [" the", " a"]}
    alone = [client.submit_score([row]) for _ in range(6)]
    bad = client.submit_score([{"prompt": "x", "candidates": [" Paris"]}])
    w = WorkerProcess(model_dir, redis_url, tmp_path / "w.log", "--burst")
    assert w.wait() == 0
    results = [j.result(timeout=5) for j in alone]
    assert all(r.rows[0].logits == pytest.approx(results[0].rows[0].logits, rel=1e-5) for r in results)
    assert results[0].cached_tokens == 0 and all(r.cached_tokens == r.input_tokens for r in results[1:])
    with pytest.raises(JobFailed, match=r"candidate ' Paris' does not add exactly one token"):
        bad.result(timeout=5)
    assert "score batch claimed=6" in w.log()


def test_two_workers_never_run_a_job_twice(
    model_dir: Path, redis_url: str, client: Client, redis_conn: redis.Redis, tmp_path: Path
) -> None:
    jobs = [client.submit_generate(f"{i} " + PROMPT, max_tokens=3) for i in range(30)]
    a = WorkerProcess(model_dir, redis_url, tmp_path / "a.log", "--burst")
    b = WorkerProcess(model_dir, redis_url, tmp_path / "b.log", "--burst")
    assert a.wait(60) == 0 and b.wait(60) == 0
    logs = a.log() + b.log()
    for job in jobs:
        assert job.result(timeout=5).usage.completion_tokens <= 3
        events = [e["event"] for e in _stream(redis_conn, job.id)]
        assert events.count("done") == 1 and "restart" not in events
        assert logs.count(f"generate done job={job.id}") == 1


def test_cancel_a_queued_job_and_a_running_one(
    worker: WorkerProcess, client: Client, no_eos: dict[int, float]
) -> None:
    running = client.submit_generate(PROMPT, max_tokens=1900, temperature=0, logit_bias=no_eos)
    queued = client.submit_generate(PROMPT, max_tokens=5)
    first = next(i for i in running.stream(timeout=30) if isinstance(i.event, TokenEvent))
    assert first.event.index == 0
    assert queued.cancel().value == "canceled"
    assert running.cancel().value == "requested"
    result = running.result(timeout=30)
    assert result.finish_reason == "cancelled"
    assert 0 < result.usage.completion_tokens < 1900
    time.sleep(0.5)  # the worker is idle now and would have taken the queued job
    assert queued.status() == "canceled"
    # The running one ends in RQ's canceled registry too (its partial result stays readable above).
    deadline = time.monotonic() + 10
    while running.status() != "canceled" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running.status() == "canceled"
    canceled = Queue(client.queue, connection=client.connection).canceled_job_registry
    assert set(canceled.get_job_ids()) == {queued.id, running.id}
    assert running.result(timeout=1).finish_reason == "cancelled"
    assert not client.connection.exists(keys.stream_key(queued.id))


def test_bad_payloads_fail_alone_and_the_worker_goes_on(
    worker: WorkerProcess, client: Client, redis_conn: redis.Redis
) -> None:
    json_q = Queue("default", connection=redis_conn, serializer=JSONSerializer)
    pickle_q = Queue("default", connection=redis_conn)  # RQ's default: pickle
    bad = {
        "pickle": pickle_q.enqueue_call("jobs.generate", args=({"prompt": "hi"},)),
        "function": json_q.enqueue_call("os.system", args=("echo owned",)),
        "arguments": json_q.enqueue_call("jobs.generate", args=({"prompt": "a"}, 2)),
        "field": json_q.enqueue_call("jobs.generate", args=({"prompt": "a", "max_token": 3},)),
        "type": json_q.enqueue_call("jobs.score", args=({"rows": "nope"},)),
        "callback": json_q.enqueue_call(
            "jobs.generate", args=({"prompt": "a"},), on_success=Callback("builtins.print")
        ),
    }
    good = client.submit_generate("after the bad ones", max_tokens=3)
    assert good.result(timeout=30).usage.completion_tokens <= 3
    reasons = {}
    for name, job in bad.items():
        handle = client.job(job.id)
        with pytest.raises(JobFailed) as err:
            handle.result(timeout=10)
        reasons[name] = str(err.value)
        assert _stream(redis_conn, job.id)[-1]["event"] == "error"
    assert "never unpickles" in reasons["pickle"]
    assert "'os.system' is not an mlxq job" in reasons["function"]
    assert "exactly one argument" in reasons["arguments"]
    assert "max_token: Extra inputs are not permitted" in reasons["field"]
    assert "rows: Input should be a valid list" in reasons["type"]
    assert "names callbacks (builtins.print)" in reasons["callback"]
    assert worker.proc.poll() is None
    assert pickle.dumps  # the pickled payload above never reached pickle.loads in the worker


def test_a_bad_score_job_among_claimable_ones_fails_alone(
    worker: WorkerProcess, client: Client, redis_conn: redis.Redis
) -> None:
    """A score batch claims the good jobs queued behind its first; the bad one is left for RQ's dequeue,
    where the allowlist fails it with its reason."""
    queue = Queue("default", connection=redis_conn, serializer=JSONSerializer)
    row = {"rows": [{"prompt": PROMPT + "The capital of France is", "candidates": [" the", " a"]}]}
    datas = [
        Queue.prepare_data(keys.SCORE_FUNC, args=args)
        for args in ((row,), (row, "extra"), (row,))  # the middle one has a second argument
    ]
    with redis_conn.pipeline() as pipe:  # all queued at once: the worker takes the first, claims the rest
        jobs = queue.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    good = [client.job(jobs[0].id).result(timeout=30), client.job(jobs[2].id).result(timeout=30)]
    assert all(len(r.rows) == 1 for r in good)
    with pytest.raises(JobFailed, match="exactly one argument"):
        client.job(jobs[1].id).result(timeout=10)
    assert worker.proc.poll() is None


@pytest.mark.parametrize("overlap", ["false", "true"])
def test_sigterm_finishes_the_job_then_exits_and_a_second_cancels(
    model_dir: Path, redis_url: str, client: Client, tmp_path: Path, no_eos: dict[int, float], overlap: str
) -> None:
    """Also with decode steps launched on the launcher's thread, as on a GPU."""
    w = WorkerProcess(model_dir, redis_url, tmp_path / "w.log", MLXQ_DECODE_OVERLAP=overlap)
    w.wait_ready()
    job = client.submit_generate(PROMPT, max_tokens=60, temperature=0, logit_bias=no_eos)
    next(i for i in job.stream(timeout=30) if isinstance(i.event, TokenEvent))
    w.signal(signal.SIGTERM)
    assert w.wait(60) == 0
    assert job.result(timeout=5).finish_reason == "length"  # finished, not cut short

    assert f"decode_overlap={overlap.title()}" in (tmp_path / "w.log").read_text()

    w2 = WorkerProcess(model_dir, redis_url, tmp_path / "w2.log", MLXQ_DECODE_OVERLAP=overlap)
    w2.wait_ready()
    # As long as the model's context allows: ~3 s here, while the second signal comes 1.1 s after the first.
    long_job = client.submit_generate(PROMPT, max_tokens=4000, temperature=0, logit_bias=no_eos)
    next(i for i in long_job.stream(timeout=30) if isinstance(i.event, TokenEvent))
    w2.signal(signal.SIGTERM)
    time.sleep(1.1)  # RQ ignores a repeat within one second
    w2.signal(signal.SIGTERM)
    assert w2.wait(60) == 0
    result = long_job.result(timeout=5)
    assert result.finish_reason == "cancelled" and result.usage.completion_tokens < 3000


def test_result_key_and_rq_result_agree(
    worker: WorkerProcess, client: Client, redis_conn: redis.Redis
) -> None:
    job = client.submit_generate("hi", max_tokens=4)
    result = job.result(timeout=30)
    stored = json.loads(redis_conn.get(keys.result_key(job.id)))
    from rq.job import Job

    _eventually(lambda: job.status() == "finished")  # RQ stores its copy right after the result key
    rq_job = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert stored == rq_job.return_value() == result.model_dump(mode="json")
