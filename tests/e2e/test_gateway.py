"""The OpenAI-compatible gateway (`mlxq serve`), driven as its users drive it: the real `openai` SDK
(sync, async, streaming) and raw HTTP for SSE resumption, against a private Redis, a real worker on the
tiny model, and real gateway processes. What a request returns is checked against the same job run
through mlxq's own client, never against written-down text.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from gateway_process import GatewayProcess
from redis_server import PrivateRedis
from worker_process import WorkerProcess

from mlxq.producer import Client
from mlxq.producer.gateway import api_keys

QUEUE = "gw"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    """The module's own redis-server: its worker and gateways outlive single tests."""
    s = PrivateRedis(tmp_path_factory.mktemp("redis"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def worker(
    model_dir: Path, server: PrivateRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    w = WorkerProcess(
        model_dir,
        server.url,
        tmp_path_factory.mktemp("w") / "worker.log",
        "--queue",
        QUEUE,
        "--name",
        "gw-worker",
    )
    w.wait_ready()
    conn = redis.Redis.from_url(server.url)
    deadline = time.monotonic() + 30
    while not conn.hget("mlxq:worker:gw-worker", "model"):  # its advertisement, which the gateway reads
        assert time.monotonic() < deadline, w.log()
        time.sleep(0.05)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def gateway(
    server: PrivateRedis, worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    folder = tmp_path_factory.mktemp("g")
    g = GatewayProcess(
        server.url,
        folder / "gateway.log",
        "--max-body-bytes",
        "65536",
        MLXQ_GATEWAY_DATA_DIR=str(folder / "data"),
    )
    g.wait_ready()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def model(model_dir: Path) -> str:
    return model_dir.name  # a worker advertises a model folder by its name


@pytest.fixture
def conn(server: PrivateRedis) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(server.url)
    yield c
    c.close()


@pytest.fixture
def key(conn: redis.Redis, request: pytest.FixtureRequest) -> Iterator[str]:
    name = request.node.name[:60].replace("[", "-").replace("]", "")
    token, _ = api_keys.create(conn, name)
    yield token
    api_keys.revoke(conn, name)


@pytest.fixture
def sdk(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


@pytest.fixture
def mlxq_client(server: PrivateRedis) -> Iterator[Client]:
    with Client(server.url, queue=QUEUE) as c:
        yield c


def _greedy(no_eos: dict[int, float], max_tokens: int = 12) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": max_tokens, "logit_bias": no_eos}


def _openai_bias(no_eos: dict[int, float]) -> dict[str, float]:
    return {str(k): v for k, v in no_eos.items()}


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


# --- models and routing --------------------------------------------------------------------------


def test_models_lists_what_live_workers_serve_and_an_unknown_model_is_a_404(
    sdk: openai.OpenAI, model: str
) -> None:
    assert [m.id for m in sdk.models.list().data] == [model]
    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert "no-such-model" in str(e.value) and model in str(e.value)


# --- chat and completions: sync, async, streaming --------------------------------------------------


def test_chat_returns_what_the_same_job_returns_through_mlxq(
    sdk: openai.OpenAI, mlxq_client: Client, model: str, no_eos: dict[int, float]
) -> None:
    direct = mlxq_client.submit_generate(messages=MESSAGES, **_greedy(no_eos)).result(timeout=60)
    answer = sdk.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0.0, max_tokens=12, logit_bias=_openai_bias(no_eos)
    )
    assert answer.id.startswith("chatcmpl-") and answer.model == model
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == direct.text
    assert answer.choices[0].finish_reason == "length" == direct.finish_reason
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (direct.usage.prompt_tokens, 12)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12


def test_completion_with_stop_and_seed(
    sdk: openai.OpenAI, mlxq_client: Client, model: str, no_eos: dict[int, float]
) -> None:
    prompt = "Once upon a time"
    sampled = dict(temperature=1.0, seed=7, max_tokens=16, logit_bias=no_eos)
    direct = mlxq_client.submit_generate(prompt, **sampled).result(timeout=60)
    again = sdk.completions.create(
        model=model, prompt=prompt, temperature=1.0, seed=7, max_tokens=16, logit_bias=_openai_bias(no_eos)
    )
    assert again.object == "text_completion" and again.choices[0].text == direct.text  # the seed decides
    stop = direct.text[len(direct.text) // 2 :][:3]
    assert stop.strip(), direct.text
    cut = sdk.completions.create(
        model=model,
        prompt=prompt,
        temperature=1.0,
        seed=7,
        max_tokens=16,
        logit_bias=_openai_bias(no_eos),
        stop=[stop],
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == direct.text[: direct.text.index(stop)]


def test_async_streaming_chat_with_usage_matches_the_whole_answer(
    gateway: GatewayProcess, key: str, model: str, no_eos: dict[int, float]
) -> None:
    async def run() -> tuple[str, list[Any], str]:
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
        args: dict[str, Any] = dict(
            model=model, messages=MESSAGES, temperature=0.0, max_tokens=20, logit_bias=_openai_bias(no_eos)
        )
        whole = await client.chat.completions.create(**args)
        stream = await client.chat.completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
        return whole.choices[0].message.content or "", chunks, whole.id

    text, chunks, _ = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1


def test_sync_streaming_completion(sdk: openai.OpenAI, model: str, no_eos: dict[int, float]) -> None:
    args: dict[str, Any] = dict(
        model=model, prompt="Hello", temperature=0.0, max_tokens=10, logit_bias=_openai_bias(no_eos)
    )
    whole = sdk.completions.create(**args)
    pieces = [c.choices[0].text for c in sdk.completions.create(**args, stream=True)]
    assert "".join(pieces) == whole.choices[0].text


def test_response_format_constrains_the_answer(
    sdk: openai.OpenAI, model: str, no_eos: dict[int, float]
) -> None:
    pytest.importorskip("llguidance")  # the worker's `structured` extra
    answer = sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=8,
        response_format={"type": "regex", "regex": "(yes|no)"},  # type: ignore[typeddict-item]
    )
    assert answer.choices[0].message.content in ("yes", "no") and answer.choices[0].finish_reason == "stop"
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    answer = sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=32,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )
    assert json.loads(answer.choices[0].message.content or "") in ({"ok": True}, {"ok": False})
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "xml"})  # type: ignore[typeddict-item]
    assert "response_format" in str(e.value)


# --- what mlxq does not do is a 400 that says so -----------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "extra", "param"),
    [
        ("chat", {"n": 17}, "n"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("completion", {"logprobs": 99}, "logprobs"),
        ("completion", {"echo": True, "max_tokens": 0, "stream": True}, "stream"),
        ("completion", {"echo": True, "max_tokens": 0, "n": 2}, "n"),
        ("chat", {"extra_body": {"max_tokenz": 3}}, "max_tokenz"),
    ],
)
def test_unsupported_parameters_are_a_400_naming_them_and_enqueue_nothing(
    sdk: openai.OpenAI, model: str, conn: redis.Redis, kind: str, extra: dict[str, Any], param: str
) -> None:
    before = conn.llen(f"rq:queue:{QUEUE}"), len(conn.keys("rq:job:*"))
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            sdk.chat.completions.create(model=model, messages=MESSAGES, **extra)
        else:
            sdk.completions.create(model=model, prompt="hi", **extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and param in e.value.body["message"]  # type: ignore[index]
    assert (conn.llen(f"rq:queue:{QUEUE}"), len(conn.keys("rq:job:*"))) == before


def test_a_bad_value_is_a_400_with_the_contracts_message(sdk: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=model, messages=MESSAGES, temperature=-1)
    assert "temperature" in str(e.value)


# --- auth and limits -----------------------------------------------------------------------------------


def test_no_key_or_a_revoked_key_gets_no_job(gateway: GatewayProcess, conn: redis.Redis, model: str) -> None:
    jobs_before = len(conn.keys("rq:job:*"))
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": model, "messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    token, _ = api_keys.create(conn, "short-lived")
    assert api_keys.revoke(conn, "short-lived")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0).models.list()
    assert len(conn.keys("rq:job:*")) == jobs_before
    assert all(
        not k.startswith(b"sk-") and b"sk-mlxq" not in conn.dump(k) for k in conn.keys("mlxq:gw:key:*")
    )


def test_a_key_limited_to_other_models_or_queues_is_refused(
    gateway: GatewayProcess, conn: redis.Redis, model: str
) -> None:
    for name, limits in (
        ("other-model", {"models": ["another"]}),
        ("other-queue", {"queues": ["elsewhere"]}),
    ):
        token, _ = api_keys.create(conn, name, **limits)
        sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
        assert sdk.models.list().data == []
        with pytest.raises(openai.PermissionDeniedError):
            sdk.chat.completions.create(model=model, messages=MESSAGES)
        api_keys.revoke(conn, name)


def test_a_body_over_the_limit_is_a_413(gateway: GatewayProcess, key: str, model: str) -> None:
    big = {"model": model, "messages": [{"role": "user", "content": "x" * 70_000}]}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=big, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]


def test_jobs_in_flight_over_the_keys_limit_are_a_429_until_one_ends(
    gateway: GatewayProcess, conn: redis.Redis, model: str, no_eos: dict[int, float]
) -> None:
    token, _ = api_keys.create(conn, "one-at-a-time", max_jobs=1)
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
    long = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=400, logit_bias=_openai_bias(no_eos), stream=True
    )
    first = next(iter(long))  # the job runs
    with pytest.raises(openai.RateLimitError):
        sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert first.id.startswith("chatcmpl-")
    rest = list(long)  # the first job ends ...
    assert rest[-1].choices[0].finish_reason == "length"
    done = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2
    )  # ... so this one may run
    assert done.usage is not None and done.usage.completion_tokens <= 2
    api_keys.revoke(conn, "one-at-a-time")


def test_health_and_readiness(gateway: GatewayProcess, model: str) -> None:
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway.url}/ready")
    assert ready.status_code == 200 and ready.json()["models"] == [model]


# --- resumable streams -------------------------------------------------------------------------------


def _events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(id, data) of each SSE event, read from raw lines (the framing is what is under test)."""
    event_id, data = None, []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])


def _text_of(events: list[tuple[str | None, str]]) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            choices = json.loads(data)["choices"]
            out.extend(c["delta"].get("content") or "" for c in choices)
    return "".join(out)


def _start_stream(
    gateway: GatewayProcess, key: str, model: str, no_eos: dict[int, float], max_tokens: int
) -> tuple[httpx.Client, httpx.Response]:
    http = httpx.Client(timeout=30.0)
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "logit_bias": _openai_bias(no_eos),
    }
    request = http.build_request(
        "POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )
    return http, http.send(request, stream=True)


def _resume(url: str, key: str, completion_id: str, last_id: str) -> list[tuple[str | None, str]]:
    headers = {"authorization": f"Bearer {key}", "last-event-id": last_id}
    with httpx.stream("GET", f"{url}/v1/streams/{completion_id}", headers=headers, timeout=60.0) as r:
        assert r.status_code == 200, r.read()
        return list(_events(r))


def test_last_event_id_resumes_with_nothing_lost_or_repeated(
    gateway: GatewayProcess, key: str, model: str, mlxq_client: Client, no_eos: dict[int, float]
) -> None:
    http, response = _start_stream(gateway, key, model, no_eos, 60)
    head = []
    for event in _events(response):
        head.append(event)
        if len(head) == 5:
            break
    response.close()
    http.close()
    job_id = response.headers["x-mlxq-job-id"]
    completion_id = json.loads(head[0][1])["id"]
    assert head[-1][0] is not None
    tail = _resume(gateway.url, key, completion_id, head[-1][0])
    ids = [i for i, _ in head + tail if i is not None]
    assert len(ids) == len(set(ids)) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert tail[-1][1] == "[DONE]"
    assert _text_of(head + tail) == mlxq_client.job(job_id).result(timeout=60).text
    # a client that lost only the ending resumes at the finish chunk's id and gets just [DONE]
    finish_id = [i for i, d in tail if i is not None][-1]
    assert _resume(gateway.url, key, completion_id, finish_id) == [(None, "[DONE]")]


def test_a_gateway_killed_mid_stream_is_resumed_through_another(
    server: PrivateRedis,
    worker: WorkerProcess,
    key: str,
    model: str,
    mlxq_client: Client,
    no_eos: dict[int, float],
    tmp_path: Path,
) -> None:
    first = GatewayProcess(server.url, tmp_path / "first.log", MLXQ_GATEWAY_DATA_DIR=str(tmp_path))
    second = GatewayProcess(server.url, tmp_path / "second.log", MLXQ_GATEWAY_DATA_DIR=str(tmp_path))
    try:
        first.wait_ready()
        second.wait_ready()
        http, response = _start_stream(first, key, model, no_eos, 200)
        head: list[tuple[str | None, str]] = []
        events = _events(response)
        for event in events:
            head.append(event)
            if len(head) == 3:
                first.kill()  # mid-response: the connection drops with the process
                break
        with pytest.raises(httpx.HTTPError):
            for event in events:  # whatever was in flight, then the cut
                head.append(event)
        http.close()
        last_id = [i for i, _ in head if i is not None][-1]
        completion_id = json.loads(head[0][1])["id"]
        tail = _resume(second.url, key, completion_id, last_id)
        ids = [i for i, _ in head + tail if i is not None]
        assert len(ids) == len(set(ids))
        assert tail[-1][1] == "[DONE]"
        result = mlxq_client.job(completion_id.removeprefix("chatcmpl-")).result(timeout=60)
        assert _text_of(head + tail) == result.text and result.usage.completion_tokens == 200
    finally:
        first.stop()
        second.stop()


# --- the Batch API -------------------------------------------------------------------------------------


def _batch_lines(model: str, no_eos: dict[int, float], n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"Count to {i}."}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logit_bias": _openai_bias(no_eos),
            },
        }
        for i in range(n)
    ]


def _upload_batch(
    sdk: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions"
) -> Any:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = sdk.files.create(file=("in.jsonl", content), purpose="batch")
    assert uploaded.bytes == len(content)
    return sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )


def _wait_batch(sdk: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := sdk.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


def _wait_batch_progress(sdk: openai.OpenAI, batch_id: str, completed: int) -> None:
    deadline = time.monotonic() + 120
    while (batch := sdk.batches.retrieve(batch_id)).request_counts.completed < completed:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def _lines_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()] if file_id else []


def _expected(mlxq_client: Client, lines: list[dict[str, Any]], no_eos: dict[int, float]) -> dict[str, str]:
    """Each request's text, run as a plain mlxq job."""
    handles = {
        line["custom_id"]: mlxq_client.submit_generate(
            messages=line["body"]["messages"], **_greedy(no_eos, line["body"]["max_tokens"])
        )
        for line in lines
    }
    return {cid: h.result(timeout=120).text for cid, h in handles.items()}


def test_a_batch_runs_into_openai_output_and_error_files(
    sdk: openai.OpenAI, model: str, mlxq_client: Client, no_eos: dict[int, float]
) -> None:
    lines = _batch_lines(model, no_eos, 4, 8)
    refused = {**lines[0], "custom_id": "two-choices", "body": {**lines[0]["body"], "n": 2}}
    batch = _upload_batch(sdk, [*lines, refused])
    assert batch.status == "in_progress" and batch.request_counts.total == 5
    batch = _wait_batch(sdk, batch.id, ("completed",))
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    out = _lines_of(sdk, batch.output_file_id)
    expected = _expected(mlxq_client, lines, no_eos)
    assert {
        o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out
    } == expected
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 8 for o in out)
    prompt_tokens = sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out)
    assert batch.usage is not None  # the completed requests' tokens, summed; the refused one adds none
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt_tokens, 4 * 8)
    assert batch.usage.total_tokens == prompt_tokens + 32 and prompt_tokens > 0
    (error,) = _lines_of(sdk, batch.error_file_id)
    assert error["custom_id"] == "two-choices" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "n"


def test_a_malformed_batch_file_is_a_400_naming_the_line(
    sdk: openai.OpenAI, model: str, no_eos: dict[int, float]
) -> None:
    lines = _batch_lines(model, no_eos, 2, 4)
    with pytest.raises(openai.BadRequestError) as e:
        _upload_batch(sdk, [lines[0], {**lines[1], "custom_id": lines[0]["custom_id"]}])
    assert "line 2" in str(e.value) and "appears twice" in str(e.value)


def test_a_cancelled_batch_stops_and_keeps_what_finished(
    sdk: openai.OpenAI, model: str, no_eos: dict[int, float], conn: redis.Redis
) -> None:
    batch = _upload_batch(sdk, _batch_lines(model, no_eos, 30, 200))
    _wait_batch_progress(sdk, batch.id, 1)
    assert sdk.batches.cancel(batch.id).status == "cancelling"
    batch = _wait_batch(sdk, batch.id, ("cancelled",))
    assert 1 <= batch.request_counts.completed < 30
    assert len(_lines_of(sdk, batch.output_file_id)) == batch.request_counts.completed
    deadline = time.monotonic() + 30
    while conn.llen(f"rq:queue:{QUEUE}"):  # its outstanding jobs were cancelled, not left queued
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_batch_survives_its_gateway_being_killed(
    server: PrivateRedis,
    worker: WorkerProcess,
    key: str,
    model: str,
    mlxq_client: Client,
    no_eos: dict[int, float],
    tmp_path: Path,
) -> None:
    env = {"MLXQ_GATEWAY_DATA_DIR": str(tmp_path / "shared"), "MLXQ_GATEWAY_BATCH_LEASE_S": "1"}
    first = GatewayProcess(server.url, tmp_path / "first.log", **env)
    second: GatewayProcess | None = None
    try:
        first.wait_ready()
        sdk = openai.OpenAI(base_url=f"{first.url}/v1", api_key=key, max_retries=0)
        lines = _batch_lines(model, no_eos, 12, 24)
        batch = _upload_batch(sdk, lines)
        _wait_batch_progress(sdk, batch.id, 2)
        first.kill()
        second = GatewayProcess(server.url, tmp_path / "second.log", **env)
        second.wait_ready()
        sdk = openai.OpenAI(base_url=f"{second.url}/v1", api_key=key, max_retries=0)
        done = _wait_batch(sdk, batch.id, ("completed",))
        assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
        out = _lines_of(sdk, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)  # each once
        texts = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out}
        assert texts == _expected(mlxq_client, lines, no_eos)
    finally:
        first.stop()
        if second is not None:
            second.stop()


# --- the key CLI -----------------------------------------------------------------------------------------


def test_api_key_cli_creates_lists_and_revokes(
    gateway: GatewayProcess, server: PrivateRedis, model: str
) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "mlxq.producer.cli", "--redis-url", server.url, "api-key", *args]
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    made = cli("create", "from-cli", "--model", model, "--max-jobs", "3")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("sk-mlxq-") and "shown only now" in made.stderr
    assert cli("create", "from-cli").returncode == 2  # names are unique
    (listed,) = [json.loads(line) for line in cli("list").stdout.splitlines() if '"from-cli"' in line]
    assert listed["models"] == [model] and listed["max_jobs"] == 3 and token not in json.dumps(listed)
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
    assert [m.id for m in sdk.models.list().data] == [model]
    assert cli("revoke", "from-cli").returncode == 0
    assert cli("revoke", "from-cli").returncode == 1
    time.sleep(1.1)  # the gateway reuses a key's record for up to key_cache_s (1 s)
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_a_job_that_fails_in_the_worker_is_a_400_the_sdk_does_not_retry(
    gateway: GatewayProcess, key: str, model: str, conn: redis.Redis
) -> None:
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=2)
    jobs_before = len(conn.keys("rq:job:*"))
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=model, prompt="hello " * 5000, max_tokens=2)  # over the context length
    assert "context length" in str(e.value)
    assert e.value.response.headers["x-should-retry"] == "false"
    assert len(conn.keys("rq:job:*")) == jobs_before + 1  # run once, not again by the SDK's retries


def test_a_last_event_id_the_stream_never_sent_is_a_400(
    gateway: GatewayProcess, key: str, model: str, no_eos: dict[int, float]
) -> None:
    http, response = _start_stream(gateway, key, model, no_eos, 4)
    completion_id = json.loads(next(_events(response))[1])["id"]
    response.close()
    http.close()
    headers = {"authorization": f"Bearer {key}", "last-event-id": "not-an-id"}
    r = httpx.get(f"{gateway.url}/v1/streams/{completion_id}", headers=headers)
    assert r.status_code == 400 and "Last-Event-ID" in r.json()["error"]["message"]
    r = httpx.get(f"{gateway.url}/v1/streams/chatcmpl-nosuchjob", headers=headers)
    assert r.status_code == 404


def test_metrics_count_requests_and_jobs(sdk: openai.OpenAI, gateway: GatewayProcess, model: str) -> None:
    pytest.importorskip("prometheus_client")  # the `metrics` extra

    def value(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    before = httpx.get(f"{gateway.url}/metrics").text
    sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=MESSAGES)
    after = httpx.get(f"{gateway.url}/metrics").text
    ok = 'mlxq_gateway_requests_total{route="chat",status="200"}'
    missing = 'mlxq_gateway_requests_total{route="chat",status="404"}'
    jobs = f'mlxq_gateway_jobs_submitted_total{{kind="chat",model="{model}"}}'
    assert value(after, ok) == value(before, ok) + 1
    assert value(after, missing) == value(before, missing) + 1
    assert value(after, jobs) == value(before, jobs) + 1


def test_a_batch_lines_logprobs_are_the_same_requests_answer_outside_a_batch(
    sdk: openai.OpenAI, model: str, no_eos: dict[int, float]
) -> None:
    """A Batch API line asking `logprobs` (the generation job reports them) gets the logprobs the same
    request gets outside a batch."""
    (line,) = _batch_lines(model, no_eos, 1, 6)
    line["body"] = {**line["body"], "logprobs": True, "top_logprobs": 2}
    batch = _wait_batch(sdk, _upload_batch(sdk, [line]).id, ("completed",))
    (out,) = _lines_of(sdk, batch.output_file_id)
    content = out["response"]["body"]["choices"][0]["logprobs"]["content"]
    direct = sdk.chat.completions.create(**line["body"])
    assert direct.choices[0].logprobs is not None and direct.choices[0].logprobs.content is not None
    want = [
        (t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in direct.choices[0].logprobs.content
    ]
    got = [(t["token"], t["logprob"], [a["token"] for a in t["top_logprobs"]]) for t in content]
    assert len(got) == 6 and [g[0] for g in got] == [w[0] for w in want]
    assert all(abs(g[1] - w[1]) < 1e-4 and g[2] == w[2] for g, w in zip(got, want, strict=True))


def test_a_batch_completions_text_offsets_start_after_its_prompt(
    sdk: openai.OpenAI, model: str, no_eos: dict[int, float]
) -> None:
    """A Batch API completions line asking `logprobs` gets the same request's answer outside a batch:
    `text_offset`s from the prompt's first character (OpenAI's legacy completions)."""
    prompt = "Count to three."
    body = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0.0, "logprobs": 1}
    body["logit_bias"] = _openai_bias(no_eos)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body}
    batch = _wait_batch(sdk, _upload_batch(sdk, [line], "/v1/completions").id, ("completed",))
    (out,) = _lines_of(sdk, batch.output_file_id)
    got = out["response"]["body"]["choices"][0]["logprobs"]
    direct = sdk.completions.create(**body)
    want = direct.choices[0].logprobs
    assert want is not None and want.tokens is not None and len(want.tokens) == 5
    assert got["tokens"] == want.tokens and got["text_offset"] == want.text_offset
    assert want.text_offset == [len(prompt) + len("".join(want.tokens[:i])) for i in range(5)]
