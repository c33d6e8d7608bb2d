"""`POST /v1/completions` with `echo` and `logprobs`, and generated tokens' logprobs (chat and completions,
streamed or not) through the gateway: driven by the real `openai`
package and by lm-eval's own `local-completions` model, against a real worker on the tiny model. What
comes back is checked against the same scores asked of mlxq directly (score jobs), and the one greedy
token against a generation job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import test_gateway
from gateway_process import GatewayProcess

from mlxq.producer import Client

# The gateway module's Redis, worker and gateway fixtures (module-scoped: this module starts its own).
server, worker, gateway = test_gateway.server, test_gateway.worker, test_gateway.gateway
model, conn, key, sdk, mlxq_client = (
    test_gateway.model,
    test_gateway.conn,
    test_gateway.key,
    test_gateway.sdk,
    test_gateway.mlxq_client,
)

PROMPT = "Queues hold jobs, and workers take them one after another."


def _prompt_scores(mlxq_client: Client, row: dict[str, Any]) -> Any:
    result = mlxq_client.submit_score([{**row, "prompt_logprobs": True, "token_texts": True}]).result(
        timeout=60
    )
    return result.rows[0].prompt_logprobs


def test_echo_with_logprobs_gives_the_prompts_scores_in_openais_shape(
    sdk: openai.OpenAI, model: str, mlxq_client: Client
) -> None:
    got = sdk.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    want = _prompt_scores(mlxq_client, {"prompt": PROMPT, "top_logprobs": 2})
    (choice,) = got.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens == want.texts and choice.text == "".join(want.texts)
    assert lp.token_logprobs is not None and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want.token_logprobs, abs=1e-6)
    assert lp.text_offset == want.offsets
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    for top, alternatives, token, logprob in zip(
        lp.top_logprobs[1:], want.top_logprobs, want.texts[1:], want.token_logprobs, strict=True
    ):
        expected = {a.text: a.logprob for a in alternatives}
        expected.setdefault(token, logprob)  # OpenAI's: the top alternatives and the token itself
        assert top == pytest.approx(expected, abs=1e-6)
    assert choice.finish_reason == "length"
    assert (
        got.usage is not None
        and got.usage.prompt_tokens == len(want.texts)
        and got.usage.completion_tokens == 0
    )


def test_a_batch_of_token_id_prompts_and_one_greedy_token(
    sdk: openai.OpenAI, model: str, mlxq_client: Client
) -> None:
    """lm-eval's ask: prompts as token ids, `max_tokens: 1` at temperature 0: a choice per prompt, whose
    last token is what a greedy generation of one token gives."""
    texts = [PROMPT, "A short one."]
    ids = [_prompt_scores(mlxq_client, {"prompt": t}) for t in texts]
    prompts = [[p.first_token, *p.tokens] for p in ids]
    got = sdk.completions.create(
        model=model, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=3
    )
    assert [c.index for c in got.choices] == [0, 1]
    for choice, tokens, text in zip(got.choices, prompts, texts, strict=True):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert len(choice.logprobs.tokens or []) == len(tokens) + 1  # the prompt's, then the completion's
        want = _prompt_scores(mlxq_client, {"prompt_ids": tokens, "next_token": True})
        assert choice.logprobs.token_logprobs[1:-1] == pytest.approx(want.token_logprobs, abs=1e-6)
        # The completion token is what a one-token greedy generation of the same prompt gives.
        generated = mlxq_client.submit_generate(text, max_tokens=1, temperature=0.0).result(timeout=60)
        if want.next_ends:
            assert generated.finish_reason == choice.finish_reason == "stop"
            assert choice.text == "".join(want.texts)
        else:
            assert generated.token_ids == [want.next_top[0].id]
            assert choice.text == "".join(want.texts) + generated.text
            assert choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(want.next_top[0].logprob, abs=1e-6)
    assert got.usage is not None and got.usage.completion_tokens == 2
    assert got.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_bad_prompts_and_logprobs_are_a_400(sdk: openai.OpenAI, model: str) -> None:
    for prompt, logprobs, param in (([], 1, "prompt"), ([[1, -2]], 1, "prompt"), ("x", 99, "logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.completions.create(model=model, prompt=prompt, echo=True, logprobs=logprobs, max_tokens=0)
        assert e.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        sdk.completions.create(model=model, prompt=[10**7], echo=True, logprobs=1, max_tokens=0)


def test_lm_evals_local_completions_scores_as_mlxq_does(
    gateway: GatewayProcess,
    key: str,
    model: str,
    model_dir: Any,
    mlxq_client: Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lm-eval's own `local-completions` model (its HF tokenizer, token-id prompts, two per request)
    against the gateway: its loglikelihoods equal a score job's continuations within 1e-4."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("OPENAI_API_KEY", key)
    lm = LocalCompletionsAPI(
        base_url=f"{gateway.url}/v1/completions",
        model=model,
        tokenizer=str(model_dir),
        tokenizer_backend="huggingface",
        batch_size=2,
        max_retries=1,
    )
    pairs = [
        ("Question: what do queues hold? Answer:", " jobs"),
        ("Question: what do queues hold? Answer:", " cats and dogs"),
        ("Workers keep a model loaded", " and score rows all day long."),
    ]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)
    ]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    rows = [{"prompt": c, "continuations": [t]} for c, t in pairs]
    want = mlxq_client.submit_score(rows, add_special_tokens=False).result(timeout=60)
    assert len(got) == len(pairs)
    for (logprob, greedy), row in zip(got, want.rows, strict=True):
        assert row.continuations is not None
        assert logprob == pytest.approx(row.continuations[0].logprob, abs=1e-4)
        assert greedy == row.continuations[0].is_greedy
    # generate_until: lm-eval sends the context as token ids; the text is a greedy generation's.
    until = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    contexts = ["Question: what runs the jobs? Answer:", "Once upon a time"]
    generations = lm.generate_until(
        [
            Instance(request_type="generate_until", doc={}, arguments=(c, until), idx=i)
            for i, c in enumerate(contexts)
        ],
        disable_tqdm=True,
    )
    for context, text in zip(contexts, generations, strict=True):
        alone = mlxq_client.submit_generate(
            context, max_tokens=6, temperature=0.0, stop=["\n\n"], add_special_tokens=False
        ).result(timeout=60)
        assert text == alone.text


def test_a_generated_completions_logprobs_are_the_models_own(
    sdk: openai.OpenAI, model: str, model_dir: Any, mlxq_client: Client, no_eos: dict[int, float]
) -> None:
    """A sampled completion of several tokens: generated by its own job (every setting honoured), then
    its prompt and tokens scored; each logprob is the reference model's (transformers, float32)."""
    import numpy as np
    import torch
    from reference import hf_logits, load_hf_model

    from mlxq.worker.engine.text.tokenizer import Tokenizer

    settings = {"max_tokens": 6, "temperature": 1.0, "seed": 5}
    bias = {str(k): v for k, v in no_eos.items()}
    got = sdk.completions.create(
        model=model, prompt=PROMPT, echo=True, logprobs=2, logit_bias=bias, **settings
    )
    generated = mlxq_client.submit_generate(PROMPT, logit_bias=no_eos, **settings).result(timeout=60)
    (choice,) = got.choices
    prompt_ids = Tokenizer.from_dir(model_dir).encode(PROMPT)
    ids = prompt_ids + generated.token_ids
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(ids) and choice.text.endswith(generated.text)
    assert "".join(lp.tokens[len(prompt_ids) :]) == generated.text
    reference = torch.log_softmax(torch.tensor(hf_logits(load_hf_model(model_dir), ids)), -1).numpy()
    want = [float(reference[i, t]) for i, t in enumerate(ids[1:])]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert lp.top_logprobs is not None and lp.top_logprobs[-1] is not None
    assert max(lp.top_logprobs[-1].values()) == pytest.approx(float(np.max(reference[-2])), abs=1e-4)
    assert choice.finish_reason == generated.finish_reason == "length"
    assert got.usage is not None and got.usage.completion_tokens == 6
    # Without echo: the job reports its tokens' logprobs itself; offsets count from the prompt's start
    # (OpenAI's legacy completions), as the echoed answer's do for the same tokens.
    plain = sdk.completions.create(model=model, prompt=PROMPT, logprobs=0, logit_bias=bias, **settings)
    assert plain.choices[0].text == generated.text and plain.choices[0].logprobs is not None
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(want[len(prompt_ids) - 1 :], abs=1e-4)
    offsets = plain.choices[0].logprobs.text_offset or []
    tokens = plain.choices[0].logprobs.tokens or []
    assert offsets == [len(PROMPT) + len("".join(tokens[:i])) for i in range(len(tokens))]


def test_a_chats_logprobs_are_the_models_own(
    sdk: openai.OpenAI, model: str, model_dir: Any, mlxq_client: Client, no_eos: dict[int, float]
) -> None:
    """`logprobs: true, top_logprobs: 3` on a chat: per generated token its text, bytes, logprob and
    alternatives, the logprobs the reference model (transformers, float32) gives after the rendered chat."""
    import torch
    from reference import hf_logits, load_hf_model

    from mlxq.worker.engine.text.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "Name a colour."}]
    settings = {"max_tokens": 5, "temperature": 0.8, "seed": 2}
    bias = {str(k): v for k, v in no_eos.items()}
    got = sdk.chat.completions.create(
        model=model,
        messages=messages,
        logprobs=True,
        top_logprobs=3,
        logit_bias=bias,
        **settings,  # type: ignore[arg-type]
    )
    generated = mlxq_client.submit_generate(messages=messages, logit_bias=no_eos, **settings).result(
        timeout=60
    )
    (choice,) = got.choices
    assert choice.message.content == generated.text and choice.logprobs is not None
    content = choice.logprobs.content or []
    assert len(content) == len(generated.token_ids) == 5
    assert "".join(c.token for c in content) == generated.text
    assert all(bytes(c.bytes or []) == c.token.encode() and len(c.top_logprobs) == 3 for c in content)
    tokenizer = Tokenizer.from_dir(model_dir)
    chat = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )
    ids = chat + generated.token_ids
    reference = torch.log_softmax(torch.tensor(hf_logits(load_hf_model(model_dir), ids)), -1).numpy()
    want = [float(reference[len(chat) - 1 + j, t]) for j, t in enumerate(generated.token_ids)]
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-4)
    for j, c in enumerate(content):
        best = sorted(reference[len(chat) - 1 + j], reverse=True)[:3]
        assert [a.logprob for a in c.top_logprobs] == pytest.approx([float(b) for b in best], abs=1e-4)


def test_streamed_chat_logprobs_for_every_choice_equal_the_whole_answers(
    sdk: openai.OpenAI, model: str, no_eos: dict[int, float]
) -> None:
    """`stream: true, n: 2` with `logprobs`: each chunk carries its tokens' entries in
    `choices[].logprobs.content`; put together per choice they are the unstreamed answer's (which
    `test_a_chats_logprobs_are_the_models_own` holds against transformers)."""
    messages = [{"role": "user", "content": "Name two colours."}]
    bias = {str(k): v for k, v in no_eos.items()}
    settings: dict[str, Any] = {"max_tokens": 6, "temperature": 0.9, "seed": 11, "n": 2, "logit_bias": bias}
    whole = sdk.chat.completions.create(
        model=model, messages=messages, logprobs=True, top_logprobs=2, **settings
    )
    stream = sdk.chat.completions.create(
        model=model, messages=messages, logprobs=True, top_logprobs=2, stream=True, **settings
    )
    texts: dict[int, str] = {0: "", 1: ""}
    entries: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                entries[choice.index] += choice.logprobs.content or []
    for answer in whole.choices:
        assert answer.logprobs is not None and answer.logprobs.content is not None
        want = answer.logprobs.content
        got = entries[answer.index]
        assert texts[answer.index] == answer.message.content
        assert len(got) == len(want) == 6
        assert [(c.token, c.bytes) for c in got] == [(c.token, c.bytes) for c in want]
        assert [c.logprob for c in got] == pytest.approx([c.logprob for c in want], abs=1e-6)
        assert [[a.token for a in c.top_logprobs] for c in got] == [
            [a.token for a in c.top_logprobs] for c in want
        ]
    assert [len(e) for e in entries.values()] == [6, 6]


def test_streamed_completion_logprobs_equal_the_whole_answers(
    sdk: openai.OpenAI, model: str, no_eos: dict[int, float]
) -> None:
    """`stream: true` with `logprobs: 2` on a completion: OpenAI's `tokens`, `token_logprobs`,
    `top_logprobs`, `text_offset` per chunk; together, the unstreamed answer's."""
    bias = {str(k): v for k, v in no_eos.items()}
    settings: dict[str, Any] = {"max_tokens": 7, "temperature": 0.7, "seed": 4, "logit_bias": bias}
    whole = sdk.completions.create(model=model, prompt=PROMPT, logprobs=2, **settings)
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[Any] = []
    offsets: list[int] = []
    text = ""
    for chunk in sdk.completions.create(model=model, prompt=PROMPT, logprobs=2, stream=True, **settings):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                logprobs += choice.logprobs.token_logprobs or []
                tops += choice.logprobs.top_logprobs or []
                offsets += choice.logprobs.text_offset or []
    (answer,) = whole.choices
    want = answer.logprobs
    assert want is not None and text == answer.text
    assert tokens == want.tokens and len(tokens) == 7 and "".join(tokens) == text
    assert logprobs == pytest.approx(want.token_logprobs, abs=1e-6)
    assert [sorted(t) for t in tops] == [sorted(t) for t in want.top_logprobs or []]
    assert offsets == want.text_offset == [len(PROMPT) + len("".join(tokens[:i])) for i in range(len(tokens))]


def test_each_choices_text_offsets_start_after_its_own_prompt(
    sdk: openai.OpenAI, model: str, no_eos: dict[int, float]
) -> None:
    """A batch of prompts with `n: 2`, streamed and not: each choice's `text_offset`s start at its own
    prompt's length (OpenAI's legacy completions), a prompt of token ids at 0 (the gateway holds no
    tokenizer to tell its characters), and the streamed chunks put together are the unstreamed answer's."""
    prompts: list[Any] = ["Hi.", PROMPT, [5, 6, 7]]
    bias = {str(k): v for k, v in no_eos.items()}
    settings: dict[str, Any] = {"max_tokens": 4, "temperature": 0.8, "seed": 3, "n": 2, "logit_bias": bias}
    whole = sdk.completions.create(model=model, prompt=prompts, logprobs=1, **settings)
    streamed: dict[int, list[int]] = {}
    for chunk in sdk.completions.create(model=model, prompt=prompts, logprobs=1, stream=True, **settings):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.setdefault(choice.index, []).extend(choice.logprobs.text_offset or [])
    starts = [len("Hi."), len(PROMPT), 0]
    assert sorted(c.index for c in whole.choices) == list(range(6))
    for choice in whole.choices:
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
        start = starts[choice.index // 2]
        assert lp.text_offset == [start + len("".join(lp.tokens[:i])) for i in range(4)]
        assert streamed[choice.index] == lp.text_offset


def test_a_resumed_completion_streams_text_offsets_that_go_on(
    gateway: GatewayProcess, key: str, sdk: openai.OpenAI, model: str, no_eos: dict[int, float]
) -> None:
    """A client that reconnects with `Last-Event-ID` mid-stream gets the rest of the tokens with their
    `text_offset` going on from the prompt's and the sent tokens' characters, as the unstreamed answer
    has them."""
    bias = {str(k): v for k, v in no_eos.items()}
    body: dict[str, Any] = {"model": model, "prompt": PROMPT, "logprobs": 1, "max_tokens": 12}
    body |= {"temperature": 0.0, "logit_bias": bias}
    headers = {"authorization": f"Bearer {key}"}

    def chunks(response: httpx.Response) -> Iterator[tuple[str | None, dict[str, Any]]]:
        event_id = None
        for line in response.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                yield event_id, json.loads(line[6:])

    offsets: list[int] = []
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", json={**body, "stream": True}, headers=headers
    ) as r:
        head = []
        for event_id, chunk in chunks(r):
            head.append((event_id, chunk))
            if (
                sum(len((c.get("logprobs") or {}).get("tokens", [])) for _, x in head for c in x["choices"])
                >= 4
            ):
                break  # the client goes away mid-stream, after a few tokens
    for _, chunk in head:
        for choice in chunk["choices"]:
            offsets += (choice.get("logprobs") or {}).get("text_offset", [])
    last_id = [i for i, _ in head if i is not None][-1]
    with httpx.stream(
        "GET", f"{gateway.url}/v1/streams/{head[0][1]['id']}", headers={**headers, "last-event-id": last_id}
    ) as r:
        assert r.status_code == 200
        for _, chunk in chunks(r):
            for choice in chunk["choices"]:
                offsets += (choice.get("logprobs") or {}).get("text_offset", [])
    whole = sdk.completions.create(**body)
    want = whole.choices[0].logprobs
    assert want is not None and want.text_offset is not None and len(want.text_offset) == 12
    assert offsets == want.text_offset and offsets[0] == len(PROMPT)
