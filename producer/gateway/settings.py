"""Gateway settings: `MLXQ_GATEWAY_` environment variables, overridden by `mlxq serve`'s flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    """What one gateway instance is told; every instance of one deployment should be told the same."""

    model_config = SettingsConfigDict(env_prefix="MLXQ_GATEWAY_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="largest JSON request body; larger ones get 413"
    )
    max_jobs_per_key: int = Field(
        default=16,
        ge=1,
        description="jobs one API key may have queued or running at once, unless the key "
        "says otherwise; one more gets 429",
    )
    access_log: bool = Field(default=True, description="uvicorn's line per request (at log level info)")
    job_timeout_s: float | None = Field(
        default=600.0, gt=0, description="how long a non-streaming request waits for its job's result"
    )
    stream_ttl_s: int = Field(
        default=86_400, ge=60, description="how long a stream stays resumable through the gateway"
    )
    key_cache_s: float = Field(
        default=1.0,
        ge=0.0,
        description="how long an API key's record is reused (a revoked key works this much longer)",
    )
    redis_connections: int = Field(
        default=4096,
        ge=16,
        description="most Redis connections this instance opens (`MLXQ_REDIS_MAX_CONNECTIONS` wins if "
        "set): every stream being relayed blocks one in XREAD, so this bounds concurrent streams",
    )
    models_cache_s: float = Field(
        default=1.0, ge=0.0, description="how long the list of live workers' models is reused"
    )
    data_dir: Path = Field(
        default=Path("mlxq-gateway-data"),
        description="where uploaded files and batch outputs are kept; instances that share batches must "
        "share this folder (a network file system), as they share Redis",
    )
    max_file_bytes: int = Field(
        default=200 * 1024 * 1024, ge=1024, description="largest upload (OpenAI's: 200 MB)"
    )
    max_batch_lines: int = Field(
        default=50_000, ge=1, description="most requests in one batch (OpenAI's limit)"
    )
    batch_lease_s: float = Field(
        default=30.0,
        gt=0.0,
        description="a batch whose runner has not renewed its lease this long is "
        "taken up by another instance (after a crash or restart)",
    )
    batch_in_flight: int = Field(default=64, ge=1, description="jobs one batch keeps outstanding at once")
