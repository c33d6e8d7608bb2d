"""Which GGUF tensors become which checkpoint tensors (`plan_tensors`: names, types, Q/K order, 4-bit
kept or not) and their conversion, one tensor at a time, streamed into `model.safetensors`
(`write_checkpoint`), so memory stays near one tensor's size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxq.worker.engine.errors import GGUFImportError
from mlxq.worker.modelfiles.gguf_config import LlamaHParams
from mlxq.worker.modelfiles.gguf_quants import GROUP_SIZE, bf16_bits, q4_to_mlx, unpermute_qk
from mlxq.worker.modelfiles.gguf_tensor_names import hf_tensor_name

SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
_Q4_TYPES = ("Q4_0", "Q4_1")


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor and what it becomes."""

    source: Any  # gguf.ReaderTensor
    hf_name: str  # e.g. model.layers.0.self_attn.q_proj.weight
    shape: tuple[int, ...]  # logical (rows, cols), Hugging Face order
    unpermute_heads: int | None  # Q/K rows: number of heads to undo GGUF's RoPE row order with
    packed: bool  # kept as MLX 4-bit
    shift: float = 0.0  # subtracted from the values (Gemma 3's norms: llama.cpp stores 1 + weight)


def plan_tensors(tensors: list[Any], hp: LlamaHParams, quantize: bool | None) -> list[PlannedTensor]:
    """What each GGUF tensor becomes: its Hugging Face name and shape, whether it stays 4-bit (`quantize`
    as `import_gguf` takes it), its Q/K row order and value shift; an unsupported name or type raises."""
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
        plan.append(PlannedTensor(t, name, shape, unpermute, packed, shift))
    return plan


def write_checkpoint(path: Path, plan: list[PlannedTensor]) -> None:
    """Convert the planned tensors and stream them into the safetensors file at `path`."""
    _write_safetensors(path, _header_entries(plan), _tensor_blobs(plan))


def _is_linear(hf_name: str, tensor: Any) -> bool:
    return hf_name.endswith(".weight") and len(tensor.shape) == 2


def _header_entries(plan: list[PlannedTensor]) -> list[tuple[str, str, tuple[int, ...]]]:
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


def _tensor_blobs(plan: list[PlannedTensor]) -> Iterator[np.ndarray]:
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
