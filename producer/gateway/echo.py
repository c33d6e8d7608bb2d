"""`POST /v1/completions` with `echo` or `logprobs`: answered by one score job, not a generation.

This is how evaluation harnesses score text through OpenAI's API (lm-eval's `local-completions`:
`echo: true, logprobs: 1, max_tokens: 0 or 1`, prompts as token ids): each prompt becomes a
`prompt_logprobs` score row that asks for its tokens' texts and offsets, so the answer carries OpenAI's
`logprobs` object (`tokens`, `token_logprobs` with None for the first token, `top_logprobs`,
`text_offset`). A completion of one token with `temperature: 0` is the prompt's likeliest next token,
which the same row gives (`next_token`): nothing is generated apart from the scoring. The logprobs of
longer or sampled completions are not computed by mlxq's workers, so they are refused with a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mlxq.jobs.schema import MAX_TOP_LOGPROBS, PromptLogprobs, ScoreRequest, ScoreResult, TopLogprob

from . import shapes
from .errors import bad_request, unsupported

_KNOWN = {
    "model", "prompt", "echo", "logprobs", "max_tokens", "temperature", "top_p", "n", "best_of", "stream",
    "seed", "stop", "user", "metadata", "logit_bias", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "top_k", "min_p", "suffix", "stream_options", "store", "service_tier",
}  # fmt: skip
_NEUTRAL = {  # sampling values that change nothing about a greedy token
    "logit_bias": ({}, None),
    "presence_penalty": (0, None),
    "frequency_penalty": (0, None),
    "repetition_penalty": (1, None),
    "stop": ([], None),
    "suffix": (None,),
    "stream_options": (None,),
}
_ONE_TOKEN = (
    "with `echo` or `logprobs`, mlxq completes at most one token, greedily (`temperature: 0`), as "
    "evaluation harnesses ask; the logprobs of longer or sampled completions are not computed by its workers"
)


def wanted(body: dict[str, Any]) -> bool:
    """Whether a completions body asks for what only a score job answers."""
    return body.get("echo") not in (None, False) or body.get("logprobs") is not None


@dataclass(frozen=True)
class EchoAsk:
    """A completions request as a score job, and how to answer it."""

    model: str
    request: ScoreRequest
    echo: bool
    logprobs: int | None
    next_token: bool  # max_tokens 1: the prompt's likeliest next token is the completion


def parse(body: dict[str, Any], model: str) -> EchoAsk:
    """A `POST /v1/completions` body with `echo`/`logprobs`; a 400 names what cannot be answered."""
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise bad_request(f"unknown parameter `{unknown[0]}`", unknown[0], code="unknown_parameter")
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise bad_request("`echo` must be true or false", "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS
    ):
        raise bad_request(f"`logprobs` must be an integer from 0 to {MAX_TOP_LOGPROBS}", "logprobs")
    if body.get("stream"):
        raise unsupported("stream", "with `echo` or `logprobs` the answer comes whole, not streamed")
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise unsupported(name, "with `echo` or `logprobs` a prompt has one choice")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise unsupported(name, _ONE_TOKEN)
    max_tokens = body.get("max_tokens", 16)
    if max_tokens == 0:
        if not echo:
            raise bad_request("`max_tokens: 0` asks for nothing without `echo: true`", "max_tokens")
    elif max_tokens != 1 or body.get("temperature") != 0:
        raise unsupported("max_tokens" if max_tokens != 1 else "temperature", _ONE_TOKEN)
    top = logprobs or 0
    rows = [
        {
            **p,
            "prompt_logprobs": True,
            "top_logprobs": top,
            "token_texts": True,
            "next_token": max_tokens == 1,
        }
        for p in _prompts(body.get("prompt"))
    ]
    try:
        request = ScoreRequest.model_validate({"rows": rows})
    except ValidationError as e:
        raise bad_request(f"the request cannot be scored: {e.errors()[0]['msg']}", "prompt") from None
    return EchoAsk(model, request, echo, logprobs, max_tokens == 1)


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    """OpenAI's four forms of `prompt` (text, texts, token ids, lists of token ids) as score rows."""

    def ids(value: list[Any]) -> bool:
        return bool(value) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)

    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt, list) and prompt:
        if ids(prompt):
            return [{"prompt_ids": prompt}]
        if all(isinstance(p, str) for p in prompt):
            return [{"prompt": p} for p in prompt]
        if all(isinstance(p, list) and ids(p) for p in prompt):
            return [{"prompt_ids": p} for p in prompt]
    raise bad_request(
        "`prompt` must be a string, a list of strings, a list of token ids or a list of such lists "
        "(none empty)",
        "prompt",
    )


def answer(ask: EchoAsk, completion_id: str, created: int, result: ScoreResult) -> dict[str, Any]:
    """OpenAI's `text_completion` object: a choice per prompt, in order."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, row in enumerate(result.rows):
        pl = row.prompt_logprobs
        if pl is None or pl.texts is None or pl.offsets is None:
            raise ValueError(f"row {i} of the score result has no token texts")
        choice, generated = _choice(ask, i, pl, pl.texts, pl.offsets)
        choices.append(choice)
        prompt_tokens += len(pl.texts)
        completion_tokens += generated
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": ask.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": shapes.usage(prompt_tokens, completion_tokens, result.cached_tokens),
    }


def _choice(
    ask: EchoAsk, index: int, pl: PromptLogprobs, texts: list[str], offsets: list[int]
) -> tuple[dict[str, Any], int]:
    prompt_text = "".join(texts)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    k = ask.logprobs or 0
    if ask.echo:
        tokens += texts
        token_logprobs += [None, *pl.token_logprobs]
        tops.append(None)
        for token, lp, alternatives in zip(
            texts[1:], pl.token_logprobs, pl.top_logprobs or [[]] * len(pl.token_logprobs), strict=True
        ):
            tops.append(_top(alternatives, k, token, lp))
        text_offset += offsets
    text, finish, generated = prompt_text if ask.echo else "", "length", 0
    if ask.next_token and pl.next_top:
        chosen = pl.next_top[0]
        piece = chosen.text or ""
        tokens.append(piece)
        token_logprobs.append(chosen.logprob)
        tops.append(_top(pl.next_top, k, piece, chosen.logprob))
        text_offset.append(len(prompt_text))
        generated = 1
        if pl.next_ends:  # a greedy generation stops here: the end token shows in logprobs, not in text
            finish = "stop"
        else:
            text += piece
    logprobs = None
    if ask.logprobs is not None:
        logprobs = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": text_offset,
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}, generated


def _top(alternatives: list[TopLogprob], k: int, token: str, logprob: float) -> dict[str, float]:
    """OpenAI's `top_logprobs` entry: the `k` likeliest tokens by text, and the token itself."""
    top = {(a.text or ""): a.logprob for a in alternatives[:k]}
    top.setdefault(token, logprob)
    return top
