"""mlxq: a Redis/RQ batch worker for LLM inference on MLX, and the producer that feeds it.

Everything is installed under this one name: `mlxq.producer` (submit jobs, follow streams, read results;
never imports mlx), `mlxq.jobs` (the wire contract both sides share) and `mlxq.worker` (the worker and
its MLX engine). In the repository these are the top-level folders `producer/`, `jobs/` and `worker/`;
`mlxq/` holds links to them, so a checkout imports the same way as an installed wheel.

The producer's API is re-exported here (`from mlxq import Client`), loaded on first use so that
`import mlxq.jobs` or `import mlxq.worker` does not pull the producer in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxq.producer import (
        AsyncClient,
        AsyncJobHandle,
        CancelOutcome,
        Client,
        JobFailed,
        JobHandle,
        JobNotFound,
        JobOptions,
        ProducerSettings,
        RedisFull,
        StreamItem,
    )

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


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("mlxq.producer"), name)
    raise AttributeError(f"module 'mlxq' has no attribute {name!r}")
