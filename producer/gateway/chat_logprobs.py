"""A chat completion's `logprobs` (`logprobs: true`, `top_logprobs`): from a score job after it.

The generation runs as any other (every sampling setting honoured); then its messages, rendered by the
worker exactly as for the generation, and the tokens it generated are scored together, which gives each
generated token's log-probability and its likeliest alternatives under the model's own distribution
(before temperature, penalties or bias). The answer is OpenAI's chat `logprobs` object: per token its
text, logprob, UTF-8 bytes and `top_logprobs` alike.
"""

from __future__ import annotations

from typing import Any

from mlxq.jobs.schema import GenerateResult, ScoreRequest, ScoreResult

from .translate import Translated


def score_request(t: Translated, generated: GenerateResult) -> ScoreRequest:
    """The score job of a chat's generated tokens after its messages."""
    assert t.request.messages is not None and t.logprobs is not None
    row = {
        "messages": [m.model_dump() for m in t.request.messages],
        "completion_ids": generated.token_ids,
        "prompt_logprobs": True,
        "top_logprobs": t.logprobs,
        "token_texts": True,
    }
    return ScoreRequest.model_validate({"rows": [row]})


def content(generated: GenerateResult, result: ScoreResult) -> dict[str, Any]:
    """OpenAI's `choices[0].logprobs` of a chat: an entry per generated token."""
    pl = result.rows[0].prompt_logprobs
    if pl is None or pl.texts is None:
        raise ValueError("the score result has no token texts")
    start = len(pl.texts) - len(generated.token_ids)  # the first generated token's position
    entries = []
    for p in range(start, len(pl.texts)):
        alternatives = pl.top_logprobs[p - 1] if pl.top_logprobs else []
        entries.append(
            {
                **_token(pl.texts[p], pl.token_logprobs[p - 1]),
                "top_logprobs": [_token(a.text or "", a.logprob) for a in alternatives],
            }
        )
    return {"content": entries, "refusal": None}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
