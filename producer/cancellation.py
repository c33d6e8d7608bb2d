"""Cancelling one job: what RQ's status says to do, and doing it on a sync connection.

A waiting job is canceled by RQ's own `Job.cancel` (status, queue and canceled registry in one go); a
running one is asked to stop through its cancel key, which the worker polls between steps. The key is
also set before RQ cancels a waiting job, in case a worker dequeues it at that moment. `JobHandle` and
bulk runs cancel through `cancel_job`; `AsyncJobHandle` follows the same `plan` with awaited calls and
runs `rq_cancel` (RQ is sync) in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from mlxq.jobs import keys

from . import job_state, rq_wire
from .connection import RetryPolicy
from .job_state import CancelOutcome

CANCEL_KEY_TTL_S = 3600
"""A stop request expires by itself, so the keys of jobs that ended anyway do not pile up."""


@dataclass(frozen=True)
class CancelPlan:
    """What cancelling a job in a given status takes, and the answer when no RQ cancel is needed."""

    request_stop: bool
    rq_cancel: bool
    outcome: CancelOutcome


def plan(status: str) -> CancelPlan:
    """The steps to cancel a job whose RQ status is `status` (`missing` when its hash is gone)."""
    if status in job_state.WAITING:
        return CancelPlan(request_stop=True, rq_cancel=True, outcome=CancelOutcome.CANCELED)
    if status in job_state.RUNNING:
        return CancelPlan(request_stop=True, rq_cancel=False, outcome=CancelOutcome.REQUESTED)
    outcome = CancelOutcome.MISSING if status == job_state.MISSING else CancelOutcome.ALREADY_OVER
    return CancelPlan(request_stop=False, rq_cancel=False, outcome=outcome)


def rq_cancel(connection: redis.Redis, job_id: str) -> CancelOutcome:
    """Cancel a waiting job with RQ's own `Job.cancel` (status, queue, canceled registry in one go)."""
    try:
        Job.fetch(job_id, connection=connection, serializer=JSONSerializer).cancel()
    except NoSuchJobError:
        return CancelOutcome.MISSING
    except InvalidJobOperation:  # canceled by someone else in the meantime
        return CancelOutcome.ALREADY_OVER
    return CancelOutcome.CANCELED


def cancel_job(connection: redis.Redis, retry: RetryPolicy, job_id: str) -> CancelOutcome:
    """Cancel `job_id` on a sync connection; every Redis call is retried under `retry`."""
    try:
        status = rq_wire.decode_status(retry.call(connection.hget, keys.rq_job_key(job_id), "status"))
    except redis.ResponseError as e:
        status = rq_wire.status_after(e)
    steps = plan(status)
    if steps.request_stop:
        retry.call(connection.set, keys.cancel_key(job_id), "1", ex=CANCEL_KEY_TTL_S)
    if steps.rq_cancel:
        return retry.call(rq_cancel, connection, job_id)
    return steps.outcome
