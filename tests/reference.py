"""Reference checkpoints built by transformers itself, and the reference outputs to compare against.

`make_hf_checkpoint(dir, arch, **config)` writes a complete tiny random-weight folder (config.json,
safetensors, generation_config.json, tokenizer) through `save_pretrained`, so loader tests read exactly
what real checkpoints look like. `config_style="v4"` rewrites config.json the way transformers 4 wrote
it (`rope_theta` / `rope_scaling`, `torch_dtype`, no derived `head_dim`).

Importing this module imports torch and transformers; do it only in tests that need them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from mlxq.worker.modelfiles.tiny_model import build_tokenizer

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)

# Where a causal LM's config class is not named after it (Gemma 3's text model).
CONFIGS = {"Gemma3ForCausalLM": "Gemma3TextConfig"}

# Small enough for a slow CPU, big enough for GQA (4 query heads on 2 KV heads) and two layers.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


# A tiny DeepSeek-V3's experts: 6 routed in 3 groups (2 groups kept, 2 experts a token), 1 shared, the
# first layer dense. Tests add its attention's widths (MLA's latent and RoPE key) to their needs.
DEEPSEEK_V3_ROUTING = {
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_group": 3,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
}


def make_hf_checkpoint(
    out_dir: str | Path,
    arch: str = "LlamaForCausalLM",
    *,
    dtype: str = "float32",
    config_style: str = "v5",
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny random `arch` checkpoint with transformers' `save_pretrained`; return the folder.

    `overrides` are config keys (e.g. `tie_word_embeddings=True`, `head_dim=32`, `rope_parameters=...`);
    `vocab_size` defaults to the tokenizer's. `dtype` is the stored dtype ("float32" | "bfloat16").
    """
    out = Path(out_dir)
    n_vocab = build_tokenizer(out)
    config_cls = getattr(transformers, CONFIGS.get(arch, arch.replace("ForCausalLM", "Config")))
    eos = _special_id(out, "<|im_end|>")
    settings = {**TINY, "vocab_size": n_vocab, "bos_token_id": None, "eos_token_id": eos, "pad_token_id": 0}
    if arch == "MistralForCausalLM":
        settings["sliding_window"] = None
    config = config_cls(**{**settings, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    randomize(model)
    model.to(getattr(torch, dtype)).save_pretrained(out, max_shard_size=max_shard_size or "2GB")
    if config_style == "v4":
        _rewrite_as_v4(out / "config.json")
    elif config_style != "v5":
        raise ValueError(f"config_style {config_style!r} is not 'v4' or 'v5'")
    return out


def randomize(model: torch.nn.Module, std: float = 0.2) -> None:
    """Weights ~N(0, std), biases too (transformers zeroes them), norms 1 ± 0.1: every parameter matters.

    std 0.2 makes greedy decoding wander over many tokens instead of repeating one.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))


def _rewrite_as_v4(path: Path) -> None:
    cfg = json.loads(path.read_text())
    if cfg["model_type"] == "gemma3_text":
        _gemma3_rope_as_v4(cfg)
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    partial = rope.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        cfg["partial_rotary_factor"] = partial  # transformers 4 kept it beside the scaling
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    derived = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg["model_type"] not in ("qwen3", "qwen3_moe", "gemma3_text") and cfg.get("head_dim") == derived:
        del cfg["head_dim"]  # older configs derive it; Qwen3 always writes it (its default is 128)
    if cfg["model_type"] == "qwen3_moe" and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")  # transformers 4's name for Qwen3-MoE
    cfg["transformers_version"] = "4.45.0"
    path.write_text(json.dumps(cfg, indent=2))


def _gemma3_rope_as_v4(cfg: dict[str, Any]) -> None:
    """Gemma 3 as transformers 4 wrote it: the global layers' RoPE as the model's, the local layers'
    base as `rope_local_base_freq`, and `sliding_window_pattern` (every n-th layer global) in place of
    `layer_types` (which must follow such a pattern)."""
    per_type = cfg.pop("rope_parameters")
    cfg["rope_parameters"] = per_type["full_attention"]
    cfg["rope_local_base_freq"] = per_type["sliding_attention"]["rope_theta"]
    types = cfg.pop("layer_types")
    every = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    pattern = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(len(types))]
    if types != pattern:
        raise ValueError(f"layer_types {types} follow no sliding_window_pattern")
    cfg["sliding_window_pattern"] = every
    cfg.pop("_sliding_window_pattern", None)


def _special_id(folder: Path, token: str) -> int:
    tok = json.loads((folder / "tokenizer.json").read_text())
    return next(int(t["id"]) for t in tok["added_tokens"] if t["content"] == token)


def load_hf_model(path: str | Path) -> torch.nn.Module:
    """The checkpoint loaded by transformers in float32, eval mode (the reference)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """Reference logits (L, vocab) for one prompt."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens from transformers' `generate`, never stopping at an end-of-sequence token."""
    model.generation_config.eos_token_id = None  # stop only at n, like the caller's own loop
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return [int(t) for t in out[0, len(ids) :]]


def prompt_ids(
    folder: str | Path, text: str = "The capital of France is Paris. A quick brown fox"
) -> list[int]:
    """Token ids of `text` under the folder's tokenizer."""
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(Path(folder) / "tokenizer.json")).encode(text).ids)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b|: error relative to the reference's scale."""
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())
