"""`POST /v1/completions` with `echo` or `logprobs`: answered with a score job.

This is how evaluation harnesses score text through OpenAI's API (lm-eval's `local-completions`:
`echo: true, logprobs: 1, max_tokens: 0 or 1`, prompts as token ids): each prompt becomes a
`prompt_logprobs` score row that asks for its tokens' texts and offsets, so the answer carries OpenAI's
`logprobs` object (`tokens`, `token_logprobs` with None for the first token, `top_logprobs`,
`text_offset`). A completion of one token at `temperature: 0` (no penalties, bias or stop) is the
prompt's likeliest next token, which the same row gives (`next_token`): one job, nothing generated.
Any other completion is generated first (an ordinary generation job, every sampling setting honoured),
then its prompt and generated tokens are scored together (`after`): the logprobs are the model's own
distribution at each token, before temperature, penalties or bias, as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mlxq.jobs.schema import (
    MAX_TOP_LOGPROBS,
    GenerateResult,
    PromptLogprobs,
    ScoreRequest,
    ScoreResult,
    TopLogprob,
)

from . import shapes, translate
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
_GENERATED = (
    "a generated completion's logprobs are taken for one prompt a request (a list of prompts is scored "
    "only: `max_tokens` 0, or 1 at `temperature` 0)"
)


def wanted(body: dict[str, Any]) -> bool:
    """Whether a completions body asks for what only a score job answers."""
    return body.get("echo") not in (None, False)


@dataclass(frozen=True)
class EchoAsk:
    """A completions request as a score job, and how to answer it. With `generate`, the completion is
    generated first (that job), then its prompt and generated tokens are scored (`after`)."""

    model: str
    request: ScoreRequest
    echo: bool
    logprobs: int | None
    next_token: bool  # max_tokens 1 at temperature 0: the prompt's likeliest next token is the completion
    generate: translate.Translated | None = None


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
    max_tokens = body.get("max_tokens", 16)
    plain = all(name not in body or body[name] in neutral for name, neutral in _NEUTRAL.items())
    if max_tokens == 1 and body.get("temperature") == 0 and plain:
        return _scored(model, body, echo, logprobs, next_token=True)
    if max_tokens == 0:
        if not echo:
            raise bad_request("`max_tokens: 0` asks for nothing without `echo: true`", "max_tokens")
        return _scored(model, body, echo, logprobs, next_token=False)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) != 1:
        raise unsupported("prompt", _GENERATED)
    t = translate.completion({k: v for k, v in body.items() if k not in ("echo", "logprobs")})
    return EchoAsk(model, _score_request(prompts, logprobs, False), echo, logprobs, False, t)


def _scored(model: str, body: dict[str, Any], echo: bool, logprobs: int | None, next_token: bool) -> EchoAsk:
    return EchoAsk(
        model, _score_request(_prompts(body.get("prompt")), logprobs, next_token), echo, logprobs, next_token
    )


def _score_request(prompts: list[dict[str, Any]], logprobs: int | None, next_token: bool) -> ScoreRequest:
    asks = {
        "prompt_logprobs": True,
        "top_logprobs": logprobs or 0,
        "token_texts": True,
        "next_token": next_token,
    }
    try:
        return ScoreRequest.model_validate({"rows": [{**p, **asks} for p in prompts]})
    except ValidationError as e:
        raise bad_request(f"the request cannot be scored: {e.errors()[0]['msg']}", "prompt") from None


def after(ask: EchoAsk, generated: GenerateResult) -> ScoreRequest:
    """The score job of a generated completion: its prompt, then the tokens the generation took."""
    (row,) = ask.request.rows
    return ScoreRequest(rows=[row.model_copy(update={"completion_ids": generated.token_ids})])


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
    """OpenAI's `text_completion` object of a scored request: a choice per prompt, in order."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, row in enumerate(result.rows):
        pl = _texts_of(row.prompt_logprobs, i)
        choice, generated = _choice(ask, i, pl)
        choices.append(choice)
        prompt_tokens += len(pl.texts or [])
        completion_tokens += generated
    usage = shapes.usage(prompt_tokens, completion_tokens, result.cached_tokens)
    return _completion(ask, completion_id, created, choices, usage)


def answer_generated(
    ask: EchoAsk, completion_id: str, created: int, generated: GenerateResult, result: ScoreResult
) -> dict[str, Any]:
    """OpenAI's `text_completion` object of a generated completion, with the logprobs of its tokens
    (and its prompt's, with `echo`) under the model's own distribution (before any sampling settings)."""
    pl = _texts_of(result.rows[0].prompt_logprobs, 0)
    texts = pl.texts or []
    n_prompt = len(texts) - len(generated.token_ids)
    text = ("".join(texts[:n_prompt]) if ask.echo else "") + generated.text
    logprobs = _logprobs(pl, ask.logprobs, 0 if ask.echo else n_prompt) if ask.logprobs is not None else None
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": generated.finish_reason}
    u = generated.usage
    return _completion(
        ask,
        completion_id,
        created,
        [choice],
        shapes.usage(*(u.prompt_tokens, u.completion_tokens, u.cached_tokens)),
    )


def _completion(
    ask: EchoAsk, completion_id: str, created: int, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": ask.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage,
    }


def _texts_of(pl: PromptLogprobs | None, row: int) -> PromptLogprobs:
    if pl is None or pl.texts is None or pl.offsets is None:
        raise ValueError(f"row {row} of the score result has no token texts")
    return pl


def _logprobs(pl: PromptLogprobs, k: int | None, start: int) -> dict[str, Any]:
    """OpenAI's `logprobs` object over the scored tokens from position `start` (the first token of the
    sequence has no logprob: nothing precedes it)."""
    texts, offsets = pl.texts or [], pl.offsets or []
    alternatives = pl.top_logprobs or [[] for _ in pl.token_logprobs]
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for p in range(start, len(texts)):
        if p == 0:
            token_logprobs.append(None)
            tops.append(None)
            continue
        lp = pl.token_logprobs[p - 1]
        token_logprobs.append(lp)
        tops.append(_top(alternatives[p - 1], k or 0, texts[p], lp))
    return {
        "tokens": texts[start:],
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets[start:],
    }


def _choice(ask: EchoAsk, index: int, pl: PromptLogprobs) -> tuple[dict[str, Any], int]:
    """A scored prompt's choice: the prompt (with `echo`), then its greedy next token where asked."""
    texts = pl.texts or []
    prompt_text = "".join(texts)
    lp = _logprobs(pl, ask.logprobs, 0 if ask.echo else len(texts))
    text, finish, generated = prompt_text if ask.echo else "", "length", 0
    if ask.next_token and pl.next_top:
        chosen = pl.next_top[0]
        piece = chosen.text or ""
        lp["tokens"].append(piece)
        lp["token_logprobs"].append(chosen.logprob)
        lp["top_logprobs"].append(_top(pl.next_top, ask.logprobs or 0, piece, chosen.logprob))
        lp["text_offset"].append(len(prompt_text))
        generated = 1
        if pl.next_ends:  # a greedy generation stops here: the end token shows in logprobs, not in text
            finish = "stop"
        else:
            text += piece
    logprobs = lp if ask.logprobs is not None else None
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}, generated


def _top(alternatives: list[TopLogprob], k: int, token: str, logprob: float) -> dict[str, float]:
    """OpenAI's `top_logprobs` entry: the `k` likeliest tokens by text, and the token itself."""
    top = {(a.text or ""): a.logprob for a in alternatives[:k]}
    top.setdefault(token, logprob)
    return top
