"""FP8 checkpoints (DeepSeek-V3's released weights, and others in transformers' "fp8" layout), read by
dequantizing their weights once at load into the engine's compute dtype.

Such a checkpoint's config has `quantization_config: {"quant_method": "fp8", "weight_block_size": [bm,
bn], "activation_scheme": "dynamic", "fmt": "e4m3"}`; each FP8 weight is stored as float8 e4m3
(safetensors' F8_E4M3, read by MLX as its raw bytes) with `<name>.weight_scale_inv` beside it: one
float32 factor per bm x bn block (or one for the whole weight where `weight_block_size` is null), the
stored value times the factor being the weight. Weights without one (embeddings, norms, routers) are
stored in a float dtype and load as they are.

Why dequantize rather than compute in FP8: MLX has no FP8 dtype to multiply with, and its own 8-bit
floating format (`mxfp8` quantization) keeps one power-of-two scale per 32 inputs, which cannot hold an
arbitrary float scale per 128 x 128 block exactly; re-quantizing into it would change the weights. The
dequantized weights are exact (an e4m3 value times a float32 scale, rounded once into the compute dtype),
at the compute dtype's memory. "dynamic" activation quantization (each token's activations rounded to
FP8 on the fly, part of how the FP8 kernels compute) is not reproduced: activations stay in the compute
dtype, as transformers computes where it dequantizes such a checkpoint. A layout this cannot honour
(static activation scales, another FP8 format, a malformed block size) is refused at load.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxq.worker.engine.errors import CheckpointError, UnsupportedArchitecture

SCALE_SUFFIX = ".weight_scale_inv"


class Fp8Layout:
    """A checkpoint's FP8 settings as this loader honours them: the block each scale covers (rows,
    columns), or None for one scale per weight."""

    def __init__(self, block: tuple[int, int] | None) -> None:
        self.block = block

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Layout | None:
        """The layout of a config whose `quantization_config` is FP8; None for any other config.
        `UnsupportedArchitecture` for another transformers quantization method, or FP8 settings this
        loader would have to approximate; `CheckpointError` for a malformed block size."""
        settings = config.get("quantization_config")
        if not isinstance(settings, dict) or "quant_method" not in settings:
            return None  # none, or mlx-lm's copy of `quantization` (group_size and bits, no method)
        method = settings["quant_method"]
        if method != "fp8":
            raise UnsupportedArchitecture(
                str(method),
                ["fp8 (dequantized at load)", "MLX-quantized folders (config.json `quantization`)"],
                what="quantization_config.quant_method",
            )
        scheme = settings.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise UnsupportedArchitecture(
                str(scheme),
                ["dynamic"],
                what="FP8 activation_scheme",
                why="static activation scales would have to be applied to every layer's input",
            )
        fmt = settings.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UnsupportedArchitecture(str(fmt), ["e4m3"], what="FP8 fmt")
        block = settings.get("weight_block_size")
        if block is None:
            return cls(None)
        if (
            not isinstance(block, list | tuple)
            or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)
        ):
            raise CheckpointError(
                f"quantization_config.weight_block_size {block!r} is not two positive integers "
                "(rows and columns of the block each weight_scale_inv covers, e.g. [128, 128])"
            )
        return cls((block[0], block[1]))

    def dequantize(self, weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
        """`weights` with every FP8 weight and its `weight_scale_inv` replaced by the weight in `dtype`
        (lazily: computed when the model's parameters are evaluated). `CheckpointError` naming a scale
        without its weight, a weight not stored as FP8, or scales that do not fit the block size."""
        out = dict(weights)
        for scale_key in [k for k in weights if k.endswith(SCALE_SUFFIX)]:
            key = scale_key[: -len(SCALE_SUFFIX)] + ".weight"
            if key not in weights:
                raise CheckpointError(f"{scale_key} has no {key} beside it")
            out[key] = self._dequantized(key, weights[key], out.pop(scale_key)).astype(dtype)
        return out

    def _dequantized(self, key: str, stored: mx.array, scale: mx.array) -> mx.array:
        if stored.dtype != mx.uint8:  # MLX reads F8_E4M3 as its bytes
            raise CheckpointError(
                f"{key} has a weight_scale_inv but is stored as {stored.dtype}, not FP8 e4m3"
            )
        weight = mx.from_fp8(stored, dtype=mx.float32)
        scale = scale.astype(mx.float32)
        if self.block is None:
            if scale.size != 1:
                raise CheckpointError(
                    f"{key}: weight_block_size is null (one scale per weight) but its weight_scale_inv "
                    f"has shape {tuple(scale.shape)}"
                )
            return weight * scale.reshape(())
        rows, cols = weight.shape[-2:]
        bm, bn = self.block
        want = (-(-rows // bm), -(-cols // bn))
        if weight.ndim < 2 or tuple(scale.shape[-2:]) != want or scale.shape[:-2] != weight.shape[:-2]:
            raise CheckpointError(
                f"{key}: weight_scale_inv has shape {tuple(scale.shape)}, but a {tuple(weight.shape)} weight "
                f"in {bm}x{bn} blocks needs {(*weight.shape[:-2], *want)}"
            )
        lead = weight.shape[:-2]
        if rows % bm == 0 and cols % bn == 0:  # whole blocks: broadcast each factor over its block
            blocks = weight.reshape(*lead, want[0], bm, want[1], bn) * scale[..., :, None, :, None]
            return blocks.reshape(weight.shape)
        full = mx.repeat(mx.repeat(scale, bm, axis=-2), bn, axis=-1)  # a partial block at an edge
        return weight * full[..., :rows, :cols]
