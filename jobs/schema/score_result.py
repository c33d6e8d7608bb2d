"""What a finished score job returns (`ScoreResult`): per row (`ScoredRow`) the answer to its question
(candidate logits, `ContinuationScore`, `RollingScore` or `PromptLogprobs`) and its token counts; each
row serializes only what its kind asked."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from .logprobs import TopLogprob
from .strict_model import StrictModel, without_none


class ContinuationScore(StrictModel):
    logprob: float  # the sum of `token_logprobs`
    is_greedy: bool  # every token is the argmax after what precedes it
    token_logprobs: list[float]
    tokens: list[int]


class RollingScore(StrictModel):
    logprob: float  # the whole text's, each token scored once
    tokens: int  # tokens scored (the text's own)
    windows: int


class PromptLogprobs(StrictModel):
    """Per prompt token from the second: its id, its log-probability, the `top_logprobs` alternatives
    (most likely first) and the log-probabilities of the row's `token_ids`, in their order.

    Where the row asked `token_texts`: `texts` and `offsets` of every prompt token, the first included
    (the texts' concatenation is the decoded prompt; a token that ends inside a character has the text
    "" and the next one carries the character). Where it asked `next_token`: `next_top`, the likeliest
    tokens after the prompt (most likely first), and `next_ends`: whether the likeliest is an end of
    sequence (a greedy generation would stop there, with no text)."""

    tokens: list[int]
    token_logprobs: list[float]
    top_logprobs: list[list[TopLogprob]] = Field(default_factory=list)
    chosen_logprobs: list[list[float]] = Field(default_factory=list)
    first_token: int | None = None
    texts: list[str] | None = None
    offsets: list[int] | None = None
    next_top: list[TopLogprob] | None = None
    next_ends: bool | None = None

    @model_serializer(mode="wrap")
    def _extras_if_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return without_none(handler(self), ("first_token", "texts", "offsets", "next_top", "next_ends"))


class ScoredRow(StrictModel):
    """A row's answer: `logits`/`logprobs` for candidates, else the field named after its kind."""

    logits: list[float] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    continuations: list[ContinuationScore] | None = None
    rolling: RollingScore | None = None
    prompt_logprobs: PromptLogprobs | None = None
    input_tokens: int
    cached_tokens: int

    @model_serializer(mode="wrap")
    def _only_what_was_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A candidates row serializes as it always has (logits, logprobs, token counts); another kind's
        row has its own field instead of empty candidate lists."""
        data: dict[str, Any] = handler(self)
        kinds = ("continuations", "rolling", "prompt_logprobs")
        for k in kinds:
            if data.get(k) is None:
                data.pop(k, None)
        if any(k in data for k in kinds):
            data.pop("logits", None)
            data.pop("logprobs", None)
        return data


class ScoreResult(StrictModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
    rows: list[ScoredRow]
    input_tokens: int
    cached_tokens: int
    model: str = ""
