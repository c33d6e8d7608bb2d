"""`worker/fused_ops.py`: where its CUDA kernels cannot run, the model computes what it always did.

The kernels themselves run on MLX's CUDA build only; `bench/launch_probe.py` and `bench/batch_step.py`
compare them there with the ops they replace. Here: the fallbacks are those ops, a model refuses to be
switched to kernels it cannot run, and the engine leaves them off on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from worker import fused_ops
from worker.engine import Engine, EngineOptions


def test_the_fallbacks_are_the_ops_they_stand_for() -> None:
    x, r = mx.random.normal((3, 5, 64)), mx.random.normal((3, 5, 64))
    norm = nn.RMSNorm(64, eps=1e-5)
    norm.weight = mx.random.normal((64,))
    added, normed = fused_ops.add_rms_norm(x, r, norm, fused=False)
    assert mx.array_equal(added, x + r) and mx.array_equal(normed, norm(x + r))
    gate_up = mx.random.normal((3, 5, 2 * 48))
    want = nn.silu(gate_up[..., :48]) * gate_up[..., 48:]
    assert mx.array_equal(fused_ops.swiglu(gate_up, fused=False), want)


def test_a_model_refuses_kernels_it_cannot_run(model_dir: Path) -> None:
    engine = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0))
    assert not fused_ops.available() and engine.model.fused_kernels is False
    with pytest.raises(ValueError, match="CUDA"):
        engine.model.fused_kernels = True
    with pytest.raises(ValueError, match="CUDA"):
        Engine.load(str(model_dir), EngineOptions(fused_kernels=True))
