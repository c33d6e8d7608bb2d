"""Requests checked on the producer before they are enqueued, and results checked when they come back.

A bad request fails here, at submission, with the same readable message the worker would give
(`jobs.errors.InvalidRequest`), instead of as a failed job later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import TypeAdapter

from mlxq import jobs
from mlxq.jobs.schema import ChatMessage, GenerateRequest, GenerateResult, ScoreRequest, ScoreResult, ScoreRow


def generate_request(
    prompt: str | GenerateRequest | None = None,
    messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
    params: Mapping[str, Any] | None = None,
) -> GenerateRequest:
    """A validated `GenerateRequest` from a prompt or chat messages plus sampling options.

    A `GenerateRequest` passed as `prompt` is used as it is (no other arguments allowed with it).
    """
    if isinstance(prompt, GenerateRequest):
        if messages is not None or params:
            raise TypeError("pass either a GenerateRequest or prompt/messages/options, not both")
        return prompt
    data: dict[str, Any] = dict(params or {})
    if prompt is not None:
        data["prompt"] = prompt
    if messages is not None:
        data["messages"] = [_plain(m) for m in messages]
    return jobs.parse_generate(data)


def score_request(
    rows: ScoreRequest | Sequence[ScoreRow | Mapping[str, Any]],
    params: Mapping[str, Any] | None = None,
) -> ScoreRequest:
    """A validated `ScoreRequest` from rows of `{prompt, candidates}` (or a ready `ScoreRequest`)."""
    if isinstance(rows, ScoreRequest):
        if params:
            raise TypeError("pass either a ScoreRequest or rows/options, not both")
        return rows
    data: dict[str, Any] = {**(params or {}), "rows": [_plain(r) for r in rows]}
    return jobs.parse_score(data)


def wire_payload(request: GenerateRequest | ScoreRequest) -> dict[str, Any]:
    """The job's one argument: the request as JSON, defaults left out (the worker fills them in)."""
    data = request.model_dump(mode="json", exclude_defaults=True)
    if isinstance(request, ScoreRequest):
        for row in data["rows"]:
            if "prompt_ids" not in row:  # an empty prompt still spelled out: older workers require the field
                row.setdefault("prompt", "")
    return data


def _plain(item: Any) -> Any:
    if isinstance(item, ChatMessage | ScoreRow):
        return item.model_dump(mode="json")
    return dict(item) if isinstance(item, Mapping) else item


ResultData = bytes | str | dict[str, Any]
"""A result as found: the JSON text of the result key, or RQ's return value (a dict)."""


def _loaded(data: ResultData) -> Any:
    return json.loads(data) if isinstance(data, bytes | str) else data


def generate_result(data: ResultData) -> GenerateResult:
    """Validate a generation job's result."""
    return GenerateResult.model_validate(_loaded(data))


def score_result(data: ResultData) -> ScoreResult:
    """Validate a score job's result."""
    return ScoreResult.model_validate(_loaded(data))


_ANY_RESULT: TypeAdapter[GenerateResult | ScoreResult] = TypeAdapter(GenerateResult | ScoreResult)


def any_result(data: ResultData) -> GenerateResult | ScoreResult:
    """Validate a result of either kind (both models forbid unknown fields, so the shape decides)."""
    return _ANY_RESULT.validate_python(_loaded(data))
