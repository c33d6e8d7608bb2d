"""Producer settings: `MLXQ_` environment variables and `.env`, overridden by arguments.

The names shared with the worker (`MLXQ_REDIS_URL`, `MLXQ_REDIS_RETRY_*`) mean the same thing on both
sides, so one `.env` can serve a host that runs both. `job_timeout`, `result_ttl` and `failure_ttl` are
RQ's per-job options, written into each job this producer enqueues unless a submit call gives its own
(`job_options` merges the two).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from rq import Retry

from . import tenant
from .rq_wire import JobOptions

READ_BLOCK_MS = 1000
"""Longest XREAD BLOCK a reader issues; RQ's status is checked between blocks (so at least every second)."""


class ProducerSettings(BaseSettings):
    """Everything a producer can be told. Environment: `MLXQ_<NAME>`, e.g. `MLXQ_REDIS_URL`."""

    model_config = SettingsConfigDict(env_prefix="MLXQ_", env_file=".env", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    queue: str = Field(default="default", min_length=1)
    tenant: str | None = Field(
        default=None,
        description="this producer's key space: job ids and queues named `<tenant>_...` (see tenant.py)",
    )
    job_timeout: int | None = Field(
        default=None, ge=1, description="seconds a job may run; None leaves it to the worker's default"
    )
    result_ttl: int | None = Field(default=None, description="seconds RQ keeps a finished job (RQ: 500)")
    failure_ttl: int | None = Field(default=None, description="seconds RQ keeps a failed job (RQ: 1 year)")

    redis_retry_attempts: int = Field(
        default=8, ge=1, description="tries per Redis operation (8: about 7 s, a Sentinel failover)"
    )
    redis_retry_initial_wait_s: float = Field(default=0.1, gt=0.0)
    redis_retry_max_wait_s: float = Field(default=2.0, gt=0.0)
    replica_acks: int | None = Field(
        default=None,
        ge=0,
        description="replicas that must hold a job before a submit returns (WAIT); unset: 1 on a "
        "redis+sentinel:// URL, else 0",
    )
    replica_ack_timeout_ms: int = Field(default=1000, ge=1, description="how long one WAIT waits")
    socket_timeout_s: float = Field(default=10.0, description="must exceed the longest XREAD BLOCK (1 s)")
    socket_connect_timeout_s: float = Field(default=5.0, gt=0.0)
    redis_max_connections: int | None = Field(
        default=None,
        ge=1,
        description="most Redis connections an asyncio client opens at once (each stream being read "
        "holds one); unset: redis-py's pool default (100)",
    )

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str | None) -> str | None:
        return None if value is None else tenant.check_name(value)

    @model_validator(mode="after")
    def _socket_outlasts_block(self) -> ProducerSettings:
        if self.socket_timeout_s <= READ_BLOCK_MS / 1000:
            raise ValueError(
                f"socket_timeout_s must be above the {READ_BLOCK_MS} ms XREAD BLOCK, "
                f"got {self.socket_timeout_s}"
            )
        return self

    def job_options(
        self,
        job_timeout: int | None = None,
        result_ttl: int | None = None,
        failure_ttl: int | None = None,
        retry: int | Retry | None = None,
        at_front: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> JobOptions:
        """RQ options from a submit call's arguments, with these settings' defaults where none was given."""
        return JobOptions(
            job_timeout=job_timeout if job_timeout is not None else self.job_timeout,
            result_ttl=result_ttl if result_ttl is not None else self.result_ttl,
            failure_ttl=failure_ttl if failure_ttl is not None else self.failure_ttl,
            retry=(Retry(max=retry) if retry > 0 else None) if isinstance(retry, int) else retry,
            at_front=at_front,
            meta=dict(meta or {}),
        )
