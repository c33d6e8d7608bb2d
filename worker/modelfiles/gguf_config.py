"""A GGUF file's metadata as Hugging Face config files: the hyper-parameters read and checked
(`read_hparams`, `LlamaHParams`) and written as `config.json` per architecture (`hf_config`; Gemma 3's
own keys derived as llama.cpp derives them) and `generation_config.json` (`generation_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxq.worker.engine.errors import GGUFImportError
from mlxq.worker.modelfiles.gguf_quants import GROUP_SIZE
from mlxq.worker.modelfiles.gguf_tokenizer import GGUFVocab, metadata_value

# GGUF architecture -> (Hugging Face architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# llama.cpp's fixed Gemma 3 values where the file stores none (its model loader's own constants)
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_WINDOW_PATTERN = 6  # every sixth layer global
GEMMA3_27B_LAYERS = 62  # scaled by hidden / heads, not head_dim (llama.cpp tells the 27B by its depth)


@dataclass(frozen=True)
class LlamaHParams:
    """The hyper-parameters of a GGUF file (`<arch>.*` metadata) of a Llama-family architecture."""

    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    context: int
    rope_scaling: dict[str, Any] | None
    arch: str = "llama"
    rope_dim: int | None = None  # rotated features per head, where fewer than head_dim (phi3)
    experts: int = 0  # qwen3moe: experts, experts per token, an expert's width, renormalised weights
    experts_used: int = 0
    expert_ffn: int = 0
    expert_weights_norm: bool = True
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # config keys of the architecture's own (gemma3)


def read_hparams(reader: Any) -> LlamaHParams:
    """Read and check the model hyper-parameters of an open `gguf.GGUFReader`."""
    arch = metadata_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(f"architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")

    def value(key: str, default: Any = None) -> Any:
        return metadata_value(reader, f"{arch}.{key}", default)

    def need(key: str) -> Any:
        found = value(key)
        if found is None:
            raise GGUFImportError(f"GGUF metadata {arch}.{key} is missing")
        return found

    hidden, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(value("attention.key_length", hidden // n_heads))
    rope_dim = int(value("rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":
        raise GGUFImportError(f"partial RoPE ({arch}.rope.dimension_count={rope_dim}, head dim {head_dim})")
    window = value("attention.sliding_window")
    experts = int(value("expert_count", 0))
    n_layers = int(need("block_count"))
    extra = _gemma3_config(value, n_layers, hidden // n_heads, head_dim, window) if arch == "gemma3" else {}
    return LlamaHParams(
        n_layers=n_layers,
        hidden=hidden,
        ffn=int(value("feed_forward_length", 0)) if experts else int(need("feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(value("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_eps=_f32_to_float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32_to_float(value("rope.freq_base", 10000.0)),
        context=int(value("context_length", 2048)),
        rope_scaling=_rope_scaling(reader, arch),
        arch=arch,
        rope_dim=rope_dim if rope_dim != head_dim else None,
        experts=experts,
        experts_used=int(value("expert_used_count", 0)),
        expert_ffn=int(value("expert_feed_forward_length", 0)),
        # llama.cpp renormalises Qwen3-MoE's top-k weights unless a file says otherwise
        expert_weights_norm=bool(value("expert_weights_norm", True)),
        sliding_window=int(window) if window else None,
        extra=extra,
    )


def _gemma3_config(
    value: Any, n_layers: int, hidden_per_head: int, head_dim: int, window: Any
) -> dict[str, Any]:
    """Gemma 3's config keys beyond the Llama family's: layer kinds (every n-th layer global; all
    global without a window), the local layers' RoPE base, the attention scale, its activation, and
    any soft-capping the file sets (which the model then refuses by name)."""
    pattern = value("attention.sliding_window_pattern", GEMMA3_WINDOW_PATTERN)
    if not window:
        kinds = ["full_attention"] * n_layers
    elif isinstance(pattern, list):  # one flag per layer: True where it slides
        kinds = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        kinds = [
            "full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n_layers)
        ]
    config: dict[str, Any] = {
        "layer_types": kinds,
        "rope_local_base_freq": _f32_to_float(value("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": hidden_per_head if n_layers == GEMMA3_27B_LAYERS else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if (cap := value(key)) is not None:
            config[key] = _f32_to_float(cap)
    return config


def _f32_to_float(x: float) -> float:
    # GGUF stores float32, so 1e-5 reads back as 9.9999997e-06: keep the shortest decimal for that float32.
    return float(str(np.float32(x)))


def _rope_scaling(reader: Any, arch: str = "llama") -> dict[str, Any] | None:
    kind = metadata_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(metadata_value(reader, f"{arch}.rope.scaling.factor"))}
    raise GGUFImportError(f"RoPE scaling {kind!r} is not supported; supported: ['none', 'linear']")


def hf_config(
    hp: LlamaHParams, vocab: GGUFVocab, *, vocab_size: int, tied: bool, packed: bool
) -> dict[str, Any]:
    """The `config.json` of architecture `hp.arch` (with `packed`, an MLX 4-bit checkpoint's)."""
    architecture, model_type = ARCHITECTURES[hp.arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hp.hidden,
        "intermediate_size": hp.ffn,
        "num_hidden_layers": hp.n_layers,
        "num_attention_heads": hp.n_heads,
        "num_key_value_heads": hp.n_kv_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hp.rms_eps,
        "rope_theta": hp.rope_theta,
        "rope_scaling": hp.rope_scaling,
        "max_position_embeddings": hp.context,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": vocab.bos_id,
        "eos_token_id": vocab.eos_id,
        "pad_token_id": vocab.pad_id,
        "torch_dtype": "bfloat16",
    }
    if hp.experts:
        config |= {
            "num_experts": hp.experts,
            "num_experts_per_tok": hp.experts_used,
            "moe_intermediate_size": hp.expert_ffn,
            "norm_topk_prob": hp.expert_weights_norm,
        }
    if hp.rope_dim is not None:
        config["partial_rotary_factor"] = hp.rope_dim / hp.head_dim
    if hp.sliding_window is not None:
        config["sliding_window"] = hp.sliding_window
    if hp.extra:  # an architecture of its own (gemma3): its keys, its activation
        del config["hidden_act"]
        config |= hp.extra
    if packed:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4}
    return config


def generation_config(vocab: GGUFVocab) -> dict[str, Any]:
    """The `generation_config.json`: the vocabulary's BOS, EOS (one id or several) and pad ids."""
    eos = [i for i in (vocab.eos_id, *vocab.extra_eos_ids) if i is not None]
    return {
        "bos_token_id": vocab.bos_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "pad_token_id": vocab.pad_id,
    }
