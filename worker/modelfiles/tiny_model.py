"""Tiny random-weight checkpoints in Hugging Face layout, for tests, demos and benchmarks.

No model can be downloaded on the machines this project is tested on, so tests (and benchmarks on a
bare GPU host) write their own: `config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json` and `generation_config.json`, exactly as `transformers` would. The loader that
reads them is the real one. Only numpy, safetensors and tokenizers are used here (no mlx, no torch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A little English, code, CJK and emoji so byte-level BPE learns merges that split multi-byte characters.
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A quick brown fox jumps over the lazy dog while the cat sleeps.",
    "def add(a, b):\n    return a + b\n",
    "Queues hold jobs; workers take jobs from queues and write results.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 🙂 🚀 🎉 👍🏽 — and accents: café, naïve, résumé.",
    "Question: which is larger, 3 or 7? Answer: 7.",
    "user\nassistant\nsystem\nHello! How can I help you today?",
]

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}


def build_tokenizer(out_dir: str | Path, vocab_size: int = 384) -> int:
    """Train a small byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json.

    Returns the tokenizer's vocabulary size (the model's embedding must be at least that large).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "unk_token": None,
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 512,
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return int(tok.get_vocab_size())


def _llama_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h = cfg["hidden_size"]
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_heads)
    head_dim = cfg.get("head_dim") or h // n_heads
    inter = cfg["intermediate_size"]
    vocab = cfg["vocab_size"]
    arch = cfg["architectures"][0]
    bias = cfg.get("attention_bias", False) or arch == "Qwen2ForCausalLM"
    gemma = arch == "Gemma3ForCausalLM"
    qk_norm = gemma or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    expert_width = (cfg.get("moe_intermediate_size") if arch != "MixtralForCausalLM" else None) or inter
    ff = "block_sparse_moe" if arch == "MixtralForCausalLM" else "mlp"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if gemma:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (n_heads * head_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (n_kv * head_dim, h)
        shapes[p + "self_attn.v_proj.weight"] = (n_kv * head_dim, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, n_heads * head_dim)
        if bias:
            shapes[p + "self_attn.q_proj.bias"] = (n_heads * head_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (n_kv * head_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (n_kv * head_dim,)
        if qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        if experts:  # every layer sparse, experts stacked as mlx-community stores them
            shapes[p + f"{ff}.gate.weight"] = (experts, h)
            shapes[p + f"{ff}.switch_mlp.gate_proj.weight"] = (experts, expert_width, h)
            shapes[p + f"{ff}.switch_mlp.up_proj.weight"] = (experts, expert_width, h)
            shapes[p + f"{ff}.switch_mlp.down_proj.weight"] = (experts, h, expert_width)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def write_random_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    dtype: str = "float32",
    std: float = 0.08,
) -> Path:
    """Write a random-weight Llama-family checkpoint (with a tiny trained tokenizer) to `out_dir`.

    `config` overrides keys of `TINY_LLAMA_CONFIG`; `vocab_size` defaults to the tokenizer's size. A
    config with experts (`num_experts` or `num_local_experts`; Qwen3-MoE or Mixtral) gets every layer
    sparse, its experts stacked; a Gemma 3 one (`Gemma3ForCausalLM`) gets Gemma's norms and q/k norms.
    Norm weights scale by about one (ones-plus-noise; Gemma's, stored as offsets from one, noise) so
    activations stay in a sensible
    range. Tensors are drawn and written one at a time (a benchmark's 30B-parameter MoE never sits in
    memory whole); stacked experts, most of such a model, are drawn in float32, the rest as always.
    """
    out = Path(out_dir)
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_SAFETENSORS_DTYPES)}")
    cfg = prepare_checkpoint_folder(out, config, dtype)
    rng = np.random.default_rng(seed)
    shapes = _llama_shapes(cfg)
    gemma = cfg["architectures"][0] == "Gemma3ForCausalLM"  # its RMSNorm scales by 1 + weight

    def draw() -> Iterator[np.ndarray]:
        for name, shape in shapes.items():
            w: np.ndarray
            if name.endswith("norm.weight"):
                w = (0.0 if gemma else 1.0) + 0.1 * rng.standard_normal(shape)
            elif ".switch_mlp." in name:
                w = std * rng.standard_normal(shape, dtype=np.float32)
            else:
                w = std * rng.standard_normal(shape)
            yield _encoded(w.astype(np.float32), dtype)

    _write_safetensors(out / "model.safetensors", shapes, _SAFETENSORS_DTYPES[dtype], draw())
    finish_checkpoint_folder(out, cfg)
    return out


def prepare_checkpoint_folder(out: Path, config: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """`out` with the tiny tokenizer written, and the full config a random checkpoint of `config` has
    (`TINY_LLAMA_CONFIG` under `config`'s keys; the vocabulary at least the tokenizer's)."""
    out.mkdir(parents=True, exist_ok=True)
    n_vocab = build_tokenizer(out)
    cfg = {**TINY_LLAMA_CONFIG, **(config or {})}
    cfg.setdefault("vocab_size", n_vocab)
    if cfg["vocab_size"] < n_vocab:
        raise ValueError(f"vocab_size {cfg['vocab_size']} is smaller than the tokenizer's {n_vocab}")
    cfg["torch_dtype"] = dtype
    return cfg


def finish_checkpoint_folder(out: Path, cfg: dict[str, Any]) -> None:
    """`config.json` (with the tokenizer's end-of-turn id) and `generation_config.json`, written last."""
    eos = _token_id(out, "<|im_end|>")
    (out / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [eos, _token_id(out, "<|endoftext|>")]})
    )


def checkpoint_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a random checkpoint of full config `cfg`, in the order it is written."""
    return _llama_shapes(cfg)


def _token_id(out: Path, token: str) -> int:
    vocab = json.loads((out / "tokenizer.json").read_text())
    for added in vocab["added_tokens"]:
        if added["content"] == token:
            return int(added["id"])
    raise KeyError(token)


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _encoded(w: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `w` as stored: float32, float16, or bfloat16 bits (round to nearest even) as uint16."""
    if dtype == "float32":
        return w
    if dtype == "float16":
        return w.astype(np.float16)
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _write_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], kind: str, blobs: Iterator[np.ndarray]
) -> None:
    """A safetensors file whose header (every tensor of `kind`, in order) is written first, then each
    tensor as `blobs` yields it: memory holds one tensor at a time."""
    size = {"F32": 4, "F16": 2, "BF16": 2}[kind]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n = size * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for blob in blobs:
            f.write(np.ascontiguousarray(blob).tobytes())
