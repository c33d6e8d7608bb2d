"""OpenAI request bodies as mlxq requests (`producer/gateway/translate.py`): what is carried, what is a
400 naming the parameter. The end-to-end behaviour is in tests/e2e/test_gateway.py."""

from __future__ import annotations

from typing import Any

import pytest

from mlxq.producer.gateway import translate
from mlxq.producer.gateway.errors import ApiError

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_carries_sampling_stop_seed_and_logit_bias() -> None:
    t = translate.chat(
        {
            **CHAT,
            "temperature": 0.5,
            "seed": 3,
            "stop": "\n",
            "logit_bias": {"7": -100},
            "max_completion_tokens": 9,
            "max_tokens": 99,
            "top_k": 4,
            "max_draft_tokens": 0,
        }
    )
    r = t.request
    assert (r.temperature, r.seed, r.stop, r.logit_bias, r.max_tokens, r.top_k, r.max_draft_tokens) == (
        0.5,
        3,
        ["\n"],
        {7: -100.0},
        9,
        4,
        0,
    )
    assert t.kind == "chat" and not t.stream


def test_text_parts_are_joined_and_other_parts_refused() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    t = translate.chat({**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert t.request.messages is not None and t.request.messages[0].content == "ab"
    with pytest.raises(ApiError) as e:
        translate.chat({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert e.value.param == "messages[0].content" and "image_url" in e.value.message


def test_completion_defaults_and_prompt_forms() -> None:
    assert (
        translate.completion({"model": "m", "prompt": ["one"]}).request.max_tokens == 16
    )  # OpenAI's default
    two = translate.completion({"model": "m", "prompt": ["one", [5, 6]], "n": 2, "seed": 1})
    assert [(r.prompt, r.prompt_ids, r.seed) for r in translate.choice_requests(two)] == [
        ("one", None, 1),
        ("one", None, 2),
        (None, [5, 6], 1),
        (None, [5, 6], 2),
    ]  # OpenAI's order: a prompt's n choices together
    with pytest.raises(ApiError) as e:
        translate.completion({"model": "m", "prompt": ["x"] * 33, "n": 2})
    assert e.value.status == 400 and e.value.param == "prompt"
    for ids in ([5, 6, 7], [[5, 6, 7]]):  # OpenAI's token-id prompt, alone or as a batch of one
        assert translate.completion({"model": "m", "prompt": ids}).request.prompt_ids == [5, 6, 7]
    with pytest.raises(ApiError) as e:
        translate.completion({"model": "m", "prompt": [5, -1]})
    assert e.value.status == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "n": translate.MAX_CHOICES + 1}, "n"),
        ({**CHAT, "mystery": 1}, "mystery"),
        ({"messages": CHAT["messages"]}, "model"),
        ({**CHAT, "messages": []}, "messages"),
    ],
)
def test_refusals_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        translate.chat(body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_stream_with_usage() -> None:
    t = translate.chat({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert t.stream and t.include_usage


def test_n_choices_count_the_seed_up_or_leave_it_unset() -> None:
    seeded = translate.chat({**CHAT, "n": 3, "seed": 7})
    assert seeded.n == 3 and [r.seed for r in translate.choice_requests(seeded)] == [7, 8, 9]
    assert translate.choice_requests(seeded)[0] == seeded.request
    unseeded = translate.completion({"model": "m", "prompt": "hi", "n": 2})
    assert [r.seed for r in translate.choice_requests(unseeded)] == [None, None]
