"""GGUF tensor names to Hugging Face ones, per architecture (`hf_tensor_name`): llama's layer tensors,
plus or instead of some for the others (Q/K norms, stacked experts, Phi-3's fused projections, Gemma 3's
extra norms).
"""

from __future__ import annotations

from mlxq.worker.engine.errors import GGUFImportError

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
# Each architecture's layer tensors: llama's, plus or instead of some.
_ARCH_LAYER_NAMES = {
    "llama": _LAYER_NAMES,
    "qwen2": _LAYER_NAMES,
    "qwen3": {**_LAYER_NAMES, **_QK_NORMS},
    "qwen3moe": {**_LAYER_NAMES, **_QK_NORMS, **_EXPERTS},
    "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma3": {
        **_LAYER_NAMES,
        **_QK_NORMS,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of architecture `arch`.

    `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names raise.
    """
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 1 and parts[0] in _TOP_NAMES and suffix == "weight":
        return f"{_TOP_NAMES[parts[0]]}.weight"
    names = _ARCH_LAYER_NAMES[arch]
    in_layer = len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names
    if in_layer and (suffix == "weight" or (suffix == "bias" and parts[2].startswith("attn_"))):
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if base.startswith("rope_factors"):
        raise GGUFImportError(f"tensor {gguf_name!r}: LongRoPE factors in a GGUF file are not imported")
    raise GGUFImportError(f"tensor {gguf_name!r} has no {arch} equivalent (not supported)")
