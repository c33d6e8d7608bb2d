"""Rotary position embeddings (RoPE) as Hugging Face Llama-family models apply them.

Hugging Face rotates the two halves of each head (`rotate_half`), which is MLX's `traditional=False`.
Scaled variants are expressed through `mx.fast.rope`: `linear` through its `scale`, `llama3` through its
`freqs` argument (per-dimension periods, the reciprocal of Hugging Face's `inv_freq`).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxq.worker.engine.errors import CheckpointError, UnsupportedArchitecture

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


class RoPE(nn.Module):
    """Applies RoPE to (B, heads, L, head_dim) arrays; positions start at `offset` (the cache length).

    `dims` below the head size rotate only the first `dims` features (a partial rotary factor); the rest
    pass unchanged. `magnitude` multiplies the rotated features (LongRoPE's and YaRN's attention factor,
    which transformers folds into cos and sin). `traditional`: pairs of adjacent features rotate together
    (DeepSeek's interleaved layout) instead of the two halves."""

    def __init__(
        self,
        dims: int,
        base: float,
        scale: float = 1.0,
        freqs: mx.array | None = None,
        magnitude: float = 1.0,
        traditional: bool = False,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.dims = dims
        self.traditional = traditional
        self.base = base
        self.scale = scale
        self.magnitude = magnitude
        # Leading underscore keeps it out of parameters(): it is derived from the config, not loaded.
        self._freqs = freqs

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        out = mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None if self._freqs is not None else self.base,
            scale=self.scale,
            offset=offset,
            freqs=self._freqs,
        )
        if self.magnitude == 1.0:
            return out
        if self.dims == x.shape[-1]:
            return out * self.magnitude
        return mx.concatenate([out[..., : self.dims] * self.magnitude, out[..., self.dims :]], axis=-1)


def inverse_frequencies(dims: int, base: float) -> np.ndarray:
    """Hugging Face's `inv_freq`: base^(-2i/dims), computed in float32 as transformers does."""
    exponents = np.arange(0, dims, 2, dtype=np.int64).astype(np.float32) / np.float32(dims)
    return (1.0 / (np.float32(base) ** exponents)).astype(np.float32)


def llama3_inverse_frequencies(dims: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's rescaling: long wavelengths slowed by `factor`, short ones kept, blended between."""
    inv_freq = inverse_frequencies(dims, base)
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def longrope(dims: int, base: float, scaling: dict[str, Any]) -> RoPE:
    """LongRoPE (Phi-3/3.5/4-mini) as transformers applies it to sequences within the original context:
    frequencies divided by `short_factor`, rotated features scaled by the attention factor (from the
    config, else sqrt(1 + ln(factor) / ln(original context))). Past the original context transformers
    switches to `long_factor` for new positions only; the model's context is capped there instead
    (`model_args.ModelArgs`), so every position is computed as the reference computes it."""
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or float(scaling["max_position_embeddings"]) / original)
    magnitude = scaling.get("attention_factor")
    if magnitude is None:
        magnitude = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    short = np.asarray(scaling["short_factor"], dtype=np.float32)
    if short.shape != (dims // 2,):
        raise CheckpointError(
            f"longrope short_factor has {short.size} entries; {dims // 2} rotated pairs need one each"
        )
    exponents = np.arange(0, dims, 2, dtype=np.int64).astype(np.float32) / np.float32(dims)
    inv_freq = (1.0 / (short * np.float32(base) ** exponents)).astype(np.float32)
    return RoPE(dims, base, freqs=mx.array(1.0 / inv_freq), magnitude=float(magnitude))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times longer: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn(dims: int, base: float, scaling: dict[str, Any], traditional: bool = False) -> RoPE:
    """YaRN as transformers computes it: each frequency blended between itself (fast ones, kept) and
    itself / `factor` (slow ones, interpolated) by a linear ramp over the correction range of
    `beta_fast`/`beta_slow` rotations in the original context; rotated features scaled by the attention
    factor (given, or from `mscale`/`mscale_all_dim`). Model-specific softmax scaling (DeepSeek's
    `mscale_all_dim`) is the model's own."""
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or float(scaling["max_position_embeddings"]) / original)
    magnitude = scaling.get("attention_factor")
    if magnitude is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            magnitude = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            magnitude = yarn_mscale(factor)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dims * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    exponents = np.arange(0, dims, 2, dtype=np.int64).astype(np.float32) / np.float32(dims)
    pos_freqs = (np.float32(base) ** exponents).astype(np.float32)
    kept, interpolated = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp
    inv_freq = (interpolated * (1 - keep) + kept * keep).astype(np.float32)
    return RoPE(
        dims, base, freqs=mx.array(1.0 / inv_freq), magnitude=float(magnitude), traditional=traditional
    )


def make_rope(head_dim: int, base: float, scaling: dict[str, Any] | None, traditional: bool = False) -> RoPE:
    """Build the RoPE for a config's `rope_theta` and normalised scaling dict (`rope_type` key or None);
    `head_dim` is the number of rotated features (the head size times a partial rotary factor)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if scaling is None or rope_type == "default":
        return RoPE(head_dim, base, traditional=traditional)
    if rope_type == "yarn":
        return yarn(head_dim, base, scaling, traditional)
    if traditional:
        raise UnsupportedArchitecture(str(rope_type), ["default", "yarn"], what="interleaved rope_type")
    if rope_type == "longrope":
        return longrope(head_dim, base, scaling)
    if rope_type == "linear":
        return RoPE(head_dim, base, scale=1.0 / float(scaling["factor"]))
    if rope_type == "llama3":
        periods = 1.0 / llama3_inverse_frequencies(head_dim, base, scaling)
        return RoPE(head_dim, base, freqs=mx.array(periods))
    raise UnsupportedArchitecture(str(rope_type), ROPE_TYPES, what="rope_type")
