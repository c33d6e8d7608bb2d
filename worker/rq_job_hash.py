"""A job's hash as RQ's end of a successful job writes it, for the end script (`rq_scripts.END`) to
write only what changes.

RQ 3 ends a successful job in `Worker._finalize_success`: `handle_execution_ended` sets `ended_at` and
beats the job (`last_heartbeat`), the status becomes `finished`, and `Job._handle_success` saves the
whole job (`Job.save(include_meta=False, include_result=False)`: one HSET of every field
`Job.to_dict` makes, the payload compressed again). Reproduced here, for `rq_batches.RqBatches`:

- `saved_fields`: what `Job.to_dict(include_meta=False, include_result=False)` makes of a job, field
  for field, optionally without the payload;
- `changed_fields`: the job as RQ's end leaves it in memory, and those of its saved fields whose value
  differs from what its hash holds (`BoundedJob.stored_fields`), each as it goes on the wire (names
  by `field_name`). RQ rewrites every field; the script writes these: the end's times and status, a
  timeout the worker set, a field a producer left out. A payload stored as RQ stores it stays as
  stored (RQ would write the same bytes back).

`tests/service/test_rq_batches.py` holds `saved_fields` against RQ's `to_dict` and each batch's end
against RQ's own end of a job.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from datetime import datetime
from typing import Any

from rq.job import Job, JobStatus
from rq.utils import now, utcformat

from mlxq.worker.bounded_job import BoundedJob
from mlxq.worker.server_script import wire


def saved_fields(
    job: Job, with_data: bool = True, date_text: Callable[[datetime], str] = utcformat
) -> dict[str, Any]:
    """What RQ's `Job.to_dict(include_meta=False, include_result=False)` makes of `job`, the fields its
    end saves, computed here because RQ's compresses the payload again for every job (`with_data`:
    with it, compressed as RQ compresses it). Each field as RQ writes it: dates in its text form,
    empty text for an unset name or time, optional fields only when set (some when not None, some
    when truthy, as RQ tests them). `date_text`: RQ's `utcformat`, or a memory of it for dates jobs
    share. `tests/service/test_rq_batches.py` holds it against RQ's own."""
    fields: dict[str, Any] = {"created_at": date_text(job.created_at or now())}
    if with_data:
        fields["data"] = zlib.compress(job.data)
    fields.update(
        {
            "success_callback_name": job._success_callback_name or "",
            "failure_callback_name": job._failure_callback_name or "",
            "stopped_callback_name": job._stopped_callback_name or "",
            "started_at": date_text(job.started_at) if job.started_at else "",
            "ended_at": date_text(job.ended_at) if job.ended_at else "",
            "last_heartbeat": date_text(job.last_heartbeat) if job.last_heartbeat else "",
            "worker_name": job.worker_name or "",
            "group_id": job.group_id or "",
        }
    )
    unless_none: dict[str, Any] = {
        "number_of_retries": job.number_of_retries,
        "retries_left": job.retries_left,
        "retry_intervals": None if job.retry_intervals is None else json.dumps(job.retry_intervals),
        "enqueue_at_front_on_retry": int(job.enqueue_at_front_on_retry) or None,
        "origin": job.origin or None,
        "description": job.description,
        "enqueued_at": None if job.enqueued_at is None else date_text(job.enqueued_at),
        "repeats_left": job.repeats_left,
        "repeat_intervals": None if job.repeat_intervals is None else json.dumps(job.repeat_intervals),
        "rate_limit_key": job.rate_limit_key or None,
        "rate_limit_concurrency": job.rate_limit_concurrency or None,
        "timeout": job.timeout,
        "success_callback_timeout": job._success_callback_timeout,
        "failure_callback_timeout": job._failure_callback_timeout,
        "stopped_callback_timeout": job._stopped_callback_timeout,
        "webhooks": json.dumps([w.to_dict() for w in job.webhooks]) if job.webhooks else None,
        "result_ttl": job.result_ttl,
        "failure_ttl": job.failure_ttl,
    }
    fields.update({k: v for k, v in unless_none.items() if v is not None})
    fields["status"] = job._status
    if job._dependency_ids:
        fields["dependency_id"] = job._dependency_ids[0]
        fields["dependency_ids"] = json.dumps(job._dependency_ids)
    if job.ttl:
        fields["ttl"] = job.ttl
    if job.allow_dependency_failures is not None:
        fields["allow_dependency_failures"] = int(job.allow_dependency_failures)
    if job.enqueue_at_front is not None:
        fields["enqueue_at_front"] = int(job.enqueue_at_front)
    return fields


def changed_fields(
    job: Job, at: datetime, date_text: Callable[[datetime], str] = utcformat
) -> dict[str, Any]:
    """The job-hash fields RQ's end writes (`job.to_dict()`, as `_handle_success` saves it, with
    status `finished`: `saved_fields`), less those the hash already holds with the same value: RQ
    rewrites every field; the script writes only what changes (the end's times and status, a
    timeout the worker set). A job not read from a hash gets them all. The payload (`data`) is
    left as stored where it is the one read and was stored as RQ's own zlib form of it
    (`BoundedJob.payload_as_rq_stores_it`): RQ would write it back compressed again, a zlib
    stream set up for every job, to the same bytes. A read job's changed values come as the bytes
    sent (compared in that form); its dates read in RQ's form keep their text (`date_text`)."""
    job.ended_at = at
    job.last_heartbeat = at  # RQ's `job.heartbeat(...)`
    job._status = JobStatus.FINISHED
    if not isinstance(job, BoundedJob) or job.stored_fields is None:
        fields = saved_fields(job, date_text=date_text)
        fields["status"] = JobStatus.FINISHED.value
        return fields
    stored = job.stored_fields
    as_stored = job.payload_as_rq_stores_it()
    fields = saved_fields(job, with_data=not as_stored, date_text=lambda d: job.date_text(d, date_text))
    fields["status"] = JobStatus.FINISHED.value
    # Each value as it goes on the wire, made once: compared with the stored one and sent as is.
    changed: dict[str, Any] = {}
    for name, value in fields.items():
        sent = value if type(value) is bytes else value.encode() if type(value) is str else wire(value)
        if stored.get(field_name(name)) != sent:
            changed[name] = sent
    return changed


def field_name(name: str) -> bytes:
    """A job-hash field's name as it goes on the wire (encoded once for the fields RQ saves)."""
    return _NAMES.get(name) or name.encode()


# Each field `saved_fields` may make, as its name goes on the wire (names encoded once, not a job).
_NAMES = {
    name: name.encode()
    for name in (
        "created_at", "data", "success_callback_name", "failure_callback_name", "stopped_callback_name",
        "started_at", "ended_at", "last_heartbeat", "worker_name", "group_id", "number_of_retries",
        "retries_left", "retry_intervals", "enqueue_at_front_on_retry", "origin", "description",
        "enqueued_at", "repeats_left", "repeat_intervals", "rate_limit_key", "rate_limit_concurrency",
        "timeout", "success_callback_timeout", "failure_callback_timeout", "stopped_callback_timeout",
        "webhooks", "result_ttl", "failure_ttl", "status", "dependency_id", "dependency_ids", "ttl",
        "allow_dependency_failures", "enqueue_at_front",
    )
}  # fmt: skip
