"""What RQ's job status means to a producer: waiting, running or over, and how it ended."""

from __future__ import annotations

from enum import Enum

from rq.job import JobStatus

from .errors import JobFailed

MISSING = "missing"
"""`status()` of a job whose RQ hash does not exist (a wrong id, or RQ's result/failure TTL passed)."""

WAITING = frozenset(
    s.value
    for s in (
        JobStatus.CREATED,
        JobStatus.QUEUED,
        JobStatus.DEFERRED,
        JobStatus.SCHEDULED,
        JobStatus.RATE_LIMITED,
        JobStatus.READY_TO_ENQUEUE,
    )
)
"""Not started yet: RQ can still cancel it so that it never runs."""

RUNNING = frozenset({JobStatus.STARTED.value})

UNSUCCESSFUL = frozenset({JobStatus.FAILED.value, JobStatus.STOPPED.value, JobStatus.CANCELED.value})
"""Over without a result."""

OVER = UNSUCCESSFUL | {JobStatus.FINISHED.value}

ENDED = OVER | {MISSING}
"""RQ will not run it (again): over, or its hash is gone. A reader then stops waiting for its stream."""


class CancelOutcome(str, Enum):
    """What `cancel()` did."""

    CANCELED = "canceled"
    """It was still waiting: RQ canceled it and it will never run."""
    REQUESTED = "requested"
    """It was running: the worker stops it soon and ends its stream with finish reason `cancelled`."""
    ALREADY_OVER = "already_over"
    """It had already finished, failed or been canceled: nothing to do."""
    MISSING = "missing"
    """There is no such job (or it expired)."""


def last_line(text: str) -> str:
    """The last non-blank line of an exception text: the `Type: message` a person needs."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def failure(job_id: str, status: str, exc_text: str | None) -> JobFailed:
    """The error for a job RQ reports as failed, stopped or canceled, with RQ's recorded reason."""
    if exc_text:
        return JobFailed(job_id, last_line(exc_text), details=exc_text, status=status)
    reasons = {
        JobStatus.CANCELED.value: "it was canceled before it ran",
        JobStatus.STOPPED.value: "it was stopped (worker shut down or `rq` stop command)",
    }
    reason = reasons.get(status, f"RQ reports status {status!r} and no reason")
    return JobFailed(job_id, reason, status=status)


def event_failure(job_id: str, message: str, exc_text: str | None) -> JobFailed:
    """The error for a job whose stream ended with an `error` event carrying `message`; `exc_text` is
    RQ's recorded exception, when there is one (it has the traceback the event leaves out)."""
    return JobFailed(job_id, last_line(message), details=exc_text or message, status="failed")
