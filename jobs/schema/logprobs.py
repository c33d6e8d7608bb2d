"""Tokens' log-probabilities as results and stream events report them: a generated token's
(`GeneratedLogprob`) and an alternative token's (`TopLogprob`), which score results use too."""

from __future__ import annotations

from typing import Any

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from .strict_model import StrictModel, without_none


class TopLogprob(StrictModel):
    """An alternative token; its `text` only where the row asked `token_texts`."""

    id: int
    logprob: float
    text: str | None = None

    @model_serializer(mode="wrap")
    def _text_if_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return without_none(handler(self), ("text",))


class GeneratedLogprob(StrictModel):
    """A generated token's log-probability under the model, its `text` alone (a token that holds part
    of a character decodes to U+FFFD) and its `top` alternatives (most likely first, each with its
    text), where the request asked `logprobs`."""

    id: int
    logprob: float
    text: str = ""
    top: list[TopLogprob] = Field(default_factory=list)
