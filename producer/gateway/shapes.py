"""OpenAI's response objects, built from an mlxq job's result and stream events.

The completion's id is the job's id with OpenAI's prefix (`chatcmpl-<job>`, `cmpl-<job>`), so any
gateway instance can find the job again from what the client holds. mlxq's finish reasons `stop` and
`length` are OpenAI's; a job cancelled by its producer ends with `cancelled`, which OpenAI's SDKs pass
through as the string it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlxq.jobs.schema import DoneEvent, GeneratedLogprob, GenerateResult

from . import generated_logprobs
from .translate import Kind

PREFIXES: dict[Kind, str] = {"chat": "chatcmpl-", "completion": "cmpl-"}


def completion_id(kind: Kind, job_id: str) -> str:
    return PREFIXES[kind] + job_id


def job_id_of(completion: str) -> tuple[Kind, str] | None:
    """(kind, job id) of a completion id this gateway made, else None."""
    for kind, prefix in PREFIXES.items():
        if completion.startswith(prefix) and len(completion) > len(prefix):
            return kind, completion[len(prefix) :]
    return None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class Context:
    """What a job's chunks say besides its events; kept in Redis beside the job so another gateway
    instance can resume the stream. `owner`: the digest of the API key that made the job."""

    kind: Kind
    job_id: str
    model: str
    created: int
    include_usage: bool
    owner: str
    index: int = 0  # the choice this job gives (`n` > 1: one job per choice)
    siblings: tuple[str, ...] = ()  # the jobs of choices 1.. (kept with choice 0's, whose id is the answer's)
    answer_job: str | None = None  # a later choice's context: choice 0's job, which names the answer
    per_prompt: int = 1  # choices per prompt (`n`): the jobs are prompt by prompt, n each
    prompt_chars: tuple[int, ...] = ()  # a completion's: each job's prompt's characters (`text_offset`)

    @property
    def id(self) -> str:
        return completion_id(self.kind, self.answer_job or self.job_id)

    @property
    def jobs(self) -> tuple[str, ...]:
        """Every choice's job, in the choices' order."""
        return (self.job_id, *self.siblings)

    def choice(self, index: int) -> Context:
        """The context of choice `index`'s job: the answer's id, the job's own stream."""
        chars = self.prompt_chars[index : index + 1]
        return replace(
            self,
            job_id=self.jobs[index],
            index=index,
            siblings=(),
            answer_job=self.job_id,
            prompt_chars=chars,
        )

    def text_start(self, index: int = 0) -> int:
        """Where choice `index`'s `text_offset`s start: OpenAI counts them from the prompt's first
        character, so a completion's first token is at the prompt's length (a prompt of token ids has
        no text here: its completion's offsets start at 0)."""
        return self.prompt_chars[index] if index < len(self.prompt_chars) else 0

    def fields(self) -> dict[str, str]:
        chars = {"prompt_chars": ",".join(str(c) for c in self.prompt_chars)} if self.prompt_chars else {}
        return {
            "kind": self.kind,
            "model": self.model,
            "created": str(self.created),
            "include_usage": "1" if self.include_usage else "",
            "owner": self.owner,
            "siblings": ",".join(self.siblings),
            "n": str(self.per_prompt),
            **chars,
        }

    @classmethod
    def from_fields(cls, job_id: str, raw: dict[str, str]) -> Context:
        kind = raw["kind"]
        if kind not in PREFIXES:
            raise ValueError(f"not a completion kind: {kind!r}")
        return cls(
            kind,
            job_id,
            raw["model"],
            int(raw["created"]),
            bool(raw.get("include_usage")),
            raw.get("owner", ""),
            siblings=tuple(j for j in raw.get("siblings", "").split(",") if j),
            per_prompt=int(raw.get("n") or 1),
            prompt_chars=tuple(int(c) for c in raw.get("prompt_chars", "").split(",") if c),
        )

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None,
        role: bool,
        logprobs: Sequence[GeneratedLogprob] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """One streamed chunk: a piece of text (with its tokens' logprobs, where the job reports them;
        `offset`: the `text_offset` of the first, see `text_start`), or the end (`finish_reason`)."""
        lp = generated_logprobs.of(self.kind, logprobs, offset)
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": self.index,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": finish_reason,
            }
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": self.index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, dones: Sequence[DoneEvent]) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage`: no choices, the usage of them all."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        counts = [(d.prompt_tokens, d.completion_tokens, d.cached_tokens) for d in dones]
        return {**self._head(obj), "choices": [], "usage": _summed(counts, self.per_prompt)}

    def whole(self, results: Sequence[GenerateResult]) -> dict[str, Any]:
        """The non-streamed answer: a choice per result, in order."""
        counts = [(r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens) for r in results]
        choices: list[dict[str, Any]] = []
        for index, result in enumerate(results):
            choice: dict[str, Any] = {"index": index}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": result.text, "refusal": None}
            else:
                choice["text"] = result.text
            lp = generated_logprobs.of(self.kind, result.logprobs, self.text_start(index))
            choices.append({**choice, "logprobs": lp, "finish_reason": result.finish_reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": _summed(counts, self.per_prompt)}


def _summed(counts: Sequence[tuple[int, int, int]], per_prompt: int) -> dict[str, Any]:
    """The usage of several choices, counted as OpenAI does: each prompt once (its first choice's
    count; a prompt's choices are `per_prompt` jobs in a row), every choice's completion tokens."""
    firsts = counts[::per_prompt]
    return usage(sum(c[0] for c in firsts), sum(c[1] for c in counts), sum(c[2] for c in firsts))
