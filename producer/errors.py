"""Errors a producer sees, besides the contract's own (`jobs.errors`)."""

from __future__ import annotations

from redis.exceptions import OutOfMemoryError

from mlxq.jobs import errors


class JobFailed(errors.JobFailed):
    """`jobs.errors.JobFailed` (catch either) plus the worker's whole exception text.

    `reason` is the line a person needs (the exception's last line); `details` is everything RQ or the
    worker recorded (usually a traceback); `status` is RQ's status when the failure was seen.
    """

    def __init__(self, job_id: str, reason: str, *, details: str = "", status: str = "failed") -> None:
        super().__init__(job_id, reason)
        self.details = details or reason
        self.status = status


class JobNotFound(errors.MlxqError, LookupError):
    """No RQ job, stream or result exists for this id: a wrong id, or everything about it expired."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}: unknown id, or its job, stream and result have all expired")
        self.job_id = job_id


class RedisFull(errors.MlxqError, OutOfMemoryError):
    """Redis refused to store the job: it reached `maxmemory` (under `noeviction`, the safe policy, it
    refuses writes rather than evicting). Nothing was enqueued. Also a `redis.exceptions.OutOfMemoryError`,
    so code that catches redis-py's error keeps working. Retry later, shed load, or raise `maxmemory`."""

    def __init__(self, job_id: str, error: OutOfMemoryError) -> None:
        super().__init__(
            f"job {job_id!r} not enqueued: Redis is full (maxmemory reached; it refuses writes): {error}"
        )
        self.job_id = job_id
