"""Projections of one input fused into one matmul (a layer's q/k/v, its gate/up), and the fused
output read apart again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.models.quantized_rows import FusedDenseRows, fuse_dense_rows, fuse_quantized


@dataclass(frozen=True)
class KeptView:
    """An array made once from a module's weight (its transpose, say) and the weight it was made from,
    held outside the module's parameters (a plain attribute, as `quantized_rows._Dense`): a forward
    reads it where it would otherwise build an op of its own every time."""

    weight: mx.array
    view: mx.array


def kept_view(kept: KeptView | None, weight: mx.array, make: Callable[[mx.array], mx.array]) -> KeptView:
    """`kept` while it was made from `weight`, else `make(weight)` kept (the weight was replaced)."""
    if kept is not None and kept.weight is weight:
        return kept
    return KeptView(weight, make(weight))


class TransposedWeightLinear(nn.Linear):
    """An `nn.Linear` (the same parameters, the same products) that keeps its weight's transpose: a
    view made once (evaluated with the first forward that reads it) instead of an op in every forward,
    which a GPU's decode step, bound by the host's launch of its ops, would launch four times a layer.
    Made again if the weight is replaced. `fuse_linears` makes them, and `kept_transpose` of a layer."""

    _transposed: KeptView | None = None

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self.transposed())
        return x @ self.transposed()

    def transposed(self) -> mx.array:
        """The weight's transpose, kept (made again if the weight was replaced)."""
        self._transposed = kept_view(self._transposed, self["weight"], lambda w: w.T)
        return self._transposed.view


def plus(residual: mx.array, proj: nn.Module, x: mx.array) -> mx.array:
    """`residual + proj(x)`: one op (`addmm`) where `proj` keeps its weight's transpose and has no bias,
    two otherwise. A block's residual adds follow its output projections: a GPU's decode step, bound by
    the host's launch of its ops, launches two fewer a layer."""
    if isinstance(proj, TransposedWeightLinear) and "bias" not in proj:
        return mx.addmm(residual, x, proj.transposed())
    return residual + proj(x)  # type: ignore[no-any-return]  # mlx.nn.Module's call is unannotated


def fused_outputs(proj: nn.Module, x: mx.array, ends: tuple[int, ...]) -> list[mx.array]:
    """A fused projection's outputs (`fuse_linears`), each ending at its column in `ends` (the last at
    the projection's last): views of one matmul's columns (one split, one op), or for few rows a
    dense-rows one's parts apart (a lone step launches no concatenation)."""
    if isinstance(proj, FusedDenseRows) and proj.apart(x):
        return [part(x) for part in proj.parts]
    return cast("list[mx.array]", mx.split(proj(x), list(ends[:-1]), axis=-1))  # MLX's stub: one array


def kept_transpose(layer: nn.Linear) -> nn.Linear:
    """A plain `nn.Linear` as a `TransposedWeightLinear` holding the same arrays; any other layer
    (quantized, already one) as it is."""
    if type(layer) is not nn.Linear:
        return layer
    weight = layer.weight
    kept = TransposedWeightLinear(weight.shape[1], weight.shape[0], bias="bias" in layer)
    kept.update(layer.parameters())
    return kept


def fuse_linears(module: nn.Module, names: list[str]) -> nn.Module | None:
    """One `nn.Linear` computing the named projections of `module` side by side (weights, and biases if
    they have them, concatenated along the outputs), which it then drops; quantized ones alike as one
    quantized layer (`quantized_rows.fuse_quantized`); None, and nothing changed, if they are of mixed
    kinds or only some have a bias.

    A decode step on a GPU is bound by the host's launch of each op, a matmul's the dearest
    (`bench/README.md`, what the engine's defaults rest on): fusing q/k/v and gate/up saves three of a
    layer's seven.
    Quantized projections with dense copies (`quantized_rows.use_dense_rows`) fuse those copies."""
    parts = [getattr(module, name) for name in names]
    if (fused_rows := fuse_dense_rows(parts) or fuse_quantized(parts)) is not None:
        for name in names:
            delattr(module, name)
        return fused_rows
    if any(type(p) is not nn.Linear for p in parts):
        return None
    biased = ["bias" in p for p in parts]
    if any(biased) and not all(biased):
        return None
    weight = mx.concatenate([p.weight for p in parts], axis=0)
    fused = TransposedWeightLinear(weight.shape[1], weight.shape[0], bias=all(biased))
    fused.weight = weight
    if all(biased):
        fused.bias = mx.concatenate([p.bias for p in parts])
    mx.eval(fused.parameters())  # type: ignore[no-untyped-call]  # mlx.nn.Module.parameters is unannotated
    for name in names:
        delattr(module, name)
    return fused
