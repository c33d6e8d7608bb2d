"""mlxq's producer side: submit generation and scoring jobs, follow their streams, collect results.

Never imports mlx, so a web backend installs it anywhere. `Client` is sync; `AsyncClient` is the same API
on redis.asyncio. Both enqueue ordinary RQ jobs (JSON serializer) that any RQ tool can inspect.
"""

from __future__ import annotations

from .aio import AsyncClient, AsyncJobHandle
from .client import Client, JobHandle
from .errors import JobFailed, JobNotFound, RedisFull
from .job_state import CancelOutcome
from .rq_wire import JobOptions
from .settings import ProducerSettings
from .tail import StreamItem

__all__ = [
    "AsyncClient",
    "AsyncJobHandle",
    "CancelOutcome",
    "Client",
    "JobFailed",
    "JobHandle",
    "JobNotFound",
    "JobOptions",
    "ProducerSettings",
    "RedisFull",
    "StreamItem",
]
