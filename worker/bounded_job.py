"""RQ's `Job`, with the size of its payload checked before RQ decompresses and decodes it.

RQ inflates a job's `data` field (zlib) in full as it reads the job, before any check of ours: 1 MB of
zlib can hold 1 GiB. Every job this worker reads (dequeued, claimed, looked at by RQ's maintenance) is
read through `BoundedJob`, whose `restore` first measures the payload: its stored bytes, and what they
inflate to, inflated in steps that stop at the cap. A job over either limit cannot be read: it is put
aside with the reason (`dead_letters.py`) and never inflated again.
"""

from __future__ import annotations

import zlib
from typing import Any, ClassVar

from rq.job import Job


class PayloadTooLarge(ValueError):
    """A job's `data` is larger, stored or inflated, than the worker takes (`MLXQ_MAX_PAYLOAD_BYTES`)."""


def payload_size_error(data: bytes | str | None, limit: int) -> str | None:
    """Why `data` (a job hash's `data` field, zlib-compressed or not) is too large, else None."""
    if data is None:
        return None
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > limit:
        return (
            f"field 'data' holds {len(raw)} bytes; this worker takes at most {limit} (MLXQ_MAX_PAYLOAD_BYTES)"
        )
    inflater = zlib.decompressobj()
    try:
        inflated = len(inflater.decompress(raw, limit + 1))
    except zlib.error:
        return None  # not compressed: RQ reads it as it is, and its size was checked above
    if inflated > limit:
        return (
            f"field 'data' inflates to more than {limit} bytes ({len(raw)} compressed); this worker takes "
            f"at most {limit} (MLXQ_MAX_PAYLOAD_BYTES)"
        )
    return None


class BoundedJob(Job):
    """A `Job` that refuses to restore a payload over `max_payload_bytes` (stored or inflated)."""

    max_payload_bytes: ClassVar[int] = 16 << 20

    def restore(self, raw_data: Any) -> Any:
        data = raw_data.get(b"data", raw_data.get("data")) if isinstance(raw_data, dict) else None
        problem = payload_size_error(data, self.max_payload_bytes)
        if problem is not None:
            raise PayloadTooLarge(f"{problem} (job {self.id})")
        return super().restore(raw_data)
