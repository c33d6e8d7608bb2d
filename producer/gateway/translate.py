"""OpenAI request bodies -> mlxq generation requests, and what the answer should look like.

Every parameter is either carried to the job, answered for by the gateway (`stream`, `model`, `n`: a job
per choice),
accepted as metadata with no effect on the text (`user`, `metadata`, `store=false`), or refused with a
400 that names it. Nothing is dropped silently: a client that asks for tools learns at once that mlxq
does not give them, rather than getting text that ignored the ask. A completion's `echo` is answered
by a score job instead (`echo`); `logprobs` of generated tokens (chat and completions, streamed or not)
are reported by the generation job itself (`generated_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mlxq.jobs.errors import InvalidRequest
from mlxq.jobs.schema import MAX_TOP_LOGPROBS, GenerateRequest

from .. import payload
from .errors import bad_request, unsupported

Kind = Literal["chat", "completion"]

_SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
# vLLM-style extras (`extra_body` in the SDK), and mlxq's cap on speculative decoding's draft tokens
_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "max_draft_tokens")
_METADATA = ("user", "metadata", "service_tier")

_UNSUPPORTED_CHAT = {
    "tools": "mlxq's workers do not do tool calling",
    "tool_choice": "mlxq's workers do not do tool calling",
    "functions": "mlxq's workers do not do function calling",
    "function_call": "mlxq's workers do not do function calling",
    "parallel_tool_calls": "mlxq's workers do not do tool calling",
    "audio": "mlxq serves text models",
    "modalities": "mlxq serves text models",
    "prediction": "mlxq's workers take no predicted output",
    "reasoning_effort": "mlxq's workers have no reasoning-effort control",
    "web_search_options": "mlxq's workers do not search the web",
}
_UNSUPPORTED_COMPLETION = {
    "suffix": "mlxq's workers do not fill in the middle",
}


@dataclass(frozen=True)
class Translated:
    """A request as mlxq runs it, plus how to answer: streamed or not, with a usage chunk or not."""

    kind: Kind
    model: str
    request: GenerateRequest
    stream: bool
    include_usage: bool
    n: int = 1
    more: tuple[GenerateRequest, ...] = ()  # the requests of a batch's other prompts (completions)
    logprobs: int | None = None  # a chat's `logprobs: true`: this many alternatives per token
    prompt_chars: tuple[int, ...] = ()  # a completion's: each prompt's characters (0 for token ids)

    @property
    def requests(self) -> tuple[GenerateRequest, ...]:
        """One request per prompt (a completions request may send a batch of prompts)."""
        return (self.request, *self.more)


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "`model` is required: the name of a model a worker serves (GET /v1/models)", "model"
        )
    return model


MAX_CHOICES = 16


def _n(body: dict[str, Any]) -> int:
    """How many choices: one job each (an mlxq job generates one sequence)."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"`n` must be an integer from 1 to {MAX_CHOICES}", "n")
    return n


def choice_requests(t: Translated) -> list[GenerateRequest]:
    """The job of each choice, prompt by prompt (OpenAI's order: prompt i's choices are `i*n ..`): the
    request's own for a prompt's first, the seed counted up for the next (so a seeded request gives the
    same choices again; an unseeded one, independent ones)."""
    out = []
    for request in t.requests:
        seed = request.seed
        out += [
            request if seed is None or i == 0 else request.model_copy(update={"seed": seed + i})
            for i in range(t.n)
        ]
    return out


MAX_JOBS = 64
"""The most jobs one request makes (prompts times `n`)."""


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
    model = model_of(body)
    n = _n(body)
    stream, include_usage = _stream(body)
    if body.get("store"):
        raise unsupported("store", "the gateway keeps no completions for later retrieval")
    known = _BASE | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
    params = _common(body, known, _UNSUPPORTED_CHAT)
    logprobs = _chat_logprobs(body)
    if logprobs is not None:  # the job reports its tokens' logprobs itself
        params["logprobs"] = logprobs
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
        n,
        logprobs=logprobs,
    )


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives a chat's `logprobs` asks per token (None: no logprobs). The generation
    job reports them (`generated_logprobs`), streamed or not, for every choice."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs not in (None, True, False):
        raise bad_request("`logprobs` must be true or false", "logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise bad_request(f"`top_logprobs` must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
    if not logprobs:
        if top:
            raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        return None
    return top or 0


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
    model = model_of(body)
    n = _n(body)
    if body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "a request yields one completion")
    stream, include_usage = _stream(body)
    # `echo` is answered by a score job (`echo`), never reaches here; `logprobs` the job reports itself
    params = _common(body, _BASE | {"prompt", "best_of", "echo", "logprobs"}, _UNSUPPORTED_COMPLETION)
    if body.get("logprobs") is not None:
        params["logprobs"] = _completion_logprobs(body["logprobs"])
    params["max_tokens"] = body.get("max_tokens", 16)  # OpenAI's default for completions
    prompts = _completion_prompts(body.get("prompt"))
    if len(prompts) * n > MAX_JOBS:
        raise bad_request(
            f"{len(prompts)} prompts times n={n} is {len(prompts) * n} jobs; a request makes at most "
            f"{MAX_JOBS}",
            "prompt",
        )
    requests = [
        _validated({**params, "prompt_ids": p}, None, None)
        if isinstance(p, list)
        else _validated(params, p, None)
        for p in prompts
    ]
    chars = tuple(len(p) if isinstance(p, str) else 0 for p in prompts)  # where `text_offset` starts
    return Translated(
        "completion", model, requests[0], stream, include_usage, n, tuple(requests[1:]), prompt_chars=chars
    )


def _completion_logprobs(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"`logprobs` must be an integer from 0 to {MAX_TOP_LOGPROBS}", "logprobs")
    return value


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's forms of a completion's `prompt`: text, token ids, or a batch of either."""
    if isinstance(prompt, str) or _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        return list(prompt)
    raise bad_request(
        "`prompt` must be a string, a list of token ids, or a non-empty list of either", "prompt"
    )


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
