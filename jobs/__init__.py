"""mlxq's job contract: request/result models, Redis key names, errors, and the RQ job functions.

Never imports mlx: producers (web backends) import this package. `generate` and `score` are the names
of the only two job functions (`jobs.generate`, `jobs.score`): a producer enqueues a job under one of
them, and an mlxq worker dispatches each job by that name to its generation or score batches. Their
bodies never run in an mlxq worker; a plain `rq worker` that calls them gets `NotInWorker`.
"""

from __future__ import annotations

import reprlib
from typing import Any

from pydantic import ValidationError

from .errors import InvalidRequest, NotInWorker
from .schema import GenerateRequest, ScoreRequest


def describe_validation_error(kind: str, err: ValidationError) -> str:
    """One readable line per problem: `max_tokens: Input should be greater than or equal to 1 (got 0)`."""
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        if not where:  # a whole-request rule, e.g. "give exactly one of prompt or messages"
            parts.append(e["msg"].removeprefix("Value error, "))
            continue
        try:
            shown = repr(e.get("input"))
        except RecursionError:  # nested too deeply to show whole: its first levels
            shown = reprlib.repr(e.get("input"))
        if len(shown) > 80:
            shown = shown[:77] + "..."
        parts.append(f"{where}: {e['msg'].removeprefix('Value error, ')} (got {shown})")
    return f"invalid {kind} request: " + "; ".join(parts)


def parse_generate(payload: Any) -> GenerateRequest:
    try:
        return GenerateRequest.model_validate(payload)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_error("generate", e)) from None
    except RecursionError:
        raise InvalidRequest("invalid generate request: a field is nested too deeply") from None


def parse_score(payload: Any) -> ScoreRequest:
    try:
        return ScoreRequest.model_validate(payload)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_error("score", e)) from None
    except RecursionError:
        raise InvalidRequest("invalid score request: a field is nested too deeply") from None


_NOT_IN_WORKER = (
    "mlxq jobs run inside an mlxq worker process (`mlxq worker --model PATH`), not in a plain `rq worker`"
)


def generate(payload: Any) -> dict[str, Any]:
    """RQ job function `jobs.generate`: its name is the contract; an mlxq worker runs the job itself."""
    parse_generate(payload)
    raise NotInWorker(_NOT_IN_WORKER)


def score(payload: Any) -> dict[str, Any]:
    """RQ job function `jobs.score`: its name is the contract; an mlxq worker runs the job itself."""
    parse_score(payload)
    raise NotInWorker(_NOT_IN_WORKER)
