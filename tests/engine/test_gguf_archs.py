"""GGUF import of the architectures beyond llama: qwen2 (biases), qwen3 (q/k norms), qwen3moe (stacked
experts), phi3 (fused projections, partial RoPE) and gemma3 (norms stored as 1 + weight, local and
global layers). A tiny transformers checkpoint stored in bfloat16
is written as an F32 GGUF file under llama.cpp's names (no Q/K reordering: llama.cpp does that for llama
alone), imported (bfloat16 again, so nothing is rounded) and must compute what the checkpoint computes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from reference import make_hf_checkpoint, prompt_ids, rel_err
from test_gguf_import import _write_vocab

from mlxq.worker.engine.models.loader import load_model
from mlxq.worker.modelfiles.gguf_import import GGUFImportError, import_gguf

_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3: llama.cpp keeps gate and up fused under ffn_up
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
# Gemma 3's norms around attention and the feed-forward, as llama.cpp names them
_GEMMA3_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3moe": (
        "Qwen3MoeForCausalLM",
        {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
    "phi3": ("Phi3ForCausalLM", {"rope_parameters": {"partial_rotary_factor": 0.75}}),
    # what llama.cpp does not store is its fixed values here: the local RoPE base, the scale by head_dim
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
}


def _gguf_tensors(weights: dict[str, np.ndarray], n_experts: int, arch: str) -> dict[str, np.ndarray]:
    """Hugging Face tensors under llama.cpp's names; each layer's experts stacked (experts, out, in);
    Gemma 3's norms as 1 + weight, as llama.cpp's converter writes them."""
    out: dict[str, np.ndarray] = {}
    names = {**_TO_GGUF, **(_GEMMA3_NORMS if arch == "gemma3" else {})}
    for name, arr in weights.items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1.0
        base, suffix = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, i, rest = base.split(".", 3)
            if ".experts." in rest:
                *_, index, proj = rest.split(".")
                if index == "0":
                    stem = rest.rsplit(".", 2)[0]
                    stacked = [
                        weights[f"model.layers.{i}.{stem}.{e}.{proj}.{suffix}"] for e in range(n_experts)
                    ]
                    out[f"blk.{i}.{_EXPERT_TENSORS[proj]}.{suffix}"] = np.stack(stacked)
                continue
            out[f"blk.{i}.{names[rest]}.{suffix}"] = arr
        else:
            out[f"{_TO_GGUF[base]}.{suffix}"] = arr
    return out


def write_arch_gguf(path: Path, hf_dir: Path, arch: str, extra: dict[str, np.ndarray] | None = None) -> Path:
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":  # one RoPE per layer kind: the file stores the global layers'
        rope = rope["full_attention"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    n_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _write_vocab(w, json.loads((hf_dir / "tokenizer.json").read_text()), cfg, "gpt2", "gpt-2")
    weights = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    for name, arr in sorted({**_gguf_tensors(weights, n_experts, arch), **(extra or {})}.items()):
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32), raw_dtype=QT.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", sorted(CASES))
def test_import_computes_what_the_checkpoint_computes(tmp_path: Path, arch: str) -> None:
    hf_arch, overrides = CASES[arch]
    src = make_hf_checkpoint(tmp_path / "hf", hf_arch, dtype="bfloat16", **overrides)
    out = import_gguf(write_arch_gguf(tmp_path / "m.gguf", src, arch), tmp_path / "imported", quantize=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [hf_arch]
    imported, _ = load_model(out, dtype="float32")
    original, _ = load_model(src, dtype="float32")
    ids = mx.array([prompt_ids(src)], dtype=mx.int32)
    assert rel_err(np.array(imported(ids)[0]), np.array(original(ids)[0])) < 1e-6
    if arch == "qwen3moe":
        assert config["num_experts"] == 5 and config["norm_topk_prob"] is True
    if arch == "phi3":
        assert config["partial_rotary_factor"] == 0.75
    if arch == "gemma3":
        assert imported.model.windows == [6, None, 6]


def test_phi3_longrope_factors_are_refused_by_name(tmp_path: Path) -> None:
    src = make_hf_checkpoint(tmp_path / "hf", "Phi3ForCausalLM", dtype="bfloat16")
    factors = {"rope_factors_long.weight": np.ones(8, np.float32)}
    path = write_arch_gguf(tmp_path / "m.gguf", src, "phi3", extra=factors)
    with pytest.raises(GGUFImportError, match=r"rope_factors_long\.weight.*LongRoPE factors"):
        import_gguf(path, tmp_path / "imported")
