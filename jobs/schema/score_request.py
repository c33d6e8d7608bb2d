"""A score job's request (`ScoreRequest`): rows (`ScoreRow`), each a prompt and one question about it
(candidates, continuations, rolling log-likelihood or the prompt's own log-probabilities)."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, field_validator, model_validator

from .request_text import ChatMessage, Text
from .strict_model import StrictModel

MAX_TOP_LOGPROBS = 20


class ScoreRow(StrictModel):
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


class ScoreRequest(StrictModel):
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
