"""The checkpoints benchmarks run on: random-weight ones of a named shape, or the real SmolLM2-135M."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlxq.worker.modelfiles.tiny_model import (
    checkpoint_shapes,
    finish_checkpoint_folder,
    prepare_checkpoint_folder,
    write_random_checkpoint,
)

# Small enough for a CPU with a reference BLAS; long context so 8k-token prefixes fit.
TINY: dict[str, Any] = {"max_position_embeddings": 16384}

# The tiny body with SmolLM2's 49,152-token vocabulary: a small model whose LM head is the large part, as
# the prompt-logprobs figure needs (a [T, vocab] float32 block of an 8k prompt is 1.5 GiB).
TINY_WIDE_VOCAB: dict[str, Any] = {**TINY, "vocab_size": 49152}

LLAMA_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
}

# Llama-3.1-8B's shape (~16 GB in bfloat16): drawn on the device (`DRAWN`), as numpy would take minutes.
LLAMA_8B: dict[str, Any] = {
    **LLAMA_1B,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "tie_word_embeddings": False,
}

# Qwen3-30B-A3B's shape: 48 layers of 128 experts (8 per token, 768 wide), every layer sparse; ~61 GB in
# bfloat16, its experts stacked as mlx-community stores them (which mlx-lm reads as they are).
QWEN3_MOE_30B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
}
# The same layout at the tiny size, for a CPU run: 7 experts, 3 per token.
TINY_MOE: dict[str, Any] = {
    **TINY,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 7,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,  # mlx-lm's Qwen3-MoE needs these three written out
    "mlp_only_layers": [],
    "head_dim": 16,
}

# Gemma 3 4B's language model (as transformers 4 writes its config, which mlx-lm's gemma3_text reads):
# 34 layers, every sixth global, the others over a 1024-token window; head_dim 256, tied embeddings.
GEMMA3_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 2560,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "intermediate_size": 10240,
    "vocab_size": 262208,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
}

# A DeepSeek-V3-layout model with one multi-token-prediction layer (issue 31's MTP figures): Moonlight-
# 16B-A3B's layer shapes (a DeepseekV3ForCausalLM mlx-community ships: MLA with a q LoRA, 64 routed
# experts, 6 a token, 2 shared, the first layer dense) at 12 of its 27 layers, with DeepSeek-V3's
# vocabulary and q LoRA rank; ~7.4B parameters, ~15 GB in bfloat16. Random weights: its MTP layer's
# drafts are almost never kept, so it measures what MTP drafting costs, not what trained weights gain.
DEEPSEEK_V3_MTP: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "rope_theta": 50000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
}
# The same layout at the tiny size, for a CPU run (its MTP layer included).
TINY_DEEPSEEK_MTP: dict[str, Any] = {
    **TINY,
    **{k: DEEPSEEK_V3_MTP[k] for k in ("architectures", "model_type", "n_group", "topk_group")},
    "num_key_value_heads": 4,
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 10,
    "num_nextn_predict_layers": 1,
}

SHAPES = {
    "tiny": (TINY, "float32"),
    "tiny-wide-vocab": (TINY_WIDE_VOCAB, "float32"),
    "llama-1b": (LLAMA_1B, "bfloat16"),
    "llama-8b": (LLAMA_8B, "bfloat16"),
    "tiny-moe": (TINY_MOE, "float32"),
    "qwen3-moe-30b": (QWEN3_MOE_30B, "bfloat16"),
    "gemma3-4b": (GEMMA3_4B, "bfloat16"),
    "tiny-deepseek-mtp": (TINY_DEEPSEEK_MTP, "float32"),
    "deepseek-v3-mtp": (DEEPSEEK_V3_MTP, "bfloat16"),
}
# Shapes drawn with MLX from the model the config builds (`draw_checkpoint`; their MTP layer included),
# on the device where there is one: those `write_random_checkpoint` (the Llama family's tensors) does
# not write, and those too large to draw with numpy in a device call's time.
DRAWN = {"tiny-deepseek-mtp", "deepseek-v3-mtp", "llama-8b"}
# MLX-quantized (affine, group 64) from a random checkpoint of a shape above, by `loader.save_quantized`
# (stacked experts quantized too, as mlx-community's 4-bit MoE folders are).
QUANTIZED = {
    "llama-1b-4bit": ("llama-1b", 4),
    "llama-1b-8bit": ("llama-1b", 8),
    "tiny-4bit": ("tiny", 4),
    "qwen3-moe-30b-4bit": ("qwen3-moe-30b", 4),
    "gemma3-4b-4bit": ("gemma3-4b", 4),
}
# Those drawn and quantized tensor by tensor on the device instead: their source in bf16 would not fit
# the GPU host's disk beside them (the 30B MoE: 61 GB against 17).
DRAWN_QUANTIZED = {"qwen3-moe-30b-4bit"}


def checkpoint(name: str, cache_dir: Path) -> Path:
    """Folder of checkpoint `name`: `tiny`, `llama-1b` (random weights, written once into `cache_dir`),
    one of those quantized (`QUANTIZED`), `smollm2` (the real model, imported by
    `worker.modelfiles.default_model`), or a path."""
    if name == "smollm2":
        from mlxq.worker.modelfiles.default_model import (
            default_model_dir,  # not there yet: the caller skips it
        )

        return Path(default_model_dir())
    if name in QUANTIZED:
        return _quantized(name, cache_dir)
    if name not in SHAPES:
        path = Path(name)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{name!r} is neither a known shape ({', '.join([*SHAPES, *QUANTIZED])}) nor a model folder"
            )
        return path
    config, dtype = SHAPES[name]
    out = cache_dir / name
    done = out / "bench-config.json"
    wanted = json.dumps({"config": config, "dtype": dtype}, sort_keys=True)
    if not (done.is_file() and done.read_text() == wanted):
        if name in DRAWN:
            draw_checkpoint(out, config, dtype)
        else:
            write_random_checkpoint(out, config, dtype=dtype, std=0.02)
        done.write_text(wanted)
    return out


def _quantized(name: str, cache_dir: Path) -> Path:
    from mlxq.worker.engine.models.loader import load_config, load_model, save_quantized  # imports MLX

    source_name, bits = QUANTIZED[name]
    if name in DRAWN_QUANTIZED:
        config, dtype = SHAPES[source_name]
        return draw_quantized(cache_dir / name, config, dtype, bits)
    source = checkpoint(source_name, cache_dir)
    out = cache_dir / name
    done = out / "bench-config.json"
    wanted = (source / "bench-config.json").read_text() + f" bits={bits}"
    if not (done.is_file() and done.read_text() == wanted):
        model, _ = load_model(source)
        save_quantized(model, load_config(source), out, bits=bits, copy_from=source)
        done.write_text(wanted)
    return out


def draw_quantized(
    out: Path, config: dict[str, Any], dtype: str, bits: int, group_size: int = 64, std: float = 0.02
) -> Path:
    """A random checkpoint of `config` written as `_quantized` writes one (the same tensors, quantized
    where `loader.save_quantized` would: every matrix whose input size divides by `group_size`), but each
    tensor drawn on the device and quantized at once, so the unquantized model never exists."""
    import mlx.core as mx  # imports MLX only here: the other checkpoints are written without it

    done = out / "bench-config.json"
    wanted = json.dumps({"config": config, "dtype": dtype, "bits": bits, "drawn": True}, sort_keys=True)
    if done.is_file() and done.read_text() == wanted:
        return out
    cfg = prepare_checkpoint_folder(out, config, dtype)
    weights: dict[str, mx.array] = {}
    for tensor, w in _drawn(cfg, checkpoint_shapes(cfg), dtype, std):
        shape = w.shape
        if len(shape) >= 2 and shape[-1] % group_size == 0:
            stem = tensor.removesuffix(".weight")
            q, scales, biases = mx.quantize(w, group_size, bits)
            parts = {f"{stem}.weight": q, f"{stem}.scales": scales, f"{stem}.biases": biases}
        else:
            parts = {tensor: w}
        mx.eval(list(parts.values()))
        weights.update(parts)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    quant = {"group_size": group_size, "bits": bits}
    finish_checkpoint_folder(out, {**cfg, "quantization": quant, "quantization_config": quant})
    done.write_text(wanted)
    return out


def model_tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of full config `cfg`'s checkpoint by the model mlxq builds from it (its parameter
    names are the checkpoint's), and, for `num_nextn_predict_layers`, the MTP layer's as DeepSeek-V3
    stores it (`model.layers.<N>.*`). Built lazily: no weight is drawn here."""
    from mlx.utils import tree_flatten

    from mlxq.worker.engine.models import build_model
    from mlxq.worker.engine.speculation.mtp import MtpLayer

    model = build_model(cfg)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    if int(cfg.get("num_nextn_predict_layers") or 0):
        prefix = f"model.layers.{cfg['num_hidden_layers']}."
        layer = MtpLayer(model.args)  # type: ignore[arg-type]  # a DeepSeek-V3 model's args
        for k, v in tree_flatten(layer.parameters()):
            shapes[prefix + k.removeprefix("block.")] = tuple(v.shape)
    return shapes


def draw_checkpoint(out: Path, config: dict[str, Any], dtype: str, std: float = 0.02) -> Path:
    """A random checkpoint of `config` in `dtype`, its tensors (`model_tensor_shapes`) drawn with MLX
    (on the device where there is one): norms about one, the rest normal with `std`."""
    import mlx.core as mx

    cfg = prepare_checkpoint_folder(out, config, dtype)
    weights: dict[str, mx.array] = {}
    for tensor, w in _drawn(cfg, model_tensor_shapes(cfg), dtype, std):
        mx.eval(w)
        weights[tensor] = w
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    finish_checkpoint_folder(out, cfg)
    return out


def _drawn(
    cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]], dtype: str, std: float
) -> Iterator[tuple[str, Any]]:
    """Each tensor of `shapes` drawn with MLX in `dtype`, one key each from one seed: norms about one
    (Gemma's, stored as offsets from one, about zero), the rest normal with `std`; not evaluated."""
    import mlx.core as mx

    key = mx.random.key(0)
    norm_one = 0.0 if cfg["architectures"][0] == "Gemma3ForCausalLM" else 1.0
    for tensor, shape in shapes.items():
        key, draw = mx.random.split(key)
        if tensor.endswith("norm.weight"):
            w = norm_one + 0.1 * mx.random.normal(shape, key=draw)
        else:
            w = std * mx.random.normal(shape, key=draw)
        yield tensor, w.astype(mx.bfloat16 if dtype == "bfloat16" else mx.float32)
