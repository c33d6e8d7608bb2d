"""`n` > 1 through the gateway: a job per choice, seeded from the request's seed, usage counted as
OpenAI does; streamed, the choices' chunks interleave by `index` and resume from one `Last-Event-ID`.
Each choice is checked against the same job run through mlxq's own client.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import redis
import test_gateway
from gateway_process import GatewayProcess

from mlxq.producer import Client
from mlxq.producer.gateway import api_keys

# The gateway module's Redis, worker and gateway fixtures (module-scoped: this module starts its own).
server, worker, gateway = test_gateway.server, test_gateway.worker, test_gateway.gateway
model, conn, key, sdk, mlxq_client = (
    test_gateway.model,
    test_gateway.conn,
    test_gateway.key,
    test_gateway.sdk,
    test_gateway.mlxq_client,
)
_events = test_gateway._events

PROMPT = "Once upon a time"


def _expected(mlxq_client: Client, seed: int, n: int, no_eos: dict[int, float], max_tokens: int) -> list[Any]:
    return [
        mlxq_client.submit_generate(
            PROMPT, max_tokens=max_tokens, temperature=1.0, seed=seed + i, logit_bias=no_eos
        ).result(timeout=60)
        for i in range(n)
    ]


def test_n_choices_are_a_job_each_seeded_from_the_request(
    sdk: openai.OpenAI, model: str, mlxq_client: Client, no_eos: dict[int, float]
) -> None:
    bias = {str(k): v for k, v in no_eos.items()}
    got = sdk.completions.create(
        model=model, prompt=PROMPT, n=3, seed=11, temperature=1.0, max_tokens=6, logit_bias=bias
    )
    want = _expected(mlxq_client, 11, 3, no_eos, 6)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert len({c.text for c in got.choices}) > 1  # different seeds, different samples
    assert got.usage is not None
    assert got.usage.prompt_tokens == want[0].usage.prompt_tokens  # the prompt counted once, as OpenAI does
    assert got.usage.completion_tokens == sum(w.usage.completion_tokens for w in want) == 18


def _body(model: str, no_eos: dict[int, float]) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": PROMPT,
        "n": 2,
        "seed": 21,
        "temperature": 1.0,
        "max_tokens": 40,
        "logit_bias": {str(k): v for k, v in no_eos.items()},
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _texts(events: list[tuple[str | None, str]]) -> tuple[dict[int, str], list[dict[str, Any]]]:
    texts: dict[int, str] = {}
    usage = []
    for _, data in events:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage.append(chunk["usage"])
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts, usage


def test_streamed_choices_interleave_by_index_and_resume_from_one_id(
    gateway: GatewayProcess, key: str, model: str, mlxq_client: Client, no_eos: dict[int, float]
) -> None:
    headers = {"authorization": f"Bearer {key}"}
    head: list[tuple[str | None, str]] = []
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", json=_body(model, no_eos), headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        for event in _events(r):
            head.append(event)
            if len(head) == 10:
                break  # the client goes away mid-stream
    last_id = [i for i, _ in head if i is not None][-1]
    assert len(last_id.split(",")) == 2  # each choice's position in its own job's stream
    completion_id = json.loads(head[0][1])["id"]
    with httpx.stream(
        "GET",
        f"{gateway.url}/v1/streams/{completion_id}",
        headers={**headers, "last-event-id": last_id},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        tail = list(_events(r))
    assert tail[-1][1] == "[DONE]" and [d for _, d in head + tail].count("[DONE]") == 1
    ids = [i for i, _ in head + tail if i is not None]
    assert len(ids) == len(set(ids))  # nothing sent twice
    assert {json.loads(d)["id"] for _, d in head + tail if d != "[DONE]"} == {completion_id}
    texts, usage = _texts(head + tail)
    want = _expected(mlxq_client, 21, 2, no_eos, 40)
    assert texts == {0: want[0].text, 1: want[1].text}
    assert usage == [
        {
            "prompt_tokens": want[0].usage.prompt_tokens,
            "completion_tokens": 80,
            "total_tokens": want[0].usage.prompt_tokens + 80,
            "prompt_tokens_details": {"cached_tokens": usage[0]["prompt_tokens_details"]["cached_tokens"]},
        }
    ]


def test_a_keys_job_limit_counts_every_choice(
    gateway: GatewayProcess, conn: redis.Redis, model: str, no_eos: dict[int, float]
) -> None:
    token, _ = api_keys.create(conn, "two-at-a-time", max_jobs=2)
    try:
        sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
        jobs_before = len(conn.keys("rq:job:*"))
        with pytest.raises(openai.RateLimitError):
            sdk.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=2)
        assert len(conn.keys("rq:job:*")) == jobs_before  # no choice was enqueued
        got = sdk.completions.create(
            model=model, prompt=PROMPT, n=2, max_tokens=2
        )  # the claims were given back
        assert len(got.choices) == 2
    finally:
        api_keys.revoke(conn, "two-at-a-time")


def test_a_batch_of_prompts_gives_each_its_n_choices_in_openais_order(
    sdk: openai.OpenAI, model: str, mlxq_client: Client, no_eos: dict[int, float]
) -> None:
    second = "A second prompt"
    ids = mlxq_client.submit_score([{"prompt": second, "prompt_logprobs": True, "token_texts": True}])
    pl = ids.result(timeout=60).rows[0].prompt_logprobs
    assert pl is not None and pl.first_token is not None
    token_prompt = [pl.first_token, *pl.tokens]  # the same prompt as token ids
    bias = {str(k): v for k, v in no_eos.items()}
    got = sdk.completions.create(
        model=model,
        prompt=[PROMPT, token_prompt],
        n=2,
        seed=3,
        temperature=1.0,
        max_tokens=4,
        logit_bias=bias,
    )
    want = _expected(mlxq_client, 3, 2, no_eos, 4)
    for i in range(2):
        alone = mlxq_client.submit_generate(
            second, max_tokens=4, temperature=1.0, seed=3 + i, logit_bias=no_eos
        ).result(timeout=60)
        want.append(alone)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert got.usage is not None
    assert got.usage.prompt_tokens == want[0].usage.prompt_tokens + want[2].usage.prompt_tokens
    assert got.usage.completion_tokens == 16
