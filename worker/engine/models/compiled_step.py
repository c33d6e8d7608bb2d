"""A flat decode step of the Llama family (one position a row: `llama.LlamaModel`) whose layers' pure
parts are `mx.compile`d functions (`CompiledStep`; the engine's `compiled_steps` option).

A GPU's decode step is bound by the host's build of its graph, op by op in Python; a compiled
function, once traced for its inputs' shapes, replays its ops without that. A layer's step becomes:
compiled (the layer before's output projection and feed-forward, then this layer's norm, q/k/v
projection, heads and RoPE) -> the keys and values written into the batch cache's buffers and the
attention over them (outside: a compiled function's outputs are new arrays, so a write into a held
buffer inside one would copy the whole buffer, and the key count changes every step) -> the next.
The RoPE offsets go in as an array (a Python int would be a constant of the trace, traced again every
step), so the parts trace again only for another batch size or offset layout.

Two ways to make the parts (`CompiledStep.of`), each computing the very ops of the eager layers, so
their outputs are the same bits (`tests/engine/test_compiled_step.py`):
- `_SharedParts`, for layers built of the plain parts only (`Attention` with q/k/v fused, per-head norms
  if any normalising q and k side by side (Qwen3's), the dense `MLP` fused, RMS norms, dense output
  projections keeping their transposes with no bias): functions written over the arrays, taking each
  layer's weights as inputs, so one trace serves every layer.
- `_LayerParts`, for any other layer of the Llama family's block and attention (quantized projections,
  a mixture of experts' router and experts, a dense-rows layer's copy): each layer's parts are its own
  modules' code compiled with the layer's weights held as constants, traced once per layer for each
  batch shape. A mixture of experts' layer is where this pays most: ~35 ops a layer built in Python.
DeepSeek's latent attention and Gemma 3's blocks qualify for neither (the option does nothing there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.models.attention import Attention
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.models.fused_linear import TransposedWeightLinear
from mlxq.worker.engine.models.masks import Mask
from mlxq.worker.engine.models.mlp import MLP, _swiglu
from mlxq.worker.engine.models.quantized_rows import FusedDenseRows
from mlxq.worker.engine.models.rope import RoPE
from mlxq.worker.engine.ragged_attention import RaggedRows

Weights = tuple[mx.array, ...]


class _Parts(Protocol):
    """A flat step's compiled parts around each layer's attention."""

    traces: int  # times a part was traced (a test counts retraces)
    per_shape: int  # traces a batch shape not met before costs

    def first(self, h: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
        """The first layer's q and k heads side by side, rotated, and v, of the embeddings `h`."""
        ...

    def between(
        self, i: int, attn: mx.array, residual: mx.array, offset: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Layer i's output from its attention's and its input `residual`; then layer i+1's q/k and v."""
        ...

    def last(self, attn: mx.array, residual: mx.array) -> mx.array:
        """The last layer's output, final-normed."""
        ...


class CompiledStep:
    """A flat decode step through compiled layer parts; made by `of` once the weights are in and
    fused (its parts keep the arrays they read)."""

    def __init__(self, attentions: Sequence[Attention], parts: _Parts) -> None:
        self.attentions = list(attentions)
        self.parts = parts

    @property
    def traces(self) -> int:
        return self.parts.traces

    @classmethod
    def of(cls, layers: Sequence[nn.Module], final_norm: nn.Module) -> CompiledStep | None:
        """The compiled step of these layers, or None where they qualify for neither way of making
        the parts (see the module's docstring)."""
        if not layers or type(final_norm) is not nn.RMSNorm:
            return None
        attentions = [layer.self_attn for layer in layers]
        if not all(map(_modular, layers)):
            return None
        for layer in layers:
            _prime(layer)
        parts: _Parts
        if all(map(_plain, layers)) and _SharedParts.alike(attentions):
            parts = _SharedParts(layers, final_norm)
        else:
            parts = _LayerParts(layers, final_norm)
        return cls(attentions, parts)

    def __call__(
        self,
        h: mx.array,
        caches: Sequence[LayerCache | None],
        masks: Callable[[int | None], Mask],
        windows: Sequence[int | None],
    ) -> mx.array:
        """The final normed hidden states (B, hidden) of a flat step's embeddings `h` (B, hidden)."""
        mask = masks(windows[0])
        offset = self._offset(mask, caches[0])
        qk, v = self.parts.first(h, offset)
        last = len(self.attentions) - 1
        for i, attention in enumerate(self.attentions):
            attn = self._attend(attention, qk, v, mask, caches[i])
            if i == last:
                return self.parts.last(attn, h)
            mask = masks(windows[i + 1])
            h, qk, v = self.parts.between(i, attn, h, offset)
        raise AssertionError("unreachable")

    def _offset(self, mask: Mask, cache: LayerCache | None) -> mx.array:
        """The step's RoPE offsets as an array (each row's, or one for all)."""
        if isinstance(mask, RaggedRows):
            return mask.positions
        assert cache is not None
        offset = cache.offset
        return offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)

    def _attend(
        self, attn: Attention, qk: mx.array, v: mx.array, mask: Mask, cache: LayerCache | None
    ) -> mx.array:
        """The layer's attention once its keys and values are in the cache (outside the compiled parts)."""
        h = attn.n_heads
        if isinstance(mask, RaggedRows):
            assert isinstance(cache, BatchKVCache)
            return attn.ragged_attention(qk, v, mask, cache, (qk.shape[0], h * attn.head_dim))
        return attn.cached_attention(qk[:, :h], qk[:, h:], v, mask, cache)


def _prime(layer: nn.Module) -> None:
    """Run a layer's parts once, eagerly, on one row of zeros, and evaluate them: the views its modules
    keep across forwards (weight transposes, Qwen3's stacked norm weights) are then made and computed
    here, on this thread's stream, never first inside a trace or first evaluated by the thread that
    launches a step (which may evaluate only its own stream's ops)."""
    attn, norm = layer.self_attn, layer.input_layernorm
    h = mx.zeros((1, norm.weight.shape[0]), dtype=norm.weight.dtype)
    qk, v = attn.rotated(norm(h), 0)
    mx.eval(qk, v, _LayerParts._out(layer, mx.zeros((1, attn.n_heads * attn.head_dim), h.dtype), h))


def _dense_proj(proj: Any, bias: bool = False) -> bool:
    """Whether a projection is a dense one keeping its transpose (with a bias only if `bias`)."""
    return isinstance(proj, TransposedWeightLinear) and (bias or "bias" not in proj)


def _plain(layer: nn.Module) -> bool:
    """Whether a layer is built of the plain parts `_SharedParts` computes."""
    attn, ff = layer.self_attn, layer.feed_forward
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        type(attn) is Attention
        and (not attn.qk_norm or attn.qk_together)
        and type(attn.rope) is RoPE
        and _dense_proj(attn.qkv_proj, bias=True)
        and _dense_proj(attn.o_proj)
        and type(ff) is MLP
        and _dense_proj(ff.gate_up_proj)
        and _dense_proj(ff.down_proj)
        and all(type(n) is nn.RMSNorm for n in norms)
    )


def _modular(layer: nn.Module) -> bool:
    """Whether a layer is the Llama family's block and attention, with q, k and v out of one array
    whatever the rows (`Attention.rotated`), and a feed-forward of any kind (`_LayerParts`)."""
    attn = layer.self_attn
    if type(attn) is not Attention:  # DeepSeek's latent attention, Gemma 3's
        return False
    proj = attn.qkv_proj
    return (
        getattr(layer, "attention_adds", False)
        and proj is not None
        and (not attn.qk_norm or attn.qk_together)
        and not (isinstance(proj, FusedDenseRows) and proj.quantized is None)  # few rows: parts apart
    )


@dataclass(frozen=True)
class _Layer:
    """One layer's arrays as `_SharedParts`' functions take them."""

    norm: Weights  # input_layernorm's weight, and the q and k heads' norm weights if it has them
    qkv: Weights  # the fused projection's transposed weight, and its bias if it has one
    out: Weights  # o_proj's transposed weight, post_attention_layernorm's weight, gate/up's, down's


class _SharedParts:
    """The plain layers' parts as functions of their arrays: one trace serves every layer."""

    per_shape = 3

    def __init__(self, layers: Sequence[nn.Module], final_norm: nn.RMSNorm) -> None:
        first = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.n_heads, first.n_kv_heads, first.head_dim
        self.inter = layers[0].feed_forward.intermediate_size
        self.eps = layers[0].input_layernorm.eps
        self.qk_eps: float = first.q_norm.eps if first.qk_norm else 0.0  # used only with per-head norms
        # Every layer of the family has the same RoPE (its config's): the first's serves all.
        self.rope: RoPE = first.rope
        self.layers = [_layer(layer) for layer in layers]
        self.final_norm = final_norm.weight
        self.traces = 0
        self._first = mx.compile(self._qkv)
        self._between = mx.compile(self._out_then_qkv)
        self._last = mx.compile(self._out_then_norm)

    @staticmethod
    def alike(attentions: Sequence[Attention]) -> bool:
        """Whether the layers' attentions agree in what one trace fixes (per-head norms, their eps)."""
        return len({(a.qk_norm, a.q_norm.eps if a.qk_norm else None) for a in attentions}) == 1

    def first(self, h: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
        layer = self.layers[0]
        return self._first(h, layer.norm, layer.qkv, offset)

    def between(
        self, i: int, attn: mx.array, residual: mx.array, offset: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        layer, nxt = self.layers[i], self.layers[i + 1]
        return self._between(attn, residual, layer.out, nxt.norm, nxt.qkv, offset)

    def last(self, attn: mx.array, residual: mx.array) -> mx.array:
        return self._last(attn, residual, self.layers[-1].out, self.final_norm)

    def _qkv(self, h: mx.array, norm: Weights, qkv: Weights, offset: mx.array) -> tuple[mx.array, mx.array]:
        """`Attention.rotated` of the normed input: q and k heads side by side (normalised per head
        where the layer says, `Attention._qk_normed`), rotated, and v."""
        self.traces += 1  # runs while tracing only
        normed = mx.fast.rms_norm(h, norm[0], self.eps)
        proj = normed @ qkv[0] if len(qkv) == 1 else mx.addmm(qkv[1], normed, qkv[0])
        heads, kv = self.heads, self.kv_heads
        qk, v = mx.split(proj.reshape(h.shape[0], heads + 2 * kv, 1, self.head_dim), [heads + kv], axis=1)
        if len(norm) == 2:
            qk = mx.fast.rms_norm(qk, None, self.qk_eps) * norm[1]
        return self.rope(qk, offset=offset), v

    def _out(self, attn: mx.array, residual: mx.array, out: Weights) -> mx.array:
        """The block's rest after attention: output projection plus the residual, norm, SwiGLU plus
        its residual (`TransformerBlock`, `MLP`)."""
        o_proj, post_norm, gate_up, down = out
        h = mx.addmm(residual, attn.reshape(*residual.shape[:-1], -1), o_proj)
        gate, up = mx.split(mx.fast.rms_norm(h, post_norm, self.eps) @ gate_up, [self.inter], axis=-1)
        return mx.addmm(h, _swiglu(gate, up), down)

    def _out_then_qkv(
        self, attn: mx.array, residual: mx.array, out: Weights, norm: Weights, qkv: Weights, offset: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        h = self._out(attn, residual, out)
        qk, v = self._qkv(h, norm, qkv, offset)
        return h, qk, v

    def _out_then_norm(self, attn: mx.array, residual: mx.array, out: Weights, norm: mx.array) -> mx.array:
        self.traces += 1
        return mx.fast.rms_norm(self._out(attn, residual, out), norm, self.eps)


def _layer(layer: nn.Module) -> _Layer:
    attn, ff = layer.self_attn, layer.feed_forward
    qkv = attn.qkv_proj
    norm = layer.input_layernorm.weight
    return _Layer(
        norm=(norm, attn.qk_scale()) if attn.qk_norm else (norm,),
        qkv=(qkv.transposed(), qkv.bias) if "bias" in qkv else (qkv.transposed(),),
        out=(
            attn.o_proj.transposed(),
            layer.post_attention_layernorm.weight,
            ff.gate_up_proj.transposed(),
            ff.down_proj.transposed(),
        ),
    )


class _LayerParts:
    """Each layer's parts compiled from its own modules' code (`TransformerBlock`'s order), the layer's
    weights constants of its traces: whatever its projections and feed-forward are, the same ops as
    the eager layer. A layer's functions are its own, so each traces once for each batch shape."""

    def __init__(self, layers: Sequence[nn.Module], final_norm: nn.Module) -> None:
        self.traces = 0
        self.per_shape = len(layers) + 1
        self._first = mx.compile(partial(self._qkv, layers[0]))
        self._between = [mx.compile(partial(self._out_then_qkv, a, b)) for a, b in pairwise(layers)]
        self._last = mx.compile(partial(self._out_then_norm, layers[-1], final_norm))

    def first(self, h: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
        return self._first(h, offset)

    def between(
        self, i: int, attn: mx.array, residual: mx.array, offset: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        return self._between[i](attn, residual, offset)

    def last(self, attn: mx.array, residual: mx.array) -> mx.array:
        return self._last(attn, residual)

    def _qkv(self, layer: nn.Module, h: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
        self.traces += 1  # runs while tracing only
        return layer.self_attn.rotated(layer.input_layernorm(h), offset)  # type: ignore[no-any-return]

    @staticmethod
    def _out(layer: nn.Module, attn: mx.array, residual: mx.array) -> mx.array:
        """`TransformerBlock`'s rest after attention: the output projection plus the residual, then
        the normed feed-forward plus its residual (added by the feed-forward where it adds it)."""
        h: mx.array = layer.self_attn.projected_out(attn.reshape(*residual.shape[:-1], -1), residual)
        normed = layer.post_attention_layernorm(h)
        if layer.feed_forward_adds:
            return layer.feed_forward(normed, residual=h)  # type: ignore[no-any-return]
        return h + layer.feed_forward(normed)  # type: ignore[no-any-return]

    def _out_then_qkv(
        self, layer: nn.Module, nxt: nn.Module, attn: mx.array, residual: mx.array, offset: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        h = self._out(layer, attn, residual)
        qk, v = self._qkv(nxt, h, offset)  # counts this function's trace
        return h, qk, v

    def _out_then_norm(
        self, layer: nn.Module, norm: nn.Module, attn: mx.array, residual: mx.array
    ) -> mx.array:
        self.traces += 1
        return norm(self._out(layer, attn, residual))  # type: ignore[no-any-return]
