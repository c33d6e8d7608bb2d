"""Bulk files in OpenAI's Batch API format: request lines in, OpenAI's output and error lines out.

An input line is `{custom_id, method: "POST", url, body}`, its body read by the gateway's own rules
(`gateway.translate` for `/v1/chat/completions` and `/v1/completions`, `gateway.echo` for a completion
with `echo`/`logprobs`, which a score file runs), so a line runs here exactly as it would in a batch
sent to `mlxq serve`, and what mlxq cannot do fails the line by name. An output line is
`{id, custom_id, response: {status_code, request_id, body}, error}` with the body OpenAI's endpoint
would answer; a failed line goes to the errors file in the same shape (status 400: the line is no
request mlxq runs; 500: its job failed). The runs themselves are the ordinary bulk runs (`bulk`), whose
kinds these wrap. `detect` tells the format from a file's first line.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mlxq.jobs import keys
from mlxq.jobs.schema import GenerateRequest, GenerateResult, ScoredRow, ScoreResult, ScoreRow

from . import payload
from .bulk_kinds import MAX_SCORE_ROWS_PER_JOB, BadRow, GenerateKind, RowTokens, ScoreKind
from .gateway import echo, translate
from .gateway.errors import ApiError
from .gateway.shapes import Context, completion_id

URLS: dict[str, translate.Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def detect(source: object, chosen: str) -> Literal["mlxq", "openai"]:
    """The format of a bulk input: `chosen`, or (auto) OpenAI's where the file's first line is a
    request line (`custom_id`, `url`, `body`); rows given as Python objects are mlxq's unless chosen."""
    if chosen == "mlxq":
        return "mlxq"
    if chosen == "openai":
        return "openai"
    if chosen != "auto":
        raise ValueError(f"the batch format is auto, mlxq or openai, not {chosen!r}")
    if not isinstance(source, str | os.PathLike):
        return "mlxq"
    with open(Path(source), encoding="utf-8", errors="replace") as f:
        for text in f:
            if text.strip():
                try:
                    first = json.loads(text)
                except json.JSONDecodeError:
                    return "mlxq"
                return "openai" if isinstance(first, dict) and {"url", "body"} <= set(first) else "mlxq"
    return "mlxq"


@dataclass(frozen=True)
class BatchLine:
    """A request line as mlxq runs it: the endpoint's kind, the model it names, the row of the job,
    and (a scored completion) how its answer is built."""

    kind: translate.Kind
    model: str
    row: GenerateRequest | ScoreRow
    ask: echo.EchoAsk | None = None


def _body(obj: Mapping[str, Any], urls: Sequence[str]) -> tuple[translate.Kind, dict[str, Any]]:
    if obj.get("method", "POST") != "POST":
        raise BadRow(f"method {obj.get('method')!r}: a batch request is a POST")
    url = obj.get("url")
    if url not in urls:
        raise BadRow(f"url {url!r} is not one this command runs ({' or '.join(urls)})")
    body = obj.get("body")
    if not isinstance(body, Mapping):
        raise BadRow("`body` must be a JSON object (an OpenAI Batch API request line)")
    return URLS[str(url)], dict(body)


def _refused(e: ApiError) -> BadRow:
    return BadRow(e.message)


def response_line(custom_id: str | None, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's batch output line (without `custom_id` where None: the bulk writer puts it first)."""
    request_id = uuid.uuid4().hex
    line: dict[str, Any] = {"id": f"batch_req_{request_id}"}
    if custom_id is not None:
        line["custom_id"] = custom_id
    line["response"] = {"status_code": status, "request_id": request_id, "body": body}
    line["error"] = None
    return line


def error_line(custom_id: str | None, error: str, ran: bool) -> dict[str, Any]:
    kind, code = ("server_error", "job_failed") if ran else ("invalid_request_error", "invalid_request")
    body = {"error": {"message": error, "type": kind, "param": None, "code": code}}
    return {"custom_id": custom_id, **response_line(None, 500 if ran else 400, body)}


@dataclass(frozen=True)
class OpenAIGenerateKind:
    """`generate-file` over request lines: one generation job each (`GenerateKind`'s), its result as
    the endpoint's answer. `defaults` fill what a line's body leaves unset, as with mlxq's rows."""

    inner: GenerateKind
    name: str = "generate"
    func: str = keys.GENERATE_FUNC
    max_rows_per_job: int = 1
    window_jobs: int = 16

    def row(self, obj: Mapping[str, Any]) -> BatchLine:
        kind, body = _body(obj, tuple(URLS))
        try:
            if kind == "completion" and echo.wanted(body):
                raise BadRow("`echo`/`logprobs` lines are scored: run them with `mlxq score-file`")
            t = translate.chat(body) if kind == "chat" else translate.completion(body)
        except ApiError as e:
            raise _refused(e) from None
        if t.logprobs is not None:
            raise BadRow("a chat's `logprobs` are for the gateway (`mlxq serve`), not for a batch line")
        if t.stream or t.n > 1 or t.more:
            raise BadRow(
                "`stream`, `n` > 1 and lists of prompts are not for a batch line: give each its own line"
            )
        own = payload.wire_payload(t.request)
        request = GenerateRequest.model_validate({**self.inner.defaults, **own})
        return BatchLine(kind, t.model, request)

    def request(self, rows: Sequence[Any]) -> GenerateRequest:
        (only,) = rows
        return self.inner.request([only.row])

    def results(self, raw: bytes) -> Sequence[GenerateResult]:
        return self.inner.results(raw)

    def record(self, result: GenerateResult, row: BatchLine) -> dict[str, Any]:
        prompt = row.row.prompt if isinstance(row.row, GenerateRequest) else None
        chars = (len(prompt),) if row.kind == "completion" and prompt else ()  # where `text_offset` starts
        ctx = Context(row.kind, uuid.uuid4().hex, row.model, int(time.time()), False, "", prompt_chars=chars)
        return response_line(None, 200, ctx.whole([result]))

    def error_record(self, custom_id: str | None, line: int, error: str, ran: bool) -> dict[str, Any]:
        return error_line(custom_id, f"line {line}: {error}", ran)

    def tokens(self, result: GenerateResult) -> RowTokens:
        return self.inner.tokens(result)


@dataclass(frozen=True)
class OpenAIScoreKind:
    """`score-file` over request lines: `POST /v1/completions` with `echo`/`logprobs` (one prompt a
    line), several to a score job (`ScoreKind`'s), each answered as the gateway answers it."""

    inner: ScoreKind
    name: str = "score"
    func: str = keys.SCORE_FUNC
    max_rows_per_job: int = MAX_SCORE_ROWS_PER_JOB
    window_jobs: int = 2

    def row(self, obj: Mapping[str, Any]) -> BatchLine:
        kind, body = _body(obj, tuple(URLS))
        if kind != "completion" or not echo.wanted(body):
            raise BadRow(
                "score-file runs POST /v1/completions lines with `echo` or `logprobs`; run generations "
                "with `mlxq generate-file`"
            )
        try:
            ask = echo.parse(body, translate.model_of(body))
        except ApiError as e:
            raise _refused(e) from None
        if ask.generate is not None:
            raise BadRow(
                "score-file scores prompts (`max_tokens` 0, or 1 at `temperature` 0); a completion to "
                "generate with its logprobs is for the gateway (`mlxq serve`)"
            )
        if len(ask.request.rows) != 1:
            raise BadRow("a batch line scores one prompt: give each prompt its own line")
        return BatchLine("completion", ask.model, ask.request.rows[0], ask)

    def request(self, rows: Sequence[Any]) -> Any:
        return self.inner.request([r.row for r in rows])

    def results(self, raw: bytes) -> Sequence[ScoredRow]:
        return self.inner.results(raw)

    def record(self, result: ScoredRow, row: BatchLine) -> dict[str, Any]:
        assert row.ask is not None
        one = ScoreResult(rows=[result], input_tokens=result.input_tokens, cached_tokens=result.cached_tokens)
        body = echo.answer(row.ask, completion_id("completion", uuid.uuid4().hex), int(time.time()), one)
        return response_line(None, 200, body)

    def error_record(self, custom_id: str | None, line: int, error: str, ran: bool) -> dict[str, Any]:
        return error_line(custom_id, f"line {line}: {error}", ran)

    def tokens(self, result: ScoredRow) -> RowTokens:
        return self.inner.tokens(result)
