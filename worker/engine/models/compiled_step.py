"""A flat decode step of the Llama family (one position a row: `llama.LlamaModel`) whose layers' pure
parts are `mx.compile`d functions (`CompiledStep`; the engine's `compiled_steps` option).

A GPU's decode step is bound by the host's build of its graph, op by op in Python; a compiled
function, once traced for its inputs' shapes, replays its ops without that. A layer's step becomes:
compiled (the layer before's output projection and feed-forward, then this layer's norm, q/k/v
projection, heads and RoPE) -> the keys and values written into the batch cache's buffers and the
attention over them (outside: a compiled function's outputs are new arrays, so a write into a held
buffer inside one would copy the whole buffer, and the key count changes every step) -> the next.

The compiled functions take the weights as inputs (one trace serves every layer) and the RoPE offsets
as an array (a Python int would be a constant of the trace, traced again every step); so they trace
again only for another batch size or offset layout. They compute the same ops as the layers do, so
their outputs are the same bits (`tests/engine/test_compiled_step.py`).

Only layers built of the plain parts qualify (`CompiledStep.of`): `Attention` with q/k/v fused (and
per-head norms, if any, normalising q and k side by side: Qwen3's), the dense `MLP` fused, RMS norms,
output projections keeping their transposes with no bias (quantized layers, DeepSeek's latent
attention, Gemma 3's and the mixtures of experts' layers do not: the option does nothing for them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.models.attention import Attention
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.models.fused_linear import TransposedWeightLinear
from mlxq.worker.engine.models.masks import Mask
from mlxq.worker.engine.models.mlp import MLP, _swiglu
from mlxq.worker.engine.models.rope import RoPE
from mlxq.worker.engine.ragged_attention import RaggedRows

Weights = tuple[mx.array, ...]


@dataclass(frozen=True)
class _Layer:
    """One layer's arrays as the compiled functions take them."""

    attention: Attention
    norm: Weights  # input_layernorm's weight, and the q and k heads' norm weights if it has them
    qkv: Weights  # the fused projection's transposed weight, and its bias if it has one
    out: Weights  # o_proj's transposed weight, post_attention_layernorm's weight, gate/up's, down's


def _plain(proj: Any, bias: bool = False) -> bool:
    """Whether a projection is a dense one keeping its transpose (with a bias only if `bias`)."""
    return isinstance(proj, TransposedWeightLinear) and (bias or "bias" not in proj)


def _qualifies(layer: nn.Module) -> bool:
    attn, ff = layer.self_attn, layer.feed_forward
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        type(attn) is Attention
        and (not attn.qk_norm or attn.qk_together)
        and type(attn.rope) is RoPE
        and _plain(attn.qkv_proj, bias=True)
        and _plain(attn.o_proj)
        and type(ff) is MLP
        and _plain(ff.gate_up_proj)
        and _plain(ff.down_proj)
        and all(type(n) is nn.RMSNorm for n in norms)
    )


class CompiledStep:
    """A flat decode step through compiled layer parts; made by `of` once the weights are in and
    fused (it keeps the arrays it reads)."""

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
        self.traces = 0  # times a compiled function was traced (a test counts retraces)
        self._first = mx.compile(self._qkv)
        self._between = mx.compile(self._out_then_qkv)
        self._last = mx.compile(self._out_then_norm)

    @classmethod
    def of(cls, layers: Sequence[nn.Module], final_norm: nn.Module) -> CompiledStep | None:
        """The compiled step of these layers, or None where any is not built of the plain parts (or
        they differ in having per-head norms)."""
        if not layers or type(final_norm) is not nn.RMSNorm or not all(map(_qualifies, layers)):
            return None
        attns = [layer.self_attn for layer in layers]
        if len({(a.qk_norm, a.q_norm.eps if a.qk_norm else None) for a in attns}) > 1:
            return None
        return cls(layers, final_norm)

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
        first = self.layers[0]
        qk, v = self._first(h, first.norm, first.qkv, offset)
        for i, layer in enumerate(self.layers):
            attn = self._attend(layer.attention, qk, v, mask, caches[i])
            if i + 1 == len(self.layers):
                return self._last(attn, h, layer.out, self.final_norm)
            nxt = self.layers[i + 1]
            mask = masks(windows[i + 1])
            h, qk, v = self._between(attn, h, layer.out, nxt.norm, nxt.qkv, offset)
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
        if isinstance(mask, RaggedRows):
            assert isinstance(cache, BatchKVCache)
            return attn.ragged_attention(qk, v, mask, cache, (qk.shape[0], self.heads * self.head_dim))
        h = self.heads
        return attn.cached_attention(qk[:, :h], qk[:, h:], v, mask, cache)

    def _qkv(self, h: mx.array, norm: Weights, qkv: Weights, offset: mx.array) -> tuple[mx.array, mx.array]:
        """`Attention._rotated` of the normed input: q and k heads side by side (normalised per head
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
        h = mx.addmm(residual, attn.reshape(residual.shape), o_proj)
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
        attention=attn,
        norm=(norm, attn.qk_scale()) if attn.qk_norm else (norm,),
        qkv=(qkv.transposed(), qkv.bias) if "bias" in qkv else (qkv.transposed(),),
        out=(
            attn.o_proj.transposed(),
            layer.post_attention_layernorm.weight,
            ff.gate_up_proj.transposed(),
            ff.down_proj.transposed(),
        ),
    )
