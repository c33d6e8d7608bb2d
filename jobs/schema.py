"""The wire format: requests, results and stream events, as pydantic models.

Any language may produce jobs and read results; these models are the one definition of what crosses
Redis. Field names follow OpenAI's completions/chat APIs where one exists. Unknown fields are errors,
so a typo (`max_token`) fails the job instead of being silently ignored.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

FinishReason = Literal["stop", "length", "cancelled", "error"]

MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _unicode(v: str) -> str:
    """Text a tokenizer can take: JSON may carry a lone surrogate (`\\ud83d` without its pair), which
    decodes to a Python string that is not Unicode text and that no tokenizer encodes."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"is not valid Unicode: a lone surrogate U+{ord(v[e.start]):04X} at character {e.start} (a JSON "
            "\\u escape of a character beyond U+FFFF must come as a pair: high, then low surrogate)"
        ) from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]  # request text: prompts, messages, stop strings, candidates


def _unicode_values(value: object) -> None:
    """`_unicode` for every string in a JSON-like value (a chat message's extra fields)."""
    if isinstance(value, str):
        _unicode(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _unicode_values(k)
            _unicode_values(v)
    elif isinstance(value, list | tuple):
        for v in value:
            _unicode_values(v)


class ChatMessage(_Strict):
    """One turn of a chat: `role` is free-form (system, user, assistant, tool, ...) for the template."""

    model_config = ConfigDict(extra="allow", frozen=True)  # templates may read e.g. `name`, `tool_calls`
    role: Text = Field(min_length=1)
    content: Text

    @model_validator(mode="after")
    def _extra_is_unicode(self) -> ChatMessage:
        for name, value in (self.model_extra or {}).items():
            try:
                _unicode_values(value)
            except ValueError as e:
                raise ValueError(f"field {name!r} {e}") from None
        return self


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


class SamplingParams(_Strict):
    """Sampling options shared by every generation request."""

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(default_factory=dict)
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0

    @field_validator(
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
    )
    @classmethod
    def _no_nan(cls, v: float, info: ValidationInfo) -> float:
        return _finite(info.field_name or "value", v)


# --- Structured output ---------------------------------------------------------------------------
# `response_format` in OpenAI's shape (`text`, `json_object`, `json_schema`), plus two mlxq types of the
# same shape: `regex` and `grammar` (Lark, as llguidance reads it). One field, so a request carries at
# most one constraint.


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    """Any JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    """OpenAI's `json_schema` object: the schema under `schema` (a JSON Schema document)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, serialize_by_alias=True)
    name: Text = Field(default="response", min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    """JSON that validates against `json_schema.schema`."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(_Strict):
    """Text that matches `regex` whole."""

    type: Literal["regex"]
    regex: Text = Field(min_length=1)


class GrammarFormat(_Strict):
    """Text of the Lark grammar `grammar` (its `start` rule), in llguidance's dialect of Lark."""

    type: Literal["grammar"]
    grammar: Text = Field(min_length=1)


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat,
    Field(discriminator="type"),
]


class GenerateRequest(SamplingParams):
    """A generation job: exactly one of `prompt` (raw text), `messages` (rendered by the chat template)
    or `prompt_ids` (the prompt as token ids, taken as they are: OpenAI's token-id prompts).

    A `prompt` is untrusted text: the text of a special token in it (`<|im_start|>`) is encoded as
    ordinary text, never as that control token, unless `allow_special_tokens` says the producer wrote
    the control tokens on purpose (a prompt formatted by hand). `add_special_tokens`: the BOS/EOS the
    tokenizer adds around a prompt. Chat `messages` are always encoded as text inside the template.
    `response_format` constrains the output to JSON (a schema), a regex or a grammar (see above).
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


class Usage(_Strict):
    """Token counts; `draft_tokens`: tokens drafted for speculative decoding, `accepted_tokens`: those of
    them the model kept (each kept one is a completion token that cost no step of its own)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class Timings(_Strict):
    """Seconds, measured in the worker. `ttft_s` is from the job's start to its first token."""

    queued_s: float | None = None
    ttft_s: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None


class GeneratedLogprob(_Strict):
    """A generated token's log-probability under the model, its `text` alone (a token that holds part
    of a character decodes to U+FFFD) and its `top` alternatives (most likely first, each with its
    text), where the request asked `logprobs`."""

    id: int
    logprob: float
    text: str = ""
    top: list[TopLogprob] = Field(default_factory=list)


class GenerateResult(_Strict):
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
        return _without_none(handler(self), ("logprobs",))


MAX_TOP_LOGPROBS = 20


class ScoreRow(_Strict):
    """One row of a score job: a `prompt` and exactly one kind of question about it.

    - `candidates`: the logit and log-probability of each candidate as the prompt's next token (each
      candidate must add exactly one ordinary token; the ollama runner's semantics).
    - `continuations`: lm-evaluation-harness' `loglikelihood`: per continuation the sum of its tokens'
      log-probabilities after the prompt, each token's, and whether every token is the argmax. Tokenized
      as lm-eval's Hugging Face backend does: whitespace ending the prompt moves to the continuation,
      prompt+continuation is encoded whole and split at the (moved) prompt's own token count.
    - `rolling`: lm-eval's `loglikelihood_rolling` (perplexity): the whole prompt scored in disjoint
      windows of `window` tokens (default: the request's `max_tokens`, else the model's context), the
      first token conditioned on the BOS token (the EOS token where the tokenizer has no BOS).
    - `prompt_logprobs`: each prompt token's log-probability (the first has none), with the
      `top_logprobs` most likely alternatives per position and the log-probabilities of `token_ids` at
      every position where asked. Such a row may give its prompt as token ids (`prompt_ids`, taken as
      they are: no special tokens added) or as chat `messages` (rendered as a generation renders them)
      instead of text, and `completion_ids` after it (a generation's
      tokens, scored after its prompt); `token_texts` asks for each token's text and
      offset (OpenAI's `echo` with `logprobs`); `next_token` also asks for the `top_logprobs` (at least
      one) alternatives of the token after the prompt, which is what a greedy one-token completion takes.
    """

    prompt: Text = ""  # "" where `prompt_ids` gives it, or an empty context (lm-eval's)
    prompt_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    completion_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=1_000_000)
    token_texts: bool = False
    next_token: bool = False
    candidates: list[Text] | None = Field(default=None, min_length=1)
    continuations: list[Text] | None = Field(default=None, min_length=1)
    rolling: bool = False
    window: Annotated[int, Field(ge=2, le=1_000_000)] | None = None
    prompt_logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=256)

    @field_validator("candidates")
    @classmethod
    def _no_duplicates(cls, v: list[str] | None) -> list[str] | None:
        seen: set[str] = set()
        for c in v or []:
            if c in seen:
                raise ValueError(f"candidate {c!r} appears twice")
            seen.add(c)
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> ScoreRow:
        kinds = [
            k
            for k, on in (
                ("candidates", self.candidates is not None),
                ("continuations", self.continuations is not None),
                ("rolling", self.rolling),
                ("prompt_logprobs", self.prompt_logprobs),
            )
            if on
        ]
        if len(kinds) != 1:
            raise ValueError(
                "a row asks exactly one of `candidates`, `continuations`, `rolling` or `prompt_logprobs`"
                + (f"; this one asks {', '.join(kinds)}" if kinds else "")
            )
        if self.window is not None and not self.rolling:
            raise ValueError("`window` belongs to a `rolling` row")
        extras = (
            self.top_logprobs or self.token_ids or self.token_texts or self.next_token or self.completion_ids
        )
        other_prompt = self.prompt_ids is not None or self.messages is not None
        if (extras or other_prompt) and not self.prompt_logprobs:
            raise ValueError(
                "`top_logprobs`, `token_ids`, `token_texts`, `next_token`, `prompt_ids`, `messages` and "
                "`completion_ids` belong to a `prompt_logprobs` row"
            )
        if sum((bool(self.prompt), self.prompt_ids is not None, self.messages is not None)) > 1:
            raise ValueError("give the prompt once: as `prompt` (text), `prompt_ids` or `messages`")
        return self

    @property
    def kind(self) -> str:
        if self.candidates is not None:
            return "candidates"
        if self.continuations is not None:
            return "continuations"
        return "rolling" if self.rolling else "prompt_logprobs"


class ScoreRequest(_Strict):
    """A scoring job: rows of questions about prompts (see `ScoreRow`).

    Rows' prompts and candidates are untrusted text, as a generation job's `prompt` is (see
    `GenerateRequest`): special-token text is encoded as text unless `allow_special_tokens`.
    `max_tokens` bounds what each row sends through the model, as the ollama runner does: a prompt (with
    its longest continuation) must have 1..max_tokens tokens and is never truncated; None: the model's
    context. A rolling row is cut into windows instead (at most `max_tokens` each).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
    rows: list[ScoreRow] = Field(min_length=1)
    add_special_tokens: bool = True
    allow_special_tokens: bool = False
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None


class ContinuationScore(_Strict):
    logprob: float  # the sum of `token_logprobs`
    is_greedy: bool  # every token is the argmax after what precedes it
    token_logprobs: list[float]
    tokens: list[int]


class RollingScore(_Strict):
    logprob: float  # the whole text's, each token scored once
    tokens: int  # tokens scored (the text's own)
    windows: int


def _without_none(data: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`data` less the fields among `names` that are None: fields a reader must have asked for, so an
    older reader (which forbids unknown fields) never sees them."""
    for name in names:
        if data.get(name) is None:
            data.pop(name, None)
    return data


class TopLogprob(_Strict):
    """An alternative token; its `text` only where the row asked `token_texts`."""

    id: int
    logprob: float
    text: str | None = None

    @model_serializer(mode="wrap")
    def _text_if_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self), ("text",))


class PromptLogprobs(_Strict):
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
        return _without_none(handler(self), ("first_token", "texts", "offsets", "next_top", "next_ends"))


class ScoredRow(_Strict):
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


class ScoreResult(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
    rows: list[ScoredRow]
    input_tokens: int
    cached_tokens: int
    model: str = ""


# --- Stream events -------------------------------------------------------------------------------
# A Redis stream entry is a flat map of strings; each event knows how to become one and come back.


class TokenEvent(_Strict):
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


class DoneEvent(_Strict):
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


class ErrorEvent(_Strict):
    event: Literal["error"] = "error"
    message: str

    def fields(self) -> dict[str, str]:
        return {"event": self.event, "message": self.message}


class RestartEvent(_Strict):
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
