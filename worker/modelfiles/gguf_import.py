"""Import a GGUF file (llama, qwen2, qwen3, qwen3moe, phi3 or gemma3 architecture) as a Hugging Face-layout
folder.

Writes `config.json`, `model.safetensors` (Hugging Face tensor names), `tokenizer.json`,
`tokenizer_config.json` and `generation_config.json`. Weights become bfloat16, except that Q4_0/Q4_1
weights can stay 4-bit as an MLX affine-quantized checkpoint (group size 32): both GGUF formats are
exactly `w = scale * q + bias` with one float16 scale and bias per 32 weights, so nothing is lost.
Tensors are converted one at a time and streamed to disk, so memory stays near one tensor's size.

Names map to the architecture's Hugging Face (or, for stacked experts, mlx-community) names; only llama
files have their Q/K rows reordered (llama.cpp's converter permutes them for llama alone). Phi-3's
fused projections and Qwen3-MoE's stacked experts stay as they are: the models read them so. Gemma 3's
norms are stored by llama.cpp's converter with Gemma's +1 folded in (the RMSNorm scales by 1 + weight):
it is taken out again; what the GGUF file does not store of Gemma 3 (the local layers' RoPE base, the
every-sixth-layer-global pattern, the attention scale) is derived as llama.cpp derives it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxq.worker.engine.errors import WorkerError
from mlxq.worker.modelfiles.gguf_tokenizer import (
    GGUFVocab,
    UnsupportedTokenizer,
    build_tokenizer,
    metadata_value,
    read_vocab,
    write_tokenizer,
)

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # both the Q4_0/Q4_1 block size and the MLX group size written
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
_Q4_TYPES = ("Q4_0", "Q4_1")

# GGUF architecture -> (Hugging Face architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
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
# llama.cpp's fixed Gemma 3 values where the file stores none (its model loader's own constants)
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_WINDOW_PATTERN = 6  # every sixth layer global
GEMMA3_27B_LAYERS = 62  # scaled by hidden / heads, not head_dim (llama.cpp tells the 27B by its depth)


class GGUFImportError(WorkerError, ValueError):
    """The GGUF file cannot be imported; the message names the architecture, tensor or type at fault."""


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


@dataclass(frozen=True)
class _Planned:
    """One GGUF tensor and what it becomes."""

    source: Any  # gguf.ReaderTensor
    hf_name: str  # e.g. model.layers.0.self_attn.q_proj.weight
    shape: tuple[int, ...]  # logical (rows, cols), Hugging Face order
    unpermute_heads: int | None  # Q/K rows: number of heads to undo GGUF's RoPE row order with
    packed: bool  # kept as MLX 4-bit
    shift: float = 0.0  # subtracted from the values (Gemma 3's norms: llama.cpp stores 1 + weight)


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, quantize: bool | None = None) -> Path:
    """Convert a llama GGUF file into a Hugging Face-layout folder at `out_dir` and return its path.

    `quantize=None` keeps Q4_0/Q4_1 weights as an MLX 4-bit checkpoint when every layer's linear
    weight is Q4_0/Q4_1, else writes bfloat16; `True` demands the 4-bit checkpoint; `False` always
    writes bfloat16. Raises `GGUFImportError` for an unsupported architecture, tensor, type or tokenizer.
    """
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError as e:
        raise GGUFImportError(
            "reading a GGUF file needs the gguf package: pip install gguf (mlxq's `gguf` extra)"
        ) from e

    reader = GGUFReader(str(gguf_path))
    hp = read_hparams(reader)
    vocab = read_vocab(reader)
    plan = _plan(reader.tensors, hp, quantize)
    try:
        tokenizer = build_tokenizer(vocab)
    except UnsupportedTokenizer as e:
        raise GGUFImportError(str(e)) from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(tokenizer, vocab, out, hp.context)
    embed = next(p for p in plan if p.hf_name == "model.embed_tokens.weight")
    tied = not any(p.hf_name == "lm_head.weight" for p in plan)
    packed = any(p.packed for p in plan)
    config = _hf_config(hp, vocab, vocab_size=embed.shape[0], tied=tied, packed=packed)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(_generation_config(vocab), indent=2))
    _write_safetensors(out / "model.safetensors", _header_entries(plan), _tensor_blobs(plan))
    logger.info("gguf imported path=%s out=%s tensors=%d packed=%s", gguf_path, out, len(plan), packed)
    return out


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


def _hf_config(
    hp: LlamaHParams, vocab: GGUFVocab, *, vocab_size: int, tied: bool, packed: bool
) -> dict[str, Any]:
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


def _generation_config(vocab: GGUFVocab) -> dict[str, Any]:
    eos = [i for i in (vocab.eos_id, *vocab.extra_eos_ids) if i is not None]
    return {
        "bos_token_id": vocab.bos_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "pad_token_id": vocab.pad_id,
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


def unpermute_qk(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows (d/2, 2) interleaved back to HF's (2, d/2) halves.

    Works on any array whose first axis is the output rows (float weights, packed 4-bit codes, scales).
    """
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _plan(tensors: list[Any], hp: LlamaHParams, quantize: bool | None) -> list[_Planned]:
    named = [(t, hf_tensor_name(t.name, hp.arch)) for t in tensors]
    for t, _ in named:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            kind, known = t.tensor_type.name, list(SUPPORTED_TYPES)
            raise GGUFImportError(f"tensor {t.name!r} has type {kind}, not supported; supported: {known}")
    if not any(name == "model.embed_tokens.weight" for _, name in named):
        raise GGUFImportError("the GGUF file has no token_embd.weight")
    layer_linear = [t for t, name in named if name.startswith("model.layers.") and _is_linear(name, t)]
    all_q4 = bool(layer_linear) and all(t.tensor_type.name in _Q4_TYPES for t in layer_linear)
    if quantize and not all_q4:
        bad = next((t for t in layer_linear if t.tensor_type.name not in _Q4_TYPES), None)
        found = f"{bad.name} is {bad.tensor_type.name}" if bad is not None else "no layer weights"
        raise GGUFImportError(f"quantize=True needs Q4_0/Q4_1 layer weights, but {found}")
    pack = all_q4 and quantize is not False
    # llama.cpp's converter reorders Q/K rows for llama only (the others use NeoX-style RoPE, as HF does)
    heads = {".q_proj.": hp.n_heads, ".k_proj.": hp.n_kv_heads} if hp.arch == "llama" else {}
    plan = []
    for t, name in named:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        packed = pack and t.tensor_type.name in _Q4_TYPES and _is_linear(name, t)
        unpermute = next((n for key, n in heads.items() if key in name), None)
        shift = 1.0 if hp.arch == "gemma3" and name.endswith("norm.weight") else 0.0
        plan.append(_Planned(t, name, shape, unpermute, packed, shift))
    return plan


def _is_linear(hf_name: str, tensor: Any) -> bool:
    return hf_name.endswith(".weight") and len(tensor.shape) == 2


def _header_entries(plan: list[_Planned]) -> list[tuple[str, str, tuple[int, ...]]]:
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    for p in plan:
        if p.packed:
            rows, cols = p.shape
            base = p.hf_name.removesuffix(".weight")
            entries.append((p.hf_name, "U32", (rows, cols // 8)))
            entries.append((f"{base}.scales", "F16", (rows, cols // GROUP_SIZE)))
            entries.append((f"{base}.biases", "F16", (rows, cols // GROUP_SIZE)))
        else:
            entries.append((p.hf_name, "BF16", p.shape))
    return entries


def _tensor_blobs(plan: list[_Planned]) -> Iterator[np.ndarray]:
    from gguf.quants import dequantize

    for p in plan:
        raw = p.source.data
        if p.packed:
            arrays = list(q4_to_mlx(raw, p.source.tensor_type.name))
        else:
            values = dequantize(raw, p.source.tensor_type).reshape(p.shape)
            arrays = [values - np.float32(p.shift) if p.shift else values]
        for a in arrays:
            a = unpermute_qk(a, p.unpermute_heads) if p.unpermute_heads else a
            yield bf16_bits(a) if a.dtype == np.float32 else a
        del raw, arrays  # free this tensor before converting the next: peak memory is one tensor


def q4_to_mlx(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turn GGUF Q4_0/Q4_1 rows (uint8, blocks of 32 weights) into MLX affine 4-bit arrays.

    Returns (codes uint32 [rows, cols/8], scales float16 [rows, cols/32], biases float16 [rows, cols/32])
    such that `mx.dequantize(codes, scales, biases, group_size=32, bits=4)` gives the GGUF's weights.
    """
    block_bytes = {"Q4_0": 18, "Q4_1": 20}[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    # Q4_0: w = d * (q - 8) = d * q + (-8 d); -8 d is exact in float16 (a power-of-two scaling).
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == "Q4_1" else d * np.float16(-8)
    qs = blocks[..., -16:]
    # GGUF: byte i holds weight i (low nibble) and weight i + 16 (high nibble) of its block.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1, 8).astype(np.uint32)
    # MLX: eight codes per uint32, the first in the lowest nibble.
    packed = (codes << (np.arange(8, dtype=np.uint32) * 4)).sum(axis=-1, dtype=np.uint32)
    return packed, d, m


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the bits as uint16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(x)] = 0x7FC0
    return rounded


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "U32": 4}


def _write_safetensors(
    path: Path, entries: list[tuple[str, str, tuple[int, ...]]], blobs: Iterator[np.ndarray]
) -> None:
    """Write a safetensors file whose header is known up front, streaming the tensors in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        size = _DTYPE_BYTES[dtype] * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for (name, dtype, shape), blob in zip(entries, blobs, strict=True):
            data = np.ascontiguousarray(blob)
            if data.shape != shape or data.itemsize != _DTYPE_BYTES[dtype]:
                raise AssertionError(f"{name}: wrote {data.dtype}{data.shape}, header says {dtype}{shape}")
            f.write(data.tobytes())
