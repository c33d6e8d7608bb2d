"""OpenAI request bodies -> mlxq generation requests, and what the answer should look like.

Every parameter is either carried to the job, answered for by the gateway (`stream`, `model`, `n=1`),
accepted as metadata with no effect on the text (`user`, `metadata`, `store=false`), or refused with a
400 that names it. Nothing is dropped silently: a client that asks for tools or logprobs learns at once
that mlxq does not give them, rather than getting text that ignored the ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mlxq.jobs.errors import InvalidRequest
from mlxq.jobs.schema import GenerateRequest

from .. import payload
from .errors import bad_request, unsupported

Kind = Literal["chat", "completion"]

_SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
# vLLM-style extras (`extra_body` in the SDK), and mlxq's cap on speculative decoding's draft tokens
_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "max_draft_tokens")
_METADATA = ("user", "metadata", "service_tier")

_ECHO_LOGPROBS = (
    "prompt and completion logprobs (`echo` with `logprobs`) are not wired into the gateway yet; they are "
    "to come from mlxq's evaluation scoring (issue 28: score jobs with `prompt_logprobs`)"
)
_UNSUPPORTED_CHAT = {
    "tools": "mlxq's workers do not do tool calling",
    "tool_choice": "mlxq's workers do not do tool calling",
    "functions": "mlxq's workers do not do function calling",
    "function_call": "mlxq's workers do not do function calling",
    "parallel_tool_calls": "mlxq's workers do not do tool calling",
    "top_logprobs": "mlxq's workers do not return token logprobs for generated text",
    "audio": "mlxq serves text models",
    "modalities": "mlxq serves text models",
    "prediction": "mlxq's workers take no predicted output",
    "reasoning_effort": "mlxq's workers have no reasoning-effort control",
    "web_search_options": "mlxq's workers do not search the web",
}
_UNSUPPORTED_COMPLETION = {
    "suffix": "mlxq's workers do not fill in the middle",
    "echo": _ECHO_LOGPROBS,
    "logprobs": _ECHO_LOGPROBS,
}


@dataclass(frozen=True)
class Translated:
    """A request as mlxq runs it, plus how to answer: streamed or not, with a usage chunk or not."""

    kind: Kind
    model: str
    request: GenerateRequest
    stream: bool
    include_usage: bool


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "`model` is required: the name of a model a worker serves (GET /v1/models)", "model"
        )
    return model


def _n(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise unsupported(
            "n",
            "a request yields one choice (an mlxq job generates one sequence); send n "
            "requests, each with its own `seed`, for several",
        )


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("`stream_options` is only allowed with `stream: true`", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("`stream_options` must be an object", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise unsupported(f"stream_options.{unknown[0]}", "only `include_usage` is implemented")
    if options.get("include_obfuscation"):
        raise unsupported("stream_options.include_obfuscation", "mlxq does not pad stream chunks")
    return stream, bool(options.get("include_usage"))


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("`logit_bias` must map token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for token, bias in value.items():
        try:
            out[int(token)] = float(bias)
        except (TypeError, ValueError):
            raise bad_request(
                f"`logit_bias` keys are token ids (integers as strings), values numbers; got {token!r}: "
                f"{bias!r}",
                "logit_bias",
            ) from None
    return out


def _common(body: dict[str, Any], known: set[str], refused: dict[str, str]) -> dict[str, Any]:
    """The sampling parameters every generation takes; refuses what is unsupported or unknown."""
    for name, why in refused.items():
        value = body.get(name)
        if value not in (None, False, [], {}):
            raise unsupported(name, why)
    unknown = sorted(set(body) - known - set(refused))
    if unknown:
        raise bad_request(f"unknown parameter `{unknown[0]}`", unknown[0], code="unknown_parameter")
    params: dict[str, Any] = {k: body[k] for k in (*_SAMPLING, *_EXTENSIONS) if body.get(k) is not None}
    bias = _logit_bias(body.get("logit_bias"))
    if bias:
        params["logit_bias"] = bias
    if body.get("stop") is not None:
        params["stop"] = body["stop"]
    if body.get("response_format") is not None:  # OpenAI's json_object/json_schema, mlxq's regex/grammar
        params["response_format"] = body["response_format"]
    return params


def _validated(params: dict[str, Any], prompt: str | None, messages: list[Any] | None) -> GenerateRequest:
    try:
        return payload.generate_request(prompt, messages, params)
    except InvalidRequest as e:
        raise bad_request(str(e)) from None


_BASE = {
    "model",
    "response_format",
    "stream",
    "stream_options",
    "n",
    "logit_bias",
    "stop",
    "max_tokens",
    "store",
    *_SAMPLING,
    *_EXTENSIONS,
    *_METADATA,
}


def chat(body: dict[str, Any]) -> Translated:
    """A `POST /v1/chat/completions` body."""
    model = _model(body)
    _n(body)
    stream, include_usage = _stream(body)
    if body.get("store"):
        raise unsupported("store", "the gateway keeps no completions for later retrieval")
    params = _common(body, _BASE | {"messages", "max_completion_tokens", "logprobs"}, _UNSUPPORTED_CHAT)
    if body.get("logprobs"):
        raise unsupported("logprobs", "mlxq's workers do not return token logprobs for generated text")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of {role, content}", "messages")
    return Translated(
        "chat",
        model,
        _validated(params, None, [_message(m, i) for i, m in enumerate(messages)]),
        stream,
        include_usage,
    )


def _message(message: Any, i: int) -> dict[str, Any]:
    """A chat message with its `content` as text: a list of parts must be all `text` parts."""
    if not isinstance(message, dict):
        raise bad_request(f"messages[{i}] must be an object with `role` and `content`", f"messages[{i}]")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(f"messages[{i}].content", f"only text parts are understood, got {kind!r}")
            texts.append(str(part.get("text", "")))
        message = {**message, "content": "".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    return dict(message)


def completion(body: dict[str, Any]) -> Translated:
    """A `POST /v1/completions` body."""
    model = _model(body)
    _n(body)
    if body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "a request yields one completion")
    stream, include_usage = _stream(body)
    params = _common(body, _BASE | {"prompt", "best_of"}, _UNSUPPORTED_COMPLETION)
    params["max_tokens"] = body.get("max_tokens", 16)  # OpenAI's default for completions
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise unsupported(
            "prompt",
            "a request takes one prompt as text (not a batch of prompts, not token "
            "ids); send one request per prompt, or use the Batch API",
        )
    if not isinstance(prompt, str):
        raise bad_request("`prompt` must be a string", "prompt")
    return Translated("completion", model, _validated(params, prompt, None), stream, include_usage)
