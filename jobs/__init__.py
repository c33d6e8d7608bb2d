"""mlxq's job contract: request/result models, Redis key names, errors, and the RQ job functions.

Never imports mlx: producers (web backends) import this package. `generate` and `score` are the names
of the only two job functions (`jobs.generate`, `jobs.score`): a producer enqueues a job under one of
them, and an mlxq worker dispatches each job by that name to its generation or score batches. Their
bodies never run in an mlxq worker; a plain `rq worker` that calls them gets `NotInWorker`.
"""

from __future__ import annotations

import reprlib
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import InvalidRequest, NotInWorker
from .schema import GenerateRequest, ScoreRequest

T = TypeVar("T", bound=BaseModel)


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


MAX_NESTING_DEPTH = 32
"""Levels of nested objects and lists a request may have (itself the first): deep enough for any chat
message's extra fields (tool calls with their JSON schemas), far below what recursion in validation,
templates or `repr` could reach. A worker sets its own (`MLXQ_MAX_NESTING_DEPTH`)."""


def too_deep(value: Any, max_depth: int) -> str | None:
    """Where a JSON-like value (an object or a list) is nested deeper than `max_depth` levels (the path
    of the first such place found, e.g. `messages[0].name.a...`), else None. Walks the value level by
    level without recursion, so any depth is measured, and a wide value costs one pass."""
    level = [value]
    for _ in range(max_depth):
        level = [
            v
            for item in level
            for v in (item.values() if isinstance(item, dict) else item)
            if isinstance(v, dict | list)
        ]
        if not level:
            return None
    return _path_deeper_than(value, max_depth)


def _path_deeper_than(value: Any, max_depth: int) -> str:
    """The path to a place deeper than `max_depth` levels in `value` (one exists), its first steps."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if len(path) >= max_depth:
            shown = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[:3]).lstrip(".")
            return shown + "..."
        children = item.items() if isinstance(item, dict) else enumerate(item)
        stack.extend((v, (*path, k)) for k, v in children if isinstance(v, dict | list))
    raise ValueError(f"nothing in the value is deeper than {max_depth} levels")


def _parse(kind: str, model: type[T], payload: Any, max_depth: int) -> T:
    if isinstance(payload, dict | list) and (where := too_deep(payload, max_depth)) is not None:
        raise InvalidRequest(
            f"invalid {kind} request: {where} is nested more than {max_depth} levels deep "
            "(the limit: MLXQ_MAX_NESTING_DEPTH)"
        )
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_error(kind, e)) from None
    except RecursionError:
        raise InvalidRequest(f"invalid {kind} request: a field is nested too deeply") from None


def parse_generate(payload: Any, max_depth: int = MAX_NESTING_DEPTH) -> GenerateRequest:
    """A generation request from a job's payload; `InvalidRequest` naming what is wrong. A payload
    nested deeper than `max_depth` levels is refused before it is validated."""
    return _parse("generate", GenerateRequest, payload, max_depth)


def parse_score(payload: Any, max_depth: int = MAX_NESTING_DEPTH) -> ScoreRequest:
    """A score request from a job's payload (as `parse_generate`)."""
    return _parse("score", ScoreRequest, payload, max_depth)


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
