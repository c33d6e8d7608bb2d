"""What a finished generation job returns (`GenerateResult`): its text, why it ended (`FinishReason`),
its token ids, token counts (`Usage`) and the worker's timings (`Timings`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, SerializerFunctionWrapHandler, model_serializer

from .logprobs import GeneratedLogprob
from .strict_model import StrictModel, without_none

FinishReason = Literal["stop", "length", "cancelled", "error"]


class Usage(StrictModel):
    """Token counts; `draft_tokens`: tokens drafted for speculative decoding, `accepted_tokens`: those of
    them the model kept (each kept one is a completion token that cost no step of its own)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class Timings(StrictModel):
    """Seconds, measured in the worker. `ttft_s` is from the job's start to its first token."""

    queued_s: float | None = None
    ttft_s: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None


class GenerateResult(StrictModel):
    """What a finished generation job returns (result key and RQ result); `logprobs` (one per
    completion token) only where the request asked for them."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
    text: str
    finish_reason: FinishReason
    token_ids: list[int]
    usage: Usage
    timings: Timings
    model: str = ""
    logprobs: list[GeneratedLogprob] | None = None

    @model_serializer(mode="wrap")
    def _logprobs_if_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return without_none(handler(self), ("logprobs",))
