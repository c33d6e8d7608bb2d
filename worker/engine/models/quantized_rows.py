"""Quantized layers that keep a dense copy of their weight for forwards of many rows (MLX on CUDA).

A quantized matmul reads a quarter of the weight bytes, which is what a forward of one row (a lone
decode step) is bound by; but MLX's CUDA kernels for it fall far behind a dense matmul once a forward
has many rows (`bench/README.md`, what the engine's defaults rest on). With
`use_dense_rows(model, min_rows)` every quantized Linear (and a quantized embedding used as the tied
output layer) also holds its weight dequantized once, in the compute dtype, and a call with at least
`min_rows` rows (a decode batch, a prefill chunk, a score batch) multiplies by that instead: the speed
of the dense model for batches and prompts, the quantized kernel's for a lone sequence, at the memory
cost of the dense weights (the bytes it returns; ~2.5 GB for a 1B model). The copy is exactly
`mx.dequantize` of the layer's own weight, so the two paths differ only by the order of their sums.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.device import on_cuda

log = logging.getLogger(__name__)

# From how many rows a quantized layer uses its dense copy on CUDA by default (see the module docstring).
CUDA_DENSE_ROWS = 8


def dense_rows_by_default() -> int:
    """`CUDA_DENSE_ROWS` on MLX's CUDA backend; 0 (quantized kernels only) elsewhere: Metal's are fast
    for many rows, and on the CPU a dense float32 matmul is no faster than a quantized one."""
    return CUDA_DENSE_ROWS if on_cuda() else 0


def default_max_bytes() -> int:
    """Where the copies are on by default, they may take at most a quarter of MLX's memory limit (the
    device's memory on CUDA), so a GPU too small for them keeps its room for KV and batches."""
    return mx.get_memory_limit() // 4


@dataclass(frozen=True)
class _Dense:
    """Held outside the module's parameters (a plain attribute): checkpoints and `parameters()` never
    see it, so saving the model writes only its quantized weights."""

    weight: mx.array  # (outputs, inputs)
    min_rows: int
    # The weight's transpose, a view made once (as `fused_linear.TransposedWeightLinear` keeps its own):
    # a forward multiplies by it without a transpose op of its own.
    t: mx.array = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "t", self.weight.T)


def _dequantized(layer: nn.QuantizedLinear | nn.QuantizedEmbedding, dtype: mx.Dtype) -> mx.array:
    biases = layer.get("biases")
    mode = getattr(layer, "mode", "affine")
    w = mx.dequantize(layer.weight, layer.scales, biases, layer.group_size, layer.bits, mode=mode)
    return w.astype(dtype)


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


class DenseRowsLinear(nn.QuantizedLinear):
    """A `QuantizedLinear` that multiplies calls of at least `min_rows` rows by a dense copy."""

    _dense: _Dense

    def __call__(self, x: mx.array) -> mx.array:
        if _rows(x) < self._dense.min_rows:
            return super().__call__(x)  # type: ignore[no-untyped-call, no-any-return]  # unannotated in MLX
        out = x @ self._dense.t
        return out + self["bias"] if "bias" in self else out


class DenseRowsEmbedding(nn.QuantizedEmbedding):
    """A `QuantizedEmbedding` whose `as_linear` (a tied output layer) uses a dense copy from `min_rows`
    rows on; lookups stay quantized (they read only the rows they need)."""

    _dense: _Dense

    def as_linear(self, x: mx.array) -> mx.array:
        if _rows(x) < self._dense.min_rows:
            return super().as_linear(x)  # type: ignore[no-untyped-call, no-any-return]  # unannotated in MLX
        return x @ self._dense.t


class FusedDenseRows(nn.Module):
    """Dense-rows projections of one input side by side (q/k/v, gate/up), as `fused_linear.py` fuses plain
    ones: many rows in one matmul by their dense copies concatenated (a batched step launches as few
    matmuls as the dense model's); few rows (`apart`) through each part's quantized kernel."""

    _dense: _Dense

    def __init__(self, parts: list[DenseRowsLinear]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        weight = mx.concatenate([p._dense.weight for p in parts], axis=0)
        mx.eval(weight)
        object.__setattr__(self, "_dense", _Dense(weight, parts[0]._dense.min_rows))
        for part in parts:  # plain quantized layers again: their own dense copies are freed
            part.__class__ = nn.QuantizedLinear  # type: ignore[assignment]  # a deliberate swap to the base
            object.__delattr__(part, "_dense")
        # Few rows: the parts as one quantized layer where they are quantized alike (one kernel), else
        # each its own
        self.quantized = fuse_quantized(parts)
        self.parts = [] if self.quantized is not None else parts
        if all("bias" in p for p in parts):
            self.bias = mx.concatenate([p["bias"] for p in parts])

    def apart(self, x: mx.array) -> bool:
        """Whether `x` has too few rows for the dense copy and the parts run each its own quantized
        kernel (a caller that wants the parts' outputs apart then computes them so, unconcatenated)."""
        return self.quantized is None and _rows(x) < self._dense.min_rows

    def __call__(self, x: mx.array) -> mx.array:
        if _rows(x) < self._dense.min_rows:
            if self.quantized is not None:
                return self.quantized(x)  # type: ignore[no-any-return]  # mlx.nn.Module's call is unannotated
            return mx.concatenate([part(x) for part in self.parts], axis=-1)
        out = x @ self._dense.t
        return out + self["bias"] if "bias" in self else out


def fuse_quantized(parts: Sequence[nn.Module]) -> nn.QuantizedLinear | None:
    """Quantized Linears of one input as one (weights, scales, biases and any bias concatenated along
    the outputs): each output row is quantized on its own, so the fused layer computes the parts' very
    products, in one kernel where each launched its own. None unless all are quantized alike (group
    size, bits, mode), all with or all without a bias (dense-rows layers: `fuse_dense_rows`)."""
    if not parts or any(type(p) is not nn.QuantizedLinear for p in parts):
        return None
    kinds = {(p.group_size, p.bits, getattr(p, "mode", "affine"), "biases" in p, "bias" in p) for p in parts}
    if len(kinds) != 1:
        return None
    names = [name for name in ("weight", "scales", "biases", "bias") if name in parts[0]]
    return _quantized_like(parts[0], {n: mx.concatenate([p[n] for p in parts], axis=0) for n in names})


def _quantized_like(layer: nn.Module, arrays: dict[str, mx.array]) -> nn.QuantizedLinear:
    """A frozen `QuantizedLinear` of `layer`'s group size, bits and mode holding `arrays` (weight,
    scales, biases, bias), evaluated."""
    made = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
    nn.Module.__init__(made)
    made.group_size, made.bits, made.mode = layer.group_size, layer.bits, getattr(layer, "mode", "affine")
    for name, array in arrays.items():
        setattr(made, name, array)
    made.freeze()
    mx.eval(made.parameters())
    return made


def with_rows_negated(layer: nn.Module) -> nn.Module | None:
    """A bias-free quantized Linear (affine; dense-rows or not) computing its outputs and then their
    negations: its rows stacked again below, the copies' scales and biases negated (and the dense copy's
    rows too), so the same products come out negated exactly. None for any other layer."""
    if type(layer) not in (nn.QuantizedLinear, DenseRowsLinear) or "bias" in layer:
        return None
    if getattr(layer, "mode", "affine") != "affine" or "biases" not in layer:
        return None
    signed = _quantized_like(
        layer,
        {
            "weight": mx.concatenate([layer.weight, layer.weight]),
            "scales": mx.concatenate([layer.scales, -layer.scales]),
            "biases": mx.concatenate([layer.biases, -layer.biases]),
        },
    )
    if type(layer) is DenseRowsLinear:
        signed.__class__ = DenseRowsLinear
        dense = mx.concatenate([layer._dense.weight, -layer._dense.weight])
        mx.eval(dense)
        object.__setattr__(signed, "_dense", _Dense(dense, layer._dense.min_rows))
    return signed


def fuse_dense_rows(parts: list[nn.Module]) -> FusedDenseRows | None:
    """`parts` as one `FusedDenseRows`, if they are all dense-rows Linears with one row threshold and
    all or none of them with a bias; else None."""
    if not parts or any(type(p) is not DenseRowsLinear for p in parts):
        return None
    if len({p._dense.min_rows for p in parts}) != 1 or len({"bias" in p for p in parts}) != 1:
        return None
    return FusedDenseRows(parts)  # type: ignore[arg-type]  # checked just above


def _swap(layer: nn.Module, dtype: mx.Dtype, min_rows: int) -> int:
    """Make `layer` dense-rows in place (its class and a dense copy); returns the copy's bytes."""
    if type(layer) is nn.QuantizedLinear:
        layer.__class__ = DenseRowsLinear
    elif type(layer) is nn.QuantizedEmbedding:
        layer.__class__ = DenseRowsEmbedding
    else:
        return 0
    dense = _dequantized(layer, dtype)
    mx.eval(dense)
    object.__setattr__(layer, "_dense", _Dense(dense, min_rows))
    return int(dense.nbytes)


def _planned_bytes(model: nn.Module, dtype: mx.Dtype) -> int:
    """What the dense copies of `model`'s quantized layers would take, before making them."""
    total = 0
    for _, layer in model.named_modules():
        if type(layer) in (nn.QuantizedLinear, nn.QuantizedEmbedding):
            outputs, packed = layer.weight.shape
            total += outputs * (packed * 32 // layer.bits) * dtype.size
    return total


def use_dense_rows(model: nn.Module, min_rows: int, dtype: mx.Dtype, max_bytes: int | None = None) -> int:
    """Give every quantized Linear and Embedding of `model` a dense copy of its weight in `dtype`, used
    for calls of at least `min_rows` rows; returns the bytes the copies take (0: nothing quantized, or
    the copies would take more than `max_bytes`, and then nothing is changed)."""
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    planned = _planned_bytes(model, dtype)
    if max_bytes is not None and planned > max_bytes:
        log.warning(
            "quantized layers keep no dense copies: they would take bytes=%d, more than max_bytes=%d "
            "(set MLXQ_DENSE_ROWS to keep them anyway); batches run on the quantized kernels",
            planned,
            max_bytes,
        )
        return 0
    added = 0
    for _, module in model.named_modules():
        added += _swap(module, dtype, min_rows)
    if added:
        log.info("quantized layers keep dense copies min_rows=%d bytes=%d", min_rows, added)
    return added
