"""A generation job's stream events (`TokenEvent`, `DoneEvent`, `ErrorEvent`, `RestartEvent`). A Redis
stream entry is a flat map of strings; each event knows how to become one (`fields`) and come back
(`parse_event`)."""

from __future__ import annotations

import json
from typing import Literal

from .generate_result import FinishReason
from .logprobs import GeneratedLogprob
from .strict_model import StrictModel


class TokenEvent(StrictModel):
    event: Literal["token"] = "token"
    text: str
    ids: list[int]
    index: int  # position of ids[0] among the completion tokens
    logprobs: list[GeneratedLogprob] | None = None  # one per id, where the request asked `logprobs`

    def fields(self) -> dict[str, str]:
        out = {"event": self.event, "text": self.text, "ids": json.dumps(self.ids), "index": str(self.index)}
        if self.logprobs is not None:
            out["logprobs"] = json.dumps([lp.model_dump(mode="json") for lp in self.logprobs])
        return out


class DoneEvent(StrictModel):
    event: Literal["done"] = "done"
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    total_s: float = 0.0
    draft_tokens: int = 0  # speculative decoding: tokens drafted, and those of them kept (`Usage`)
    accepted_tokens: int = 0

    def fields(self) -> dict[str, str]:
        return {k: ("" if v is None else str(v)) for k, v in self.model_dump().items()}


class ErrorEvent(StrictModel):
    event: Literal["error"] = "error"
    message: str

    def fields(self) -> dict[str, str]:
        return {"event": self.event, "message": self.message}


class RestartEvent(StrictModel):
    """The job was retried: readers discard the text they have shown so far."""

    event: Literal["restart"] = "restart"
    attempt: int

    def fields(self) -> dict[str, str]:
        return {"event": self.event, "attempt": str(self.attempt)}


StreamEvent = TokenEvent | DoneEvent | ErrorEvent | RestartEvent


def parse_event(fields: dict[str, str]) -> StreamEvent:
    """Turn a stream entry's (decoded) field map back into its event model."""
    kind = fields.get("event")
    if kind == "token":
        logprobs = fields.get("logprobs")
        return TokenEvent(
            text=fields["text"],
            ids=json.loads(fields["ids"]),
            index=int(fields["index"]),
            logprobs=None if logprobs is None else json.loads(logprobs),
        )
    if kind == "done":
        data = {k: (None if v == "" else v) for k, v in fields.items()}
        return DoneEvent.model_validate(data)
    if kind == "error":
        return ErrorEvent(message=fields.get("message", ""))
    if kind == "restart":
        return RestartEvent(attempt=int(fields.get("attempt", "0")))
    raise ValueError(f"unknown stream event {kind!r} in {fields!r}")
