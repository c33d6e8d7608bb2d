"""Device-dependent defaults of the worker's settings, as a CPU host resolves them."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.worker.engine.device import buffer_cache_limit
from mlxq.worker.settings import WorkerSettings


def test_mlx_cache_limit_is_the_setting_else_the_devices_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert buffer_cache_limit(123) == 123 and buffer_cache_limit(0) == 0
    assert mx.default_device().type == mx.DeviceType.cpu
    assert buffer_cache_limit(None) == 1 << 30  # not CUDA: 1 GiB
    monkeypatch.setenv("MLXQ_MLX_CACHE_LIMIT_BYTES", "4096")
    monkeypatch.setenv("MLXQ_DECODE_OVERLAP", "true")
    settings = WorkerSettings(_env_file=None)  # type: ignore[call-arg]
    assert (settings.mlx_cache_limit_bytes, settings.decode_overlap) == (4096, True)
    monkeypatch.delenv("MLXQ_MLX_CACHE_LIMIT_BYTES")
    monkeypatch.delenv("MLXQ_DECODE_OVERLAP")
    settings = WorkerSettings(_env_file=None)  # type: ignore[call-arg]
    assert (settings.mlx_cache_limit_bytes, settings.decode_overlap) == (None, None)  # device defaults
