"""Which MLX backend runs this process's arrays."""

from __future__ import annotations

import mlx.core as mx


def on_cuda() -> bool:
    """Whether MLX's CUDA backend is the default device (not Metal, not the CPU)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.DeviceType.gpu and cuda is not None and cuda.is_available()
