"""OpenAI's `logprobs` objects of generated tokens, from the logprobs a generation job reports itself.

A job asked `logprobs: K` computes each token's log-probability under the model (and its K likeliest
alternatives) in the decode step that samples it, so the gateway needs no score job for generated text
and can stream them: a chat's `choices[].logprobs.content` entries (token text, logprob, UTF-8 bytes,
`top_logprobs`), a completion's `tokens`/`token_logprobs`/`top_logprobs`/`text_offset` (offsets counted
as OpenAI's legacy completions count them, from the prompt's first character: the first generated
token's is the prompt's length; going on where a resumed stream left off). A token's text is its
text alone: one that holds part of a character shows U+FFFD there, and its `bytes` are those of that
text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxq.jobs.schema import GeneratedLogprob


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat(logprobs: Sequence[GeneratedLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`: an entry per token."""
    content = [
        {**_entry(lp.text, lp.logprob), "top_logprobs": [_entry(a.text or "", a.logprob) for a in lp.top]}
        for lp in logprobs
    ]
    return {"content": content, "refusal": None}


def completion(logprobs: Sequence[GeneratedLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion choice's (or chunk's) `logprobs`; `offset`: the first token's `text_offset` (the
    prompt's characters and the completion's before it)."""
    offsets: list[int] = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.text)
    return {
        "tokens": [lp.text for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{a.text or "": a.logprob for a in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def of(kind: str, logprobs: Sequence[GeneratedLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """The `logprobs` of a choice or chunk of `kind` (None where the job reported none)."""
    if logprobs is None:
        return None
    return chat(logprobs) if kind == "chat" else completion(logprobs, offset)
