"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention and its routed and shared experts.

Attention (MLA): q through a low-rank pair (`q_a_proj`, normed, `q_b_proj`) or one `q_proj`; keys and
values from one compressed latent per token (`kv_a_proj_with_mqa`: the latent and a RoPE key shared by
every head; `kv_b_proj` expands the normed latent into each head's un-rotated key and its value). RoPE
(interleaved pairs, YaRN where configured) touches only the `qk_rope_head_dim` features. The caches
hold each head's expanded key and value, the value zero-padded to the key's width, so every cache,
batch and kernel of the engine serves it unchanged: exact, at the memory of full keys and values. The
absorbed form (the latent cached, `kv_b_proj` folded into q and the output for decode) is not done.

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
from mlxq.worker.engine.models import llama, moe
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.models.rope import make_rope, yarn_mscale
from mlxq.worker.engine.ragged_attention import RaggedRows, decode_attention


@dataclass
class ModelArgs(llama.ModelArgs):
    """The Llama family's fields plus MLA's and the experts'. `head_dim` and `n_kv_heads` become what
    the caches hold per layer (every head; the wider of key and value); config.json's `head_dim`
    (transformers writes the RoPE width there) is not read."""

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
        self.head_dim = max(self.qk_head_dim, self.v_head_dim)
        self.num_key_value_heads = self.n_kv_heads = self.num_attention_heads
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise CheckpointError(f"n_routed_experts {self.n_routed_experts} is not a multiple of n_group")
        if self.n_routed_experts and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise CheckpointError(f"num_experts_per_tok {self.num_experts_per_tok} is out of range")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        args = super().from_dict({k: v for k, v in config.items() if k != "head_dim"})
        assert isinstance(args, ModelArgs)
        return args

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale_all_dim correction squared where configured."""
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        rope = self.rope_scaling or {}
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            factor = float(rope.get("factor") or 1.0)
            scale *= yarn_mscale(factor, float(rope["mscale_all_dim"])) ** 2
        return scale


class LatentAttention(nn.Module):
    """MLA with expanded keys and values (module docstring); `llama.Attention`'s call and cache use."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        h, heads = args.hidden_size, args.num_attention_heads
        self.n_heads, self.nope, self.rope_dim = heads, args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim, self.width, self.latent = args.v_head_dim, args.head_dim or 0, args.kv_lora_rank
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

    def fuse(self) -> None:
        """Nothing to fuse: the projections feed one another."""

    def _pad(self, x: mx.array) -> mx.array:
        extra = self.width - x.shape[-1]
        return x if extra == 0 else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])

    def __call__(
        self,
        x: mx.array,
        mask: llama.Mask,
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
        latent, k_pe = compressed[..., : self.latent], compressed[..., self.latent :]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k_nope, v = kv[..., : self.nope], self._pad(kv[..., self.nope :])
        k_pe = k_pe.reshape(b, 1, n, self.rope_dim)

        def keys(k_rotated: mx.array) -> mx.array:
            shared = mx.broadcast_to(k_rotated, (b, self.n_heads, n, self.rope_dim))
            return self._pad(mx.concatenate([k_nope, shared], axis=-1))

        if isinstance(mask, RaggedRows):  # a decode step of left-padded rows: see ragged_attention.py
            assert isinstance(cache, BatchKVCache) and last is None
            q_pe, k_pe = self.rope(q_pe, offset=mask.positions), self.rope(k_pe, offset=mask.positions)
            cache.write(keys(k_pe), v)
            assert cache.keys is not None and cache.values is not None
            queries = self._pad(mx.concatenate([q_nope, q_pe], axis=-1))
            out = decode_attention(queries, cache.keys, cache.values, mask, self.scale)
        else:
            offset = cache.offset if cache is not None else 0
            q_pe = self.rope(q_pe, offset=offset if last is None else offset + last)
            k_pe = self.rope(k_pe, offset=offset)
            k, values = keys(k_pe), v
            if cache is not None and columns is None:
                k, values = cache.update_and_fetch(k, values)
            elif cache is not None:
                assert isinstance(cache, KVCache)
                k, values = cache.update_and_fetch(k, values, columns)
            queries = self._pad(mx.concatenate([q_nope, q_pe], axis=-1))
            out = mx.fast.scaled_dot_product_attention(queries, k, values, scale=self.scale, mask=mask)
        out = out[..., : self.v_dim].transpose(0, 2, 1, 3).reshape(b, nq, -1)
        return self.o_proj(out)


class Router(nn.Module):
    """The router's weights: one row per expert, and the bias that steers the choice (not the weights)."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.weight = mx.zeros((experts, hidden))
        self.e_score_correction_bias = mx.zeros((experts,))


def route(
    logits: mx.array, bias: mx.array, k: int, groups: int, top_groups: int, renormalize: bool, scale: float
) -> tuple[mx.array, mx.array]:
    """(weights (N, k) float32, experts (N, k)) by DeepSeek-V3's rule (module docstring); equal scores
    are ordered as in `moe.route`."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + bias.astype(mx.float32)
    n, experts = choice.shape
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
            self.shared_experts = llama.MLP(dataclasses.replace(args, intermediate_size=width))
        self.args = args

    def fuse(self) -> None:
        self.switch_mlp.fuse()
        if "shared_experts" in self:
            self.shared_experts.fuse()

    def __call__(self, x: mx.array) -> mx.array:
        a = self.args
        flat = x.reshape(-1, x.shape[-1])
        logits = flat.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T
        weights, experts = route(
            logits,
            self.gate.e_score_correction_bias,
            a.num_experts_per_tok,
            a.n_group,
            a.topk_group,
            a.norm_topk_prob,
            a.routed_scaling_factor,
        )
        out = self.switch_mlp(flat, experts)
        y = (out * weights[..., None].astype(out.dtype)).sum(axis=1).reshape(x.shape)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


def _feed_forward(args: ModelArgs, layer: int) -> tuple[str, nn.Module]:
    if args.n_routed_experts and layer >= args.first_k_dense_replace:
        return "mlp", DeepseekMoE(args)
    return "mlp", llama.MLP(args)


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
        model computes with the expanded projection, so the parts are dequantized and joined back."""
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
