"""mlxq's job contract: request/result models, Redis key names, errors, and the RQ job functions.

Never imports mlx: producers (web backends) import this package. `generate` and `score` are the only
functions an mlxq worker runs; RQ finds them by their names `jobs.generate` and `jobs.score`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from . import runtime
from .errors import InvalidRequest
from .schema import GenerateRequest, ScoreRequest


def _job_id() -> str:
    from rq import get_current_job

    job = get_current_job()
    return job.id if job is not None else "local"


def describe_validation_error(kind: str, err: ValidationError) -> str:
    """One readable line per problem: `max_tokens: Input should be greater than or equal to 1 (got 0)`."""
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        if not where:  # a whole-request rule, e.g. "give exactly one of prompt or messages"
            parts.append(e["msg"].removeprefix("Value error, "))
            continue
        shown = repr(e.get("input"))
        if len(shown) > 80:
            shown = shown[:77] + "..."
        parts.append(f"{where}: {e['msg'].removeprefix('Value error, ')} (got {shown})")
    return f"invalid {kind} request: " + "; ".join(parts)


def parse_generate(payload: Any) -> GenerateRequest:
    try:
        return GenerateRequest.model_validate(payload)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_error("generate", e)) from None


def parse_score(payload: Any) -> ScoreRequest:
    try:
        return ScoreRequest.model_validate(payload)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_error("score", e)) from None


def generate(payload: Any) -> dict[str, Any]:
    """RQ job function: generate text for one request; returns the `GenerateResult` as JSON-ready dict."""
    request = parse_generate(payload)
    return runtime.current().generate(_job_id(), request).model_dump(mode="json")


def score(payload: Any) -> dict[str, Any]:
    """RQ job function: score candidates for one request; returns the `ScoreResult` as a dict."""
    request = parse_score(payload)
    return runtime.current().score(_job_id(), request).model_dump(mode="json")
