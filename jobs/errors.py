"""Errors that cross the wire: raised in the worker, shown to whoever submitted the job.

Messages are written for a person: they name the offending value and say what would be accepted.
"""

from __future__ import annotations


class MlxqError(Exception):
    """Base class for every mlxq error."""


class InvalidRequest(MlxqError, ValueError):
    """A job payload that does not validate (wrong type, unknown field, bad value)."""


class ContextTooLong(InvalidRequest):
    """A prompt at or over the model's context length."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(
            f"prompt is {prompt_tokens} tokens but the model's context length is {context_length}; "
            f"shorten the prompt to at most {context_length - 1} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class InvalidCandidate(InvalidRequest):
    """A scoring candidate that does not add exactly one ordinary token to its prompt."""


class OutOfMemory(MlxqError):
    """The worker could not allocate what a job needs, even after freeing its caches."""


class ForbiddenJob(MlxqError):
    """A job that names a function other than mlxq's own, or a payload that is not JSON."""


class NotInWorker(MlxqError):
    """`jobs.generate`/`jobs.score` called outside an mlxq worker process."""


class JobFailed(MlxqError):
    """Raised on the producer side when a job ended failed; carries the worker's reason."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id} failed: {reason}")
        self.job_id = job_id
        self.reason = reason
