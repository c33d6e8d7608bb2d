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

The parts: `gguf_config` (metadata to `config.json` per architecture), `gguf_tensor_names` (tensor
names), `gguf_tensors` (which tensors become what, streamed to disk), `gguf_quants` (the value
conversions), `gguf_tokenizer` (the vocabulary as `tokenizer.json`); this module runs them in order.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mlxq.worker.engine.errors import GGUFImportError
from mlxq.worker.modelfiles.gguf_config import generation_config, hf_config, read_hparams
from mlxq.worker.modelfiles.gguf_tensors import plan_tensors, write_checkpoint
from mlxq.worker.modelfiles.gguf_tokenizer import (
    UnsupportedTokenizer,
    build_tokenizer,
    read_vocab,
    write_tokenizer,
)

__all__ = ["GGUFImportError", "import_gguf"]

logger = logging.getLogger(__name__)


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
    plan = plan_tensors(reader.tensors, hp, quantize)
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
    config = hf_config(hp, vocab, vocab_size=embed.shape[0], tied=tied, packed=packed)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config(vocab), indent=2))
    write_checkpoint(out / "model.safetensors", plan)
    logger.info("gguf imported path=%s out=%s tensors=%d packed=%s", gguf_path, out, len(plan), packed)
    return out
