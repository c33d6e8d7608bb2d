"""Gemma 3, text only (`Gemma3ForCausalLM`): the Llama layout with Gemma's own parts.

What differs from `llama.py`: local (sliding-window) and global layers, each kind with its own RoPE
(`layer_types`, or `sliding_window_pattern` in transformers 4's configs: every n-th layer global); the
token embeddings scaled by sqrt(hidden_size), rounded to the embedding dtype as transformers does;
Gemma's RMSNorm, whose weight is stored as an offset from 1, on the block's input and attention output,
before and after the feed-forward, and per head on q and k; a GELU (tanh) gated MLP; attention scaled
by `query_pre_attn_scalar`**-0.5 rather than head_dim's; tied embeddings by default. Everything else,
the caches, masks and sliding windows (`window.py`) included, is the Llama family's code.

Module names equal the checkpoint's keys (`model.layers.N.pre_feedforward_layernorm`) as transformers
4 and 5 write a `Gemma3ForCausalLM`. The multimodal `Gemma3ForConditionalGeneration` (Gemma 3 4B and
up, and mlx-community's folders of them) loads as its language model alone (`MultimodalArgs`,
`MultimodalModel`): the config's `text_config`, the weights under `language_model.model.` (or
`model.language_model.`) renamed, the vision tower and projector dropped; images are not read. Attention
or final logit soft-capping and bidirectional attention are refused, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.errors import CheckpointError, UnsupportedArchitecture
from mlxq.worker.engine.models import attention, llama, masks, mlp, model_args
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.models.rope import make_rope

ACTIVATIONS = ("gelu_pytorch_tanh",)


@dataclass
class ModelArgs(model_args.ModelArgs):
    """The Llama family's fields with Gemma 3's defaults (transformers' `Gemma3TextConfig`: a
    multimodal config's `text_config` writes only what differs from them), plus its own."""

    vocab_size: int = 262208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    rms_norm_eps: float = 1e-6
    head_dim: int | None = 256
    max_position_embeddings: int = 131072
    rope_theta: float = 1_000_000.0
    sliding_window: int | None = 4096
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window_pattern: int = 6  # transformers 4: every n-th layer global, where layer_types is absent
    local_rope: dict[str, Any] | None = None  # the local layers' RoPE, as `from_dict` reads it
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = None

    def __post_init__(self) -> None:
        if self.layer_types is None:
            every = self.sliding_window_pattern
            self.layer_types = [
                "full_attention" if (i + 1) % every == 0 else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        super().__post_init__()
        if self.hidden_activation not in ACTIVATIONS:
            raise UnsupportedArchitecture(self.hidden_activation, list(ACTIVATIONS), what="hidden_activation")
        refused = {
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
            "use_bidirectional_attention": self.use_bidirectional_attention or None,
        }
        for name, value in refused.items():
            if value is not None:
                raise UnsupportedArchitecture(
                    f"{name}={value}", ["null"], what=f"Gemma 3 {name}", why="it is not implemented"
                )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """Read RoPE per layer kind: transformers 5's `rope_parameters` keyed by layer type, or 4's
        `rope_theta`/`rope_scaling` (global layers) and `rope_local_base_freq` (local ones)."""
        config = {k: v for k, v in config.items() if k != "hidden_act"}  # Gemma reads hidden_activation
        params = config.get("rope_parameters")
        if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
            config["rope_parameters"] = {"rope_theta": 1_000_000.0, **(params.get("full_attention") or {})}
            config["local_rope"] = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
        else:
            config.setdefault("rope_theta", 1_000_000.0)
            config["local_rope"] = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
        args = super().from_dict(config)
        assert isinstance(args, ModelArgs)
        return args

    def local_rope_settings(self) -> tuple[float, dict[str, Any] | None]:
        """The local layers' RoPE base and scaling (`model_args.rope_settings`'s normalised form)."""
        theta, scaling, _ = model_args.rope_settings({"rope_parameters": self.local_rope or {}})
        return theta, scaling


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (zeros mean no scaling)."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class Attention(attention.Attention):
    """The Llama family's attention with Gemma's q/k norms, scale, and the RoPE of the layer's kind."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args)
        assert args.head_dim is not None and args.layer_types is not None
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_norm = RMSNorm(args.head_dim, eps=args.rms_norm_eps)  # type: ignore[assignment]  # Gemma's
        self.k_norm = RMSNorm(args.head_dim, eps=args.rms_norm_eps)  # type: ignore[assignment]
        self.qk_norm = True
        if args.layer_types[layer] == "sliding_attention":
            self.rope = make_rope(args.head_dim, *args.local_rope_settings())


@partial(mx.compile, shapeless=True)
def _geglu(gate: mx.array, up: mx.array) -> mx.array:
    """gelu_tanh(gate) * up as one compiled op."""
    return nn.gelu_approx(gate) * up  # type: ignore[no-any-return]  # mlx.nn.gelu_approx is unannotated


class MLP(mlp.MLP):
    """The gated MLP with GELU (tanh approximation) in place of SiLU."""

    def gated(self, gate: mx.array, up: mx.array) -> mx.array:
        return _geglu(gate, up)


class TransformerBlock(nn.Module):
    """Gemma's block: attention and MLP each between a pre-norm and a post-norm, then the residual."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        h, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def __call__(
        self,
        x: mx.array,
        mask: masks.Mask,
        cache: LayerCache | None,
        last: int | None = None,
        columns: int | None = None,
    ) -> mx.array:
        """The block's output for every position, or with `last` for that position only."""
        attn = self.self_attn(self.input_layernorm(x), mask, cache, last, columns)
        h = (x if last is None else x[:, last : last + 1]) + self.post_attention_layernorm(attn)
        out: mx.array = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h + out

    @property
    def feed_forward(self) -> MLP:
        return self.mlp


class GemmaModel(llama.LlamaModel):
    """Embedding (scaled), Gemma blocks and final norm; the forward is the Llama family's."""

    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)  # the Llama layers are not built
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]  # type: ignore[misc]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)  # type: ignore[assignment]
        self.bucket_keys = False
        self.windows = args.windows
        self.embed_scale = args.hidden_size**0.5

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings times sqrt(hidden_size), the scale rounded to their dtype first."""
        h = self.embed_tokens(inputs)
        return h * mx.array(self.embed_scale, dtype=h.dtype)  # type: ignore[no-any-return]


class Model(llama.Model):
    """`llama.Model` over Gemma 3's decoder (`GemmaModel`)."""

    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)  # the Llama decoder is not built
        self.args = args
        self.model = GemmaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


# Where the multimodal checkpoints keep the language model's decoder, and what else they hold
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


@dataclass
class MultimodalArgs(ModelArgs):
    """`Gemma3ForConditionalGeneration`'s language model: its config is the `text_config`."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError("config.json of a Gemma3ForConditionalGeneration has no text_config")
        return super().from_dict({**text, "architectures": config.get("architectures")})


class MultimodalModel(Model):
    """The language model of `Gemma3ForConditionalGeneration` (text in, text out)."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The decoder's weights under the text model's names; the vision tower and projector dropped
        (anything else is left for the loader to name as unexpected)."""
        text: dict[str, mx.array] = {}
        for key, value in weights.items():
            prefix = next((p for p in _TEXT_PREFIXES if key.startswith(p)), None)
            if prefix is not None:
                text["model." + key[len(prefix) :]] = value
            elif key.startswith("language_model.lm_head."):
                text[key[len("language_model.") :]] = value
            elif not key.startswith(_VISION_PREFIXES):
                text[key] = value
        return super().sanitize(text)
