"""Bad input through the real queue: every malformed job fails alone, with a reason a person can read.

Hypothesis draws a few hundred payloads (malformed JSON, invalid UTF-8, pickles, unknown functions,
wrong types, unknown fields, NaN/negative/huge sampling values, empty and over-long prompts, special
tokens and multi-token candidates, ...), they are enqueued as raw RQ job hashes, one burst worker runs
them all, and then: each job is finished or failed; each failure names one of mlxq's own error types
(never a bare KeyError or TypeError from deep inside); the worker exited cleanly; a good job queued
last finished. The count of inputs tried is printed.
"""

from __future__ import annotations

import json
import math
import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq.job import Job
from rq.serializers import JSONSerializer

from mlxq.jobs import keys, parse_generate, parse_score
from mlxq.jobs.errors import InvalidRequest
from mlxq.producer import Client
from mlxq.worker.allowlist import forbidden_reason
from mlxq.worker.engine import Engine
from mlxq.worker.engine.generation_batch import generate
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

REDIS_DB = 4
# What a failed job may say: mlxq's own errors, each with a message written for a person.
READABLE = ("InvalidRequest", "ContextTooLong", "InvalidCandidate", "ForbiddenJob", "OutOfMemory")

texts = st.text(st.characters(codec="utf-8"), max_size=40)
numbers = st.one_of(
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1]),
)
junk = st.one_of(st.none(), st.booleans(), numbers, texts, st.lists(st.integers(), max_size=3), st.just({}))
SPECIAL = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]

generate_fields = {
    "prompt": st.one_of(texts, st.sampled_from(["", "word " * 400]), junk),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", ""]), "content": texts}),
            max_size=3,
        ),
        junk,
    ),
    "max_tokens": st.one_of(st.integers(-3, 4), st.just(10**9), junk),
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "min_p": numbers,
    "repetition_penalty": numbers,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "seed": st.one_of(st.integers(), junk),
    "logit_bias": st.one_of(
        st.dictionaries(st.one_of(st.integers(-5, 10**6).map(str), texts), numbers, max_size=2), junk
    ),
    "stop": st.one_of(st.lists(texts, max_size=3), texts, junk),
    "max_token": junk,  # a typo: unknown fields are errors
}


def _subset(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.sets(st.sampled_from(sorted(fields)), max_size=4).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names})
    )


candidates = st.lists(st.one_of(st.sampled_from([" the", " a", " Paris", "", *SPECIAL]), texts), max_size=4)
score_payloads = st.one_of(
    st.fixed_dictionaries(
        {"rows": st.lists(st.fixed_dictionaries({"prompt": texts, "candidates": candidates}), max_size=3)}
    ),
    st.fixed_dictionaries({"rows": junk}),
    st.fixed_dictionaries(
        {"rows": st.lists(st.fixed_dictionaries({"prompt": junk, "candidates": junk}), max_size=2)}
    ),
)


def _data(func: Any, args: Any) -> bytes:
    return json.dumps([func, None, args, {}]).encode()


raw_blobs = st.one_of(
    st.binary(max_size=30),  # not JSON at all, often not UTF-8
    st.just(b'["jobs.generate", null, [{"prompt": "\xff\xfe"}], {}]'),  # invalid UTF-8 inside JSON
    st.sampled_from(  # JSON escapes of lone surrogates: strings no tokenizer takes
        [
            b'["jobs.score", null, [{"rows": [{"prompt": "a\\ud800", "candidates": [" the"]}]}], {}]',
            b'["jobs.score", null, [{"rows": [{"prompt": "a", "candidates": [" \\udfff"]}]}], {}]',
            b'["jobs.generate", null, [{"prompt": "\\udc80 hi", "stop": ["\\ud83d"]}], {}]',
            b'["jobs.generate", null, [{"messages": [{"role": "user", "content": "hi \\ud83d"}]}], {}]',
        ]
    ),
    st.just(pickle.dumps(("jobs.generate", None, ({"prompt": "hi"},), {}))),
    st.sampled_from(["os.system", "builtins.eval", "jobs.runtime.install", "jobs", ""]).map(
        lambda f: _data(f, ["echo owned"])
    ),
    st.one_of(junk, st.just([1, 2])).map(lambda v: json.dumps(v).encode()),
    st.sampled_from([keys.GENERATE_FUNC, keys.SCORE_FUNC]).map(lambda f: _data(f, [])),
    st.sampled_from([keys.GENERATE_FUNC, keys.SCORE_FUNC]).map(lambda f: _data(f, [{}, {}])),
)

payload = st.one_of(
    _subset(generate_fields).map(lambda p: _data(keys.GENERATE_FUNC, [p])),
    score_payloads.map(lambda p: _data(keys.SCORE_FUNC, [p])),
    junk.map(lambda p: _data(keys.GENERATE_FUNC, [p])),
    raw_blobs,
)


def _outcome_in_process(engine: Engine, blob: bytes) -> str:
    """What the worker does with this payload, run in this process: 'finished' or the error's type name."""
    job = Job(id="fuzz", connection=redis.Redis(), serializer=JSONSerializer)
    job.data = blob
    if forbidden_reason(job) is not None:
        return "ForbiddenJob"
    try:
        if job.func_name == keys.GENERATE_FUNC:
            generate(engine, parse_generate(job.args[0]), lambda text, ids: None)
        else:
            engine.score(parse_score(job.args[0]))
    except Exception as e:
        return type(e).__name__
    return "finished"


def _enqueue_raw(conn: redis.Redis, data: bytes) -> str:
    job_id = uuid.uuid4().hex
    pipe = conn.pipeline()
    pipe.hset(
        keys.rq_job_key(job_id),
        mapping={
            "data": data,
            "origin": "default",
            "status": "queued",
            "created_at": "2026-01-01T00:00:00.000000Z",
        },
    )
    pipe.rpush(keys.rq_queue_key("default"), job_id)
    pipe.execute()
    return job_id


def _reason(conn: redis.Redis, job_id: str) -> str:
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    result = job.latest_result()
    text = (result.exc_string if result is not None else None) or ""
    return text.strip().splitlines()[-1] if text.strip() else ""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 256})


@pytest.fixture(scope="module")
def drawn(model_dir: Path) -> list[bytes]:
    """Payloads drawn by hypothesis, each checked on the worker's own code path in this process."""
    engine = Engine.load(str(model_dir))
    seen: list[bytes] = []

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(blob=payload)
    def check(blob: bytes) -> None:
        kind = _outcome_in_process(engine, blob)
        assert kind in (*READABLE, "finished"), f"{kind} for payload {blob[:200]!r}"
        seen.append(blob)

    check()
    return seen


def test_bad_input_fails_only_its_job_through_the_queue(
    drawn: list[bytes], model_dir: Path, redis_url: str, redis_conn: redis.Redis, spawn_worker: Any
) -> None:
    blobs = list(dict.fromkeys(drawn))[-200:]  # distinct, the later (more varied) draws
    ids = [_enqueue_raw(redis_conn, blob) for blob in blobs]
    with Client(redis_url) as client:
        good = client.submit_generate("a good job after all that", max_tokens=2)
        worker = spawn_worker(model_dir, redis_url, "--burst", MLXQ_JOB_TIMEOUT_S="60")
        assert worker.wait(300) == 0, worker.log()[-3000:]
        assert good.result(timeout=10).usage.completion_tokens <= 2
    outcomes: dict[str, int] = {}
    for job_id, blob in zip(ids, blobs, strict=True):
        status = redis_conn.hget(keys.rq_job_key(job_id), "status")
        status = status.decode() if status else "missing"
        assert status in ("finished", "failed"), (status, blob[:200])
        if status == "failed":
            reason = _reason(redis_conn, job_id)
            kind = reason.split(":", 1)[0].rsplit(".", 1)[-1]
            assert kind in READABLE, f"unreadable failure {reason!r} for payload {blob[:200]!r}"
            assert len(reason) > len(kind) + 10
            outcomes[kind] = outcomes.get(kind, 0) + 1
        else:
            result = json.loads(redis_conn.get(keys.result_key(job_id)))
            assert all(math.isfinite(x) for r in result.get("rows", []) for x in r["logits"])
            outcomes["finished"] = outcomes.get("finished", 0) + 1
    print(
        f"\nbad-input fuzz: {len(drawn)} inputs checked in process, "
        f"{len(blobs)} through one worker: {outcomes}"
    )
    assert len(outcomes) >= 3, outcomes  # the draws reach several different error paths


def test_a_deeply_nested_field_fails_with_a_readable_error() -> None:
    nested: Any = {"a": 1}
    for _ in range(5000):
        nested = {"a": nested}
    for parse, payload in (
        (parse_generate, {"prompt": "x", "logit_bias": nested}),
        (parse_score, {"rows": [{"prompt": "x", "candidates": [" a"]}], "extra": nested}),
    ):
        with pytest.raises(InvalidRequest, match=r"invalid (generate|score) request: .* is nested more than"):
            parse(payload)
