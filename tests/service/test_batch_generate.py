"""Generation jobs batched in one real worker process: each job ends exactly as it would alone.

Expected results come from the engine in this process (same tiny checkpoint, float32 on the CPU):
batching must not change a single token id, finish reason or streamed character.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.jobs.schema import DoneEvent, GenerateRequest, GenerateResult, ScoreRequest, TokenEvent
from mlxq.producer import Client, JobFailed
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.generation_batch import generate
from mlxq.worker.engine.speculation.dflash import write_random_draft

REDIS_DB = 5
PROMPT = "The capital of France is Paris. "
NO_EOS = {0: -100.0, 2: -100.0}  # the tiny tokenizer's <|endoftext|> and <|im_end|>
BATCH = {"MLXQ_MAX_BATCH_SEQUENCES": "4", "MLXQ_BATCH_ADMIT_EVERY": "2"}


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0))


def _alone(engine: Engine, fields: dict[str, Any]) -> GenerateResult:
    return generate(engine, GenerateRequest.model_validate(fields), lambda _t, _i: None)


def _eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def _stream(conn: redis.Redis, job_id: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in conn.xrange(keys.stream_key(job_id))]


def _first_token(job: Any) -> None:
    next(i for i in job.stream(timeout=30) if isinstance(i.event, TokenEvent))


def _check_stream(job: Any, result: GenerateResult) -> None:
    """The stream holds the whole text, in order, then one `done` that agrees with the result."""
    items = [i.event for i in job.stream(timeout=10)]
    tokens = [e for e in items if isinstance(e, TokenEvent)]
    assert [type(e) for e in items[len(tokens) :]] == [DoneEvent], "token events, then exactly one done"
    assert "".join(t.text for t in tokens) == result.text
    assert [i for t in tokens for i in t.ids] == result.token_ids
    index = 0
    for t in tokens:
        assert t.index == index
        index += len(t.ids)
    done = items[-1]
    assert isinstance(done, DoneEvent)
    assert (done.finish_reason, done.completion_tokens) == (result.finish_reason, len(result.token_ids))


@pytest.mark.parametrize("overlap", ["false", "true"])
def test_queued_jobs_run_batched_with_the_results_of_running_alone(
    model_dir: Path, redis_url: str, client: Client, engine: Engine, spawn_worker: Any, overlap: str
) -> None:
    """Also as on a GPU: tokens handled and streams written on the overlap thread
    (`MLXQ_DECODE_OVERLAP`), and new jobs prefilled in one step when none decodes
    (`MLXQ_IDLE_PREFILL_TOKENS`)."""
    free = _alone(engine, {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "logit_bias": NO_EOS})
    requests: list[dict[str, Any]] = [
        {"prompt": PROMPT * (1 + i % 5) + str(i), "max_tokens": 6 + 9 * i, "logit_bias": NO_EOS, "seed": i}
        | ({"temperature": 0} if i % 2 == 0 else {"temperature": 1.2, "top_p": 0.9})
        for i in range(9)
    ]
    requests += [
        {
            "prompt": PROMPT,
            "max_tokens": 30,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "stop": [free.text[9:12]],
        },
        {"prompt": "hi", "max_tokens": 40, "temperature": 0, "logit_bias": {2: 100.0}},  # EOS at once
    ]
    jobs = [client.submit_generate(**fields) for fields in requests]
    gpu = {"MLXQ_IDLE_PREFILL_TOKENS": "16384"} if overlap == "true" else {}
    worker = spawn_worker(model_dir, redis_url, "--burst", **BATCH, MLXQ_DECODE_OVERLAP=overlap, **gpu)
    assert worker.wait(120) == 0, worker.log()
    for job, fields in zip(jobs, requests, strict=True):
        result = job.result(timeout=5)
        want = _alone(engine, fields)
        assert result.token_ids == want.token_ids, fields
        assert (result.text, result.finish_reason) == (want.text, want.finish_reason)
        assert result.usage.completion_tokens == want.usage.completion_tokens
        _check_stream(job, result)
        assert job.status() == "finished"
    assert [j.result(timeout=1).finish_reason for j in jobs[-2:]] == ["stop", "stop"]
    assert "generation batch claimed=3" in worker.log()  # the first job's batch filled its 4 slots
    assert f"decode_overlap={overlap.title()}" in worker.log()
    assert f"idle_prefill_tokens={gpu.get('MLXQ_IDLE_PREFILL_TOKENS', 2048)}" in worker.log()


@pytest.mark.parametrize("overlap", ["false", "true"])
def test_cancel_one_job_mid_batch_and_a_bad_job_fails_alone(
    model_dir: Path,
    redis_url: str,
    client: Client,
    engine: Engine,
    spawn_worker: Any,
    redis_conn: redis.Redis,
    overlap: str,
) -> None:
    """Also with decode steps launched on the launcher's thread, as on a GPU."""
    worker = spawn_worker(model_dir, redis_url, **BATCH, MLXQ_DECODE_OVERLAP=overlap)
    worker.wait_ready()
    long = {"prompt": PROMPT * 2, "max_tokens": 1900, "temperature": 0, "logit_bias": NO_EOS}
    keep = {"prompt": PROMPT * 3, "max_tokens": 1200, "temperature": 0, "logit_bias": NO_EOS}
    doomed = client.submit_generate(**long)
    kept = client.submit_generate(**keep)
    _first_token(doomed)
    _first_token(kept)
    # Both decode together now; bad jobs join the running batch and fail alone.
    typo = Queue("default", connection=redis_conn, serializer=JSONSerializer).enqueue_call(
        "jobs.generate", args=({"prompt": "a", "max_token": 3},)
    )
    bad = {
        "field": typo.id,
        "long": client.submit_generate("word " * 3000, max_tokens=2).id,
        "bias": client.submit_generate("hi", logit_bias={10**6: 1.0}).id,
    }
    reasons = {}
    for name, job_id in bad.items():
        with pytest.raises(JobFailed) as err:
            client.job(job_id).result(timeout=30)
        reasons[name] = str(err.value)
        assert _stream(redis_conn, job_id)[-1]["event"] == "error"
    assert "max_token: Extra inputs are not permitted" in reasons["field"]
    assert "context length is 4096" in reasons["long"]
    assert "logit_bias token 1000000" in reasons["bias"]
    stats_key = keys.worker_stats_key(_worker_name(redis_conn))
    _eventually(lambda: int(redis_conn.hget(stats_key, "active_sequences") or 0) == 2)
    assert int(redis_conn.hget(stats_key, "max_batch_sequences") or 0) == 4
    assert doomed.cancel().value == "requested"
    cancelled = doomed.result(timeout=30)
    assert cancelled.finish_reason == "cancelled" and 0 < cancelled.usage.completion_tokens < 1900
    result = kept.result(timeout=60)
    assert result.token_ids == _alone(engine, keep).token_ids and result.finish_reason == "length"
    _check_stream(kept, result)
    _check_stream(doomed, cancelled)
    assert "generation batch claimed=" in worker.log()


@pytest.mark.parametrize("overlap", ["false", "true"])
def test_a_score_job_runs_between_decode_steps(
    model_dir: Path, redis_url: str, client: Client, engine: Engine, spawn_worker: Any, overlap: str
) -> None:
    """Also with decode steps launched on the launcher's thread (as on a GPU): the score batch runs
    once no step is launching, and scores as it would alone."""
    worker = spawn_worker(model_dir, redis_url, **BATCH, MLXQ_DECODE_OVERLAP=overlap)
    worker.wait_ready()
    running = client.submit_generate(PROMPT, max_tokens=1900, temperature=0, logit_bias=NO_EOS)
    _first_token(running)
    row = {"prompt": PROMPT + "The capital of France is", "candidates": [" the", " a"]}
    scored = client.submit_score([row])
    got = scored.result(timeout=30).rows[0].logits
    alone = engine.score(ScoreRequest.model_validate({"rows": [row]})).rows[0].logits
    assert got == pytest.approx(alone, rel=1e-4, abs=1e-4)
    assert running.status() == "started"  # it did not wait for the generation batch to drain
    assert running.cancel().value == "requested"
    assert running.result(timeout=30).finish_reason == "cancelled"
    assert "scored=1" in worker.log()


def test_a_job_cancelled_as_a_worker_takes_it_stops_before_its_first_token(
    model_dir: Path, redis_url: str, client: Client, spawn_worker: Any, redis_conn: redis.Redis
) -> None:
    """A producer's cancel sets the job's cancel key before RQ's cancel of a waiting job, for a worker
    that takes the job at that moment: the key is read in the round trip that starts the job, so it
    ends `cancelled` before its first token; the job queued behind it (claimed by the batch's first
    look, whose read rode in the same round trip) runs."""
    doomed = client.submit_generate(PROMPT, max_tokens=50, temperature=0, logit_bias=NO_EOS)
    behind = client.submit_generate(PROMPT, max_tokens=3, temperature=0, logit_bias=NO_EOS)
    redis_conn.set(keys.cancel_key(doomed.id), "1", ex=60)
    worker = spawn_worker(model_dir, redis_url, "--burst", **BATCH)
    assert worker.wait(120) == 0, worker.log()
    cancelled = doomed.result(timeout=5)
    assert (cancelled.finish_reason, cancelled.usage.completion_tokens) == ("cancelled", 0)
    assert [e["event"] for e in _stream(redis_conn, doomed.id)] == ["done"]
    assert doomed.status() == "canceled"
    assert len(behind.result(timeout=5).token_ids) == 3 and behind.status() == "finished"
    assert "generation batch claimed=1" in worker.log()


def _worker_name(conn: redis.Redis) -> str:
    names = [k.decode().removeprefix("mlxq:worker:") for k in conn.keys("mlxq:worker:*")]
    assert len(names) == 1, names
    return names[0]


def test_a_running_batch_looks_at_an_empty_queue_at_most_every_empty_wait(
    model_dir: Path, redis_url: str, client: Client, spawn_worker: Any, redis_conn: redis.Redis
) -> None:
    """Each look at the queue between decode steps is a Redis round trip (`JobClaimer`'s LRANGE): after
    a look that claimed nothing, the batch waits `MLXQ_BATCH_EMPTY_WAIT_S` before the next one."""

    def lranges() -> int:
        stats = redis_conn.info("commandstats")
        return int(stats.get("cmdstat_lrange", {}).get("calls", 0))

    looks = {}
    for wait in ("0", "60"):
        job = client.submit_generate(PROMPT, max_tokens=400, temperature=0, logit_bias=NO_EOS)
        before = lranges()
        worker = spawn_worker(
            model_dir, redis_url, "--burst", name=f"w{wait}", MLXQ_BATCH_EMPTY_WAIT_S=wait, **BATCH
        )
        assert worker.wait(120) == 0, worker.log()
        assert len(job.result(timeout=5).token_ids) == 400
        looks[wait] = lranges() - before
    assert looks["0"] >= 400 // 2 // 2, looks  # every other step (MLXQ_BATCH_ADMIT_EVERY=2), about
    assert looks["60"] <= 3, looks  # the first look found the queue empty: none for the next 60 s


@pytest.mark.parametrize("overlap", ["false", "true"])
def test_a_speculating_worker_gives_plain_results_and_reports_drafted_tokens(
    model_dir: Path, redis_url: str, client: Client, engine: Engine, spawn_worker: Any, overlap: str
) -> None:
    """Prompt lookup on a worker (`MLXQ_SPECULATION`), with and without launches on a second thread:
    greedy jobs give the tokens, text and stream of plain decoding, a job may turn it off, and the
    result and the `done` event count the drafted and kept tokens."""
    requests: list[dict[str, Any]] = [
        {
            "prompt": PROMPT * (1 + i % 3) + str(i),
            "max_tokens": 10 + 7 * i,
            "logit_bias": NO_EOS,
            "temperature": 0,
        }
        for i in range(5)
    ]
    requests.append({**requests[-1], "max_draft_tokens": 0})
    jobs = [client.submit_generate(**fields) for fields in requests]
    # the gate off: on this CPU verify steps cost more than plain ones and it would pause drafting
    speculation = {
        "MLXQ_SPECULATION": "prompt_lookup",
        "MLXQ_DRAFT_MIN_ACCEPTANCE": "0",
        "MLXQ_DRAFT_GATE": "0",
    }
    worker = spawn_worker(
        model_dir, redis_url, "--burst", **BATCH, **speculation, MLXQ_DECODE_OVERLAP=overlap
    )
    assert worker.wait(120) == 0, worker.log()
    results = _as_alone_with_draft_counts(engine, jobs, requests)
    assert sum(r.usage.accepted_tokens for r in results) > 0
    assert jobs[-1].result(timeout=1).usage.draft_tokens == 0


def _as_alone_with_draft_counts(engine: Engine, jobs: list[Any], requests: list[dict[str, Any]]) -> list[Any]:
    """Each job's result is what its request gives alone (tokens, text, finish), its stream matches it,
    and its `done` event counts the drafted and kept tokens its result does; returns the results."""
    results = []
    for job, fields in zip(jobs, requests, strict=True):
        result = job.result(timeout=5)
        want = _alone(engine, fields)
        assert (result.token_ids, result.text, result.finish_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
        )
        _check_stream(job, result)
        done = [i.event for i in job.stream(timeout=5)][-1]
        assert isinstance(done, DoneEvent)
        assert (done.draft_tokens, done.accepted_tokens) == (
            result.usage.draft_tokens,
            result.usage.accepted_tokens,
        )
        results.append(result)
    return results


def test_a_worker_drafting_with_a_dflash_draft_gives_plain_results(
    model_dir: Path, redis_url: str, client: Client, engine: Engine, spawn_worker: Any, tmp_path: Path
) -> None:
    """A DFlash draft named by the setting (`MLXQ_SPECULATION=draft_model`, `MLXQ_DRAFT_MODEL`; random
    weights, reading the target's first layer), steps launched on a second thread: greedy jobs give
    plain decoding's tokens, text and stream, and the result and `done` count the drafted tokens."""
    config = json.loads((model_dir / "config.json").read_text())
    draft = write_random_draft(tmp_path / "dflash", config, 1, block_size=4, target_layers=[0], std=0.2)
    greedy = {"logit_bias": NO_EOS, "temperature": 0}
    requests = [
        {"prompt": PROMPT * (1 + i % 2) + str(i), "max_tokens": 8 + 5 * i, **greedy} for i in range(4)
    ]
    jobs = [client.submit_generate(**fields) for fields in requests]
    speculation = {
        "MLXQ_SPECULATION": "draft_model",
        "MLXQ_DRAFT_MODEL": str(draft),
        "MLXQ_DRAFT_MIN_ACCEPTANCE": "0",
        "MLXQ_DRAFT_GATE": "0",  # drafting at every step: what is checked is the verify steps
    }
    worker = spawn_worker(model_dir, redis_url, "--burst", **BATCH, **speculation, MLXQ_DECODE_OVERLAP="true")
    assert worker.wait(120) == 0, worker.log()
    results = _as_alone_with_draft_counts(engine, jobs, requests)
    assert all(r.usage.draft_tokens > 0 for r in results)
