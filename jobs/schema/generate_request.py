"""A generation job's request (`GenerateRequest`): its prompt (text, chat messages or token ids), its
budget and stop strings, its sampling settings and output constraint, drafting and logprobs asked."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from .request_text import ChatMessage, Text
from .response_format import ResponseFormat
from .sampling_params import SamplingParams

MAX_STOP_STRINGS = 16


class GenerateRequest(SamplingParams):
    """A generation job: exactly one of `prompt` (raw text), `messages` (rendered by the chat template)
    or `prompt_ids` (the prompt as token ids, taken as they are: OpenAI's token-id prompts).

    A `prompt` is untrusted text: the text of a special token in it (`<|im_start|>`) is encoded as
    ordinary text, never as that control token, unless `allow_special_tokens` says the producer wrote
    the control tokens on purpose (a prompt formatted by hand). `add_special_tokens`: the BOS/EOS the
    tokenizer adds around a prompt. Chat `messages` are always encoded as text inside the template.
    `response_format` constrains the output to JSON (a schema), a regex or a grammar (`response_format`).
    """

    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    prompt_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    stop: list[Text] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    add_special_tokens: bool = True
    allow_special_tokens: bool = False
    response_format: ResponseFormat | None = None
    # Speculative decoding: at most this many draft tokens per step for this job (0: off); None: as the
    # worker's policy decides. Never changes what is generated, only how fast.
    max_draft_tokens: Annotated[int, Field(ge=0, le=64)] | None = None
    # Generated tokens' log-probabilities under the model (before bias, penalties, temperature and
    # filters, as OpenAI reports them), each with this many likeliest alternatives; None: off.
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        return [v] if isinstance(v, str) else ([] if v is None else v)

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_ids)]
        if sum(given) != 1:
            raise ValueError(
                "give exactly one of `prompt` or `messages` (or `prompt_ids`, the prompt as token ids)"
            )
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must hold at least one message")
        return self
