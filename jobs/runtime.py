"""The seam between RQ's job functions and the worker process that runs them.

RQ calls `jobs.generate(payload)` by name. The function itself must stay importable without mlx (a
producer imports this package), so the worker installs an `Executor` here when it starts and the job
functions hand their validated request to it. Outside a worker there is none, and the job fails with a
message that says so.
"""

from __future__ import annotations

from typing import Protocol

from .errors import NotInWorker
from .schema import GenerateRequest, GenerateResult, ScoreRequest, ScoreResult


class Executor(Protocol):
    """What a worker process provides to run jobs on its loaded model."""

    def generate(self, job_id: str, request: GenerateRequest) -> GenerateResult: ...

    def score(self, job_id: str, request: ScoreRequest) -> ScoreResult: ...


class _Slot:
    executor: Executor | None = None


_slot = _Slot()


def install(executor: Executor | None) -> None:
    """Install (or, with None, remove) the process's executor. Called by the worker at start-up."""
    _slot.executor = executor


def current() -> Executor:
    """The process's executor, or `NotInWorker` with a hint on how to run jobs."""
    if _slot.executor is None:
        raise NotInWorker(
            "mlxq jobs run inside an mlxq worker process (`mlxq worker --model PATH`), "
            "not in a plain `rq worker`"
        )
    return _slot.executor
