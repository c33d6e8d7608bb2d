"""A running job's deadline: its timeout, counted from the moment the worker started it.

RQ enforces a job's timeout with a signal around one job's call; a batch runs many jobs in one call, so
the worker checks each job's deadline itself, wherever its work can stop: after the host-side work of
admitting it (tokenizing, compiling its stop strings), between prefill chunks, between the forwards of
a score batch, between decode steps. Past it, the check raises RQ's own `JobTimeoutException`, with
RQ's message, so the job fails as a timed-out RQ job does.
"""

from __future__ import annotations

import math
from time import monotonic

from rq.job import Job
from rq.timeouts import JobTimeoutException


class JobDeadline:
    """When a job's time is up (never, for a job without a timeout: where the operator allows one)."""

    def __init__(self, timeout: int) -> None:
        self.timeout = timeout
        self.at = monotonic() + timeout if timeout > 0 else math.inf

    @classmethod
    def of(cls, job: Job) -> JobDeadline:
        """The deadline of a job started just now (its timeout as `RqBatches.start` set it)."""
        return cls(int(job.timeout or 0))

    def passed(self) -> bool:
        return monotonic() > self.at

    def exceeded(self) -> JobTimeoutException:
        """The error of a job past its deadline (RQ's, with RQ's message)."""
        return JobTimeoutException(f"Task exceeded maximum timeout value ({self.timeout} seconds)")

    def check(self) -> None:
        """Raise `exceeded()` once the deadline has passed."""
        if self.passed():
            raise self.exceeded()
