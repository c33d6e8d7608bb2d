"""Device-dependent defaults of the worker's settings, as a CPU host resolves them."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlxq.worker.engine.device import buffer_cache_limit
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint
from mlxq.worker.service import load_engine
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


def test_masks_in_place_reaches_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`MLXQ_MASKS_IN_PLACE` forces the engine's order of a constrained step either way; unset, the
    engine's own check decides (it holds on the CPU build)."""
    model = write_random_checkpoint(tmp_path / "tiny")
    for value, expected in (("false", False), ("true", True), (None, True)):
        if value is None:
            monkeypatch.delenv("MLXQ_MASKS_IN_PLACE", raising=False)
        else:
            monkeypatch.setenv("MLXQ_MASKS_IN_PLACE", value)
        settings = WorkerSettings(model=str(model), _env_file=None)  # type: ignore[call-arg]
        assert settings.masks_in_place == (None if value is None else expected)
        engine = load_engine(settings)
        try:
            assert engine.masks_in_place is expected
        finally:
            engine.close()
