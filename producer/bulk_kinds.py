"""What a bulk run sends and writes for each kind of job: scoring rows or generating from prompts.

The run itself (`bulk.py`) and its files (`bulk_files.py`) are the same for both; a kind says which
input keys make a row, which job carries rows, how a job's result splits back into rows, and what an
output line holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from mlxq import jobs
from mlxq.jobs import keys
from mlxq.jobs.schema import GenerateRequest, GenerateResult, ScoredRow, ScoreRequest, ScoreRow

from . import payload


class BadRow(ValueError):
    """An input line that is not a row of this kind, for a reason a validation error does not give."""


class RowNotDone(Exception):
    """A job that finished without doing its row (a generation someone cancelled): the row fails with
    this reason, so a rerun does it again."""


MAX_SCORE_ROWS_PER_JOB = 64
"""A worker's default `MLXQ_MAX_SCORE_ROWS`."""


@dataclass(frozen=True)
class RowTokens:
    """A finished row's token counts, for the run's summary."""

    input: int
    cached: int
    generated: int = 0


class BulkKind(Protocol):
    @property
    def name(self) -> str:
        """`score` or `generate`: how validation errors name the request."""
        ...

    @property
    def func(self) -> str:
        """The job function rows travel in."""
        ...

    @property
    def max_rows_per_job(self) -> int: ...

    @property
    def window_jobs(self) -> int:
        """How many rounds of in-flight jobs may finish behind the oldest unfinished row (their lines
        wait in memory for it) before the run stops reading new rows."""
        ...

    def row(self, obj: Mapping[str, Any]) -> Any:
        """The row an input object asks for; `pydantic.ValidationError` or `BadRow` if it is not one."""
        ...

    def request(self, rows: Sequence[Any]) -> ScoreRequest | GenerateRequest:
        """The job that carries `rows` (at most `max_rows_per_job`)."""
        ...

    def results(self, raw: bytes) -> Sequence[Any]:
        """A finished job's result key, one result per row; `ValidationError` if it is not one,
        `RowNotDone` if the job ended without doing its rows."""
        ...

    def record(self, result: Any, row: Any) -> dict[str, Any]:
        """An output line's fields (besides `custom_id`), from the row's result (and the row)."""
        ...

    def error_record(self, custom_id: str | None, line: int, error: str, ran: bool) -> dict[str, Any]:
        """An errors-file line: the input `line` that failed, and why; `ran`: its job failed (else the
        line was no row of this kind)."""
        ...

    def tokens(self, result: Any) -> RowTokens: ...


def mlxq_error_record(custom_id: str | None, line: int, error: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "line": line, "error": error}


_SCORE_ROW_KEYS = tuple(ScoreRow.model_fields)


@dataclass(frozen=True)
class ScoreKind:
    """Rows `{custom_id, prompt, candidates | continuations | rolling | prompt_logprobs, ...}` (any
    `ScoreRow`), several to a `jobs.score` job."""

    add_special_tokens: bool = True
    max_tokens: int | None = None  # see `ScoreRequest`
    allow_special_tokens: bool = False  # special-token text in rows is a control token (see `ScoreRequest`)
    name: str = "score"
    func: str = keys.SCORE_FUNC
    max_rows_per_job: int = MAX_SCORE_ROWS_PER_JOB
    window_jobs: int = 2  # a score job's rows take about as long as its neighbours'

    def row(self, obj: Mapping[str, Any]) -> ScoreRow:
        if isinstance(obj.get("body"), Mapping) and "prompt" not in obj:
            raise BadRow(
                "an OpenAI Batch API request line (custom_id, method, url, body) among mlxq score rows "
                '({"custom_id", "prompt", "candidates"}): score-file takes Batch lines of completions with '
                "echo/logprobs in a file of them (--format openai); generate-file takes the others"
            )
        return ScoreRow.model_validate({k: obj[k] for k in _SCORE_ROW_KEYS if k in obj})

    def request(self, rows: Sequence[Any]) -> ScoreRequest:
        return ScoreRequest(
            rows=list(rows),
            add_special_tokens=self.add_special_tokens,
            allow_special_tokens=self.allow_special_tokens,
            max_tokens=self.max_tokens,
        )

    def results(self, raw: bytes) -> Sequence[ScoredRow]:
        return payload.score_result(raw).rows

    def record(self, result: ScoredRow, row: Any) -> dict[str, Any]:
        return result.model_dump(mode="json")

    def error_record(self, custom_id: str | None, line: int, error: str, ran: bool) -> dict[str, Any]:
        return mlxq_error_record(custom_id, line, error)

    def tokens(self, result: ScoredRow) -> RowTokens:
        return RowTokens(result.input_tokens, result.cached_tokens)


_GENERATE_KEYS = tuple(GenerateRequest.model_fields)


@dataclass(frozen=True)
class GenerateKind:
    """Rows `{custom_id, prompt | messages, ...}`, one `jobs.generate` job each. A row's own
    `GenerateRequest` fields (max_tokens, temperature, stop, seed, ...) win over `defaults`."""

    defaults: Mapping[str, Any] = field(default_factory=dict)
    name: str = "generate"
    func: str = keys.GENERATE_FUNC
    max_rows_per_job: int = 1
    # Generations differ in length many times over: a small window lets one long row among short ones
    # stop the reading once the short rows behind it are done, and the worker starves.
    window_jobs: int = 16

    def __post_init__(self) -> None:
        unknown = sorted(
            set(self.defaults) - set(_GENERATE_KEYS) | set(self.defaults) & {"prompt", "messages"}
        )
        if unknown:
            raise ValueError(f"not generation options for every row: {', '.join(unknown)}")
        try:  # a bad default would fail every row: say so once, before anything is sent
            GenerateRequest.model_validate({**self.defaults, "prompt": "-"})
        except ValidationError as e:
            raise ValueError(jobs.describe_validation_error("generate", e)) from None

    def row(self, obj: Mapping[str, Any]) -> GenerateRequest:
        if isinstance(obj.get("body"), Mapping):
            return GenerateRequest.model_validate({**self.defaults, **_openai_body(obj)})
        return GenerateRequest.model_validate(
            {**self.defaults, **{k: obj[k] for k in _GENERATE_KEYS if k in obj}}
        )

    def request(self, rows: Sequence[Any]) -> GenerateRequest:
        (only,) = rows
        assert isinstance(only, GenerateRequest)
        return only

    def results(self, raw: bytes) -> Sequence[GenerateResult]:
        result = payload.generate_result(raw)
        if result.finish_reason == "cancelled":
            n = result.usage.completion_tokens
            raise RowNotDone(f"the job was cancelled after {n} generated token{'s' * (n != 1)}")
        return [result]

    def record(self, result: GenerateResult, row: Any) -> dict[str, Any]:
        return result.model_dump(mode="json")

    def error_record(self, custom_id: str | None, line: int, error: str, ran: bool) -> dict[str, Any]:
        return mlxq_error_record(custom_id, line, error)

    def tokens(self, result: GenerateResult) -> RowTokens:
        u = result.usage
        return RowTokens(u.prompt_tokens, u.cached_tokens, u.completion_tokens)


_OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")


def _openai_body(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The request of an OpenAI Batch API line (`{custom_id, method, url, body}`): the body's fields but
    `model` (the worker serves its own), `max_completion_tokens` read as `max_tokens`. Fields mlxq has
    not got (`n`, `tools`, ...) fail the row by name, as any unknown field does."""
    url = obj.get("url", _OPENAI_URLS[0])
    if url not in _OPENAI_URLS:
        raise BadRow(f"url {url!r} is not one mlxq serves ({' or '.join(_OPENAI_URLS)})")
    body = {k: v for k, v in obj["body"].items() if k != "model"}
    if "max_completion_tokens" in body:
        body.setdefault("max_tokens", body.pop("max_completion_tokens"))
    return body
