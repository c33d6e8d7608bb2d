"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention and its routed and shared experts.

Attention (MLA): q through a low-rank pair (`q_a_proj`, normed, `q_b_proj`) or one `q_proj`; keys and
values from one compressed latent per token (`kv_a_proj_with_mqa`: the latent and a RoPE key shared by
every head; `kv_b_proj` expands the normed latent into each head's un-rotated key and its value). RoPE
(interleaved pairs, YaRN where configured) touches only the `qk_rope_head_dim` features.

The caches hold what MLA compresses, never the expansion: per token and layer the normed latent (in a
cache's "keys") and the rotated RoPE key (its "values"), one head: kv_lora_rank + qk_rope_head_dim
features, where expanded keys and values take heads x (qk_head_dim + v_head_dim). Every cache, batch and
prefix-cache path of the engine stores them as it stores any keys and values (it never assumes the two
equally wide). Attention splits each score into its latent part and its RoPE part: the RoPE part (the
queries' rotated features against the shared rotated keys) is computed apart and handed to MLX's
attention as its additive mask, the layer's own mask folded in. The latent part is computed either
absorbed (`W_UK`, `kv_b_proj`'s key rows, folded into each query: keys and values are the latent itself,
one head; `W_UV`, its value rows, applied to the output) or, for a chunk of many queries where that is
cheaper (`absorbed_is_cheaper`), by expanding the latent of every key through `kv_b_proj`.

Experts: sigmoid router scores; experts chosen by score plus `e_score_correction_bias`, only within the
`topk_group` groups whose two best biased scores sum highest; weighted by their unbiased scores
(renormalised per `norm_topk_prob`) times `routed_scaling_factor`; `n_shared_experts` always-on experts
added; the first `first_k_dense_replace` layers dense. Routed experts are `moe.SwitchGLU`'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.errors import CheckpointError
from mlxq.worker.engine.models import llama, masks, mlp, model_args, moe
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.models.fused_linear import KeptView, kept_view
from mlxq.worker.engine.models.rope import make_rope, yarn_mscale
from mlxq.worker.engine.ragged_attention import RaggedRows


@dataclass
class ModelArgs(model_args.ModelArgs):
    """The Llama family's fields plus MLA's and the experts'. `n_kv_heads` (1) and `head_dim`
    (kv_lora_rank) describe the cache's keys, the latent; config.json's `head_dim` (transformers writes
    the RoPE width there) is not read."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_interleave: bool = True
    n_routed_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    quantization: dict[str, Any] | None = None  # an MLX-quantized folder's: to read mlx-lm's split kv_b_proj
    qk_head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        self.head_dim = None  # transformers writes qk_rope_head_dim here; the caches' width is set below
        super().__post_init__()
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.head_dim = self.kv_lora_rank
        self.n_kv_heads = 1
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise CheckpointError(f"n_routed_experts {self.n_routed_experts} is not a multiple of n_group")
        if self.n_routed_experts and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise CheckpointError(f"num_experts_per_tok {self.num_experts_per_tok} is out of range")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        args = super().from_dict({k: v for k, v in config.items() if k != "head_dim"})
        assert isinstance(args, ModelArgs)
        return args

    @property
    def cache_features(self) -> int:
        """Features one token adds to one layer's cache: the latent and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale_all_dim correction squared where configured."""
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        rope = self.rope_scaling or {}
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            factor = float(rope.get("factor") or 1.0)
            scale *= yarn_mscale(factor, float(rope["mscale_all_dim"])) ** 2
        return scale


class LatentAttention(nn.Module):
    """MLA over a latent cache (module docstring): a layer's cache holds, per token, the normed latent as
    its "keys" (B, 1, T, kv_lora_rank) and the rotated RoPE key as its "values" (B, 1, T, rope)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        h, heads = args.hidden_size, args.num_attention_heads
        self.n_heads, self.nope, self.rope_dim = heads, args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim, self.latent = args.v_head_dim, args.kv_lora_rank
        self.q_lora = args.q_lora_rank is not None
        if args.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(h, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = nn.RMSNorm(
                args.q_lora_rank, eps=1e-6
            )  # transformers' default, not the config's
            self.q_b_proj = nn.Linear(args.q_lora_rank, heads * args.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.latent + self.rope_dim, bias=args.attention_bias)
        self.kv_a_layernorm = nn.RMSNorm(self.latent, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.latent, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=args.attention_bias)
        self.scale = args.softmax_scale()
        self.rope = make_rope(
            self.rope_dim, args.rope_theta, args.rope_scaling, traditional=args.rope_interleave
        )
        self._absorbed: tuple[mx.array, mx.array] | None = None  # set by `fuse`: not a parameter

    def fuse(self) -> None:
        """Split `kv_b_proj` per head once the weights are in (dequantized, where quantized), so that
        absorbed attention does not split (or dequantize) it at every forward."""
        if self._absorbed is None:
            w_uk, w_uv = self._split_kv_b()
            self._absorbed = (mx.contiguous(w_uk), mx.contiguous(w_uv))
            mx.eval(self._absorbed)

    def _split_kv_b(self) -> tuple[mx.array, mx.array]:
        """(W_UK (heads, nope, latent), W_UV transposed (heads, latent, v_dim)): `kv_b_proj` per head."""
        if self._absorbed is not None:
            return self._absorbed
        proj = self.kv_b_proj
        if isinstance(proj, nn.QuantizedLinear):
            mode = getattr(proj, "mode", "affine")
            w = mx.dequantize(
                proj.weight, proj.scales, proj.get("biases"), proj.group_size, proj.bits, mode=mode
            )
            w = w.astype(proj.scales.dtype)
        else:
            w = proj.weight
        w = w.reshape(self.n_heads, self.nope + self.v_dim, self.latent)
        return w[:, : self.nope], w[:, self.nope :].swapaxes(-1, -2)

    def __call__(
        self,
        x: mx.array,
        mask: masks.Mask,
        cache: LayerCache | None,
        last: int | None = None,
        columns: int | None = None,
    ) -> mx.array:
        b, n, _ = x.shape
        xq = x if last is None else x[:, last : last + 1]
        nq = xq.shape[1]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(xq))) if self.q_lora else self.q_proj(xq)
        q = q.reshape(b, nq, self.n_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., : self.latent]).reshape(b, 1, n, self.latent)
        k_pe = compressed[..., self.latent :].reshape(b, 1, n, self.rope_dim)
        visible: masks.Mask = mask
        if isinstance(mask, RaggedRows):  # a decode step of left-padded rows: see ragged_attention.py
            assert isinstance(cache, BatchKVCache) and last is None
            q_pe, k_pe = self.rope(q_pe, offset=mask.positions), self.rope(k_pe, offset=mask.positions)
            cache.write(latent, k_pe)
            assert cache.keys is not None and cache.values is not None
            latent, k_pe = cache.keys[..., : mask.end, :], cache.values[..., : mask.end, :]
            visible = ragged_mask(mask)
        else:
            offset = cache.offset if cache is not None else 0
            q_pe = self.rope(q_pe, offset=offset if last is None else offset + last)
            k_pe = self.rope(k_pe, offset=offset)
            if cache is not None and columns is None:
                latent, k_pe = cache.update_and_fetch(latent, k_pe)
            elif cache is not None:
                assert isinstance(cache, KVCache)
                latent, k_pe = cache.update_and_fetch(latent, k_pe, columns)
        # The RoPE part of every score, with the mask folded in: attention adds it to the latent part's.
        rotary = _masked_scores((q_pe * self.scale) @ k_pe.swapaxes(-1, -2), visible)
        keys = latent.shape[2]
        if absorbed_is_cheaper(nq, self.latent, self.nope, self.v_dim):
            w_uk, w_uv = self._split_kv_b()
            queries = q_nope @ w_uk  # (B, H, nq, latent): the key projection folded into the queries
            out = mx.fast.scaled_dot_product_attention(queries, latent, latent, scale=self.scale, mask=rotary)
            out = out @ w_uv  # the value projection applied after attention, to the latent it averaged
        else:
            kv = self.kv_b_proj(latent).reshape(b, keys, self.n_heads, -1).transpose(0, 2, 1, 3)
            k_nope, values = kv[..., : self.nope], kv[..., self.nope :]
            out = mx.fast.scaled_dot_product_attention(q_nope, k_nope, values, scale=self.scale, mask=rotary)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, nq, -1))


def absorbed_is_cheaper(queries: int, latent: int, nope: int, v_dim: int) -> bool:
    """Whether attending in the latent space takes fewer multiply-adds per head than expanding every
    key's latent through `kv_b_proj` first, for a forward of `queries` queries over many keys. Per key,
    absorbed attention scores and sums over the latent's width for each query (2 x latent each);
    expanded attention projects the key once (latent x (nope + v_dim)), then scores and sums over the
    head's narrower key and value (nope + v_dim each query). The queries' own projections into and out
    of the latent do not grow with the keys and are left out, so the choice depends on the forward's
    shape only, never on how many keys a cache holds: a sequence computes the same way alone, batched
    or over a bucketed cache. A decode step (one query) always absorbs; a long prompt's chunk expands."""
    return queries * 2 * latent <= latent * (nope + v_dim) + queries * (nope + v_dim)


def ragged_mask(rows: RaggedRows) -> mx.array:
    """Boolean (B, 1, 1, end) mask of a decode step of left-padded rows: each row's columns from its
    first one. Latent attention reads the cache's latent through MLX's attention, its RoPE scores as
    the mask, so the ragged kernel (full per-head keys and values) has no part in it."""
    return (mx.arange(rows.end)[None, :] >= rows.starts[:, None])[:, None, None, :]


def _masked_scores(scores: mx.array, mask: masks.Mask) -> mx.array:
    """(B, H, L, T) scores with the layer's mask applied: hidden columns -inf (boolean or "causal"
    masks: the last query aligned with the last key, as MLX's attention aligns it) or added (additive
    masks), as an additive mask for MLX's attention."""
    if mask is None:
        return scores
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask {mask!r} is not 'causal'")
        n, total = scores.shape[-2], scores.shape[-1]
        mask = mx.arange(total)[None, :] <= mx.arange(total - n, total)[:, None]
    assert isinstance(mask, mx.array)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    return scores + mask.astype(scores.dtype)


class Router(nn.Module):
    """The router's weights: one row per expert, and the bias that steers the choice (not the weights)."""

    _float32_t: KeptView | None = None

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.weight = mx.zeros((experts, hidden))
        self.e_score_correction_bias = mx.zeros((experts,))

    def logits(self, x: mx.array) -> mx.array:
        """Router logits in float32 of tokens x (..., hidden): the weight's float32 transpose is made
        once (computed with the first forward, then kept), not two ops a forward."""
        self._float32_t = kept_view(self._float32_t, self["weight"], lambda w: w.astype(mx.float32).T)
        return x.astype(mx.float32) @ self._float32_t.view


def route(
    logits: mx.array, bias: mx.array, k: int, groups: int, top_groups: int, renormalize: bool, scale: float
) -> tuple[mx.array, mx.array]:
    """(weights (N, k) float32, experts (N, k)) by DeepSeek-V3's rule (module docstring); equal scores
    are ordered as in `moe.route`."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + bias.astype(mx.float32)
    n, experts = choice.shape
    if top_groups < groups:  # every group kept (one group, as many models have): nothing to mask
        grouped = choice.reshape(n, groups, experts // groups)
        group_scores = mx.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        kept = mx.argsort(-group_scores, axis=-1)[:, :top_groups]
        in_kept = (mx.arange(groups)[None, None, :] == kept[:, :, None]).any(axis=1)  # (N, groups)
        choice = mx.where(mx.repeat(in_kept, experts // groups, axis=-1), choice, -mx.inf)
    chosen = mx.argsort(-choice, axis=-1)[:, :k]
    weights = mx.take_along_axis(scores, chosen, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * scale, chosen


class DeepseekMoE(nn.Module):
    """Routed experts (`moe.SwitchGLU`) and the shared ones."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.gate = Router(args.hidden_size, args.n_routed_experts)
        self.switch_mlp = moe.SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts)
        if args.n_shared_experts:
            width = args.moe_intermediate_size * args.n_shared_experts
            self.shared_experts = mlp.MLP(dataclasses.replace(args, intermediate_size=width))
        self.args = args

    def fuse(self) -> None:
        self.switch_mlp.fuse(self.args.num_experts_per_tok)
        if "shared_experts" in self:
            self.shared_experts.fuse()

    @property
    def large_from(self) -> int | None:
        """From how many tokens a forward of this layer holds its experts dequantized (as
        `moe.SparseMoeBlock.large_from`)."""
        return self.switch_mlp.dense_tokens(self.args.num_experts_per_tok)

    def __call__(self, x: mx.array) -> mx.array:
        a = self.args
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route(
            self.gate.logits(flat),
            self.gate.e_score_correction_bias,
            a.num_experts_per_tok,
            a.n_group,
            a.topk_group,
            a.norm_topk_prob,
            a.routed_scaling_factor,
        )
        # the experts' outputs weighted and summed by one matmul (`SwitchGLU.weighted`)
        y = self.switch_mlp.weighted(flat[:, None, :], experts[:, None, :], weights[:, None, :])
        y = y.reshape(x.shape)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


def _feed_forward(args: ModelArgs, layer: int) -> tuple[str, nn.Module]:
    if args.n_routed_experts and layer >= args.first_k_dense_replace:
        return "mlp", DeepseekMoE(args)
    return "mlp", mlp.MLP(args)


class Model(moe.Model):
    """A Llama-family model with latent attention and DeepSeek's experts (stacked as `moe.Model` does)."""

    def __init__(self, args: ModelArgs) -> None:
        llama.Model.__init__(self, args, partial(_feed_forward, args), lambda _layer: LatentAttention(args))
        self.n_experts = args.n_routed_experts

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """`moe.Model`'s, less the multi-token-prediction layers some checkpoints carry past the last one,
        with mlx-lm's split of `kv_b_proj` (mlx-community's folders) joined back (`_join_kv_b`)."""
        layers = len(self.layers)
        weights = {k: v for k, v in weights.items() if not _beyond(k, layers)}
        for i in range(layers):
            prefix = f"model.layers.{i}.self_attn"
            if f"{prefix}.embed_q.weight" in weights:
                self._join_kv_b(weights, prefix)
        return super().sanitize(weights)

    def _join_kv_b(self, weights: dict[str, mx.array], prefix: str) -> None:
        """mlx-lm stores `kv_b_proj` per head as `embed_q` (heads, latent, nope: the key part, transposed)
        and `unembed_out` (heads, v_dim, latent), each quantized on its own in quantized folders; this
        model reads the projection whole (expanded attention) as well as per head (absorbed), so the
        parts are dequantized and joined back."""
        args = self.args
        assert isinstance(args, ModelArgs)
        key = self._dense(weights, f"{prefix}.embed_q").swapaxes(-1, -2)
        value = self._dense(weights, f"{prefix}.unembed_out")
        joined = mx.concatenate([key, value], axis=1)  # (heads, nope + v_dim, latent)
        weights[f"{prefix}.kv_b_proj.weight"] = joined.reshape(-1, joined.shape[-1])

    def _dense(self, weights: dict[str, mx.array], stem: str) -> mx.array:
        weight = weights.pop(f"{stem}.weight")
        if f"{stem}.scales" not in weights:
            return weight
        args = self.args
        assert isinstance(args, ModelArgs)
        settings = dict(args.quantization or {})
        override = settings.get(stem)
        if isinstance(override, dict):
            settings = {**settings, **override}
        scales, biases = weights.pop(f"{stem}.scales"), weights.pop(f"{stem}.biases", None)
        return mx.dequantize(
            weight,
            scales,
            biases,
            group_size=settings.get("group_size"),
            bits=settings.get("bits"),
            mode=settings.get("mode", "affine"),
        )


def _beyond(key: str, layers: int) -> bool:
    if not key.startswith("model.layers."):
        return False
    index = key.split(".", 3)[2]
    return index.isdigit() and int(index) >= layers
