"""Finding and loading checkpoints in Hugging Face layout, plain or MLX-quantized.

A checkpoint folder holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). An MLX-quantized one (as mlx-lm writes it) also has
`quantization: {group_size, bits}` in its config and `<layer>.scales` / `<layer>.biases` next to packed
uint32 weights; those layers load as `nn.QuantizedLinear` / `nn.QuantizedEmbedding`, never dequantized.
An FP8 one (transformers' `quantization_config` with `quant_method: fp8`) is dequantized at load
(`fp8.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxq.worker.engine.errors import CheckpointError, ModelNotFound
from mlxq.worker.engine.models import build_model
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.fp8 import Fp8Layout
from mlxq.worker.engine.models.moe import SwitchLinear

DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

# Hub repo ids: "name" or "owner/name"; anything else (absolute, ./relative, ~) can only be a local path.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
_TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]


def resolve_model_path(name: str) -> Path:
    """A local checkpoint folder for `name`: the folder itself, or a Hub repo id downloaded (or cached).

    `HF_HUB_OFFLINE=1` restricts the Hub to its local cache. Raises `ModelNotFound` on any failure.
    """
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if local.exists() or not _REPO_ID.fullmatch(name):
        raise _not_found(name, "no such folder, and not a Hugging Face repo id")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise _not_found(
            name, "no such folder, and huggingface_hub is not installed (pip install huggingface_hub)"
        ) from e
    # huggingface_hub reads HF_HUB_OFFLINE once at import; read it here so a later change is honoured.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    # The hub raises many unrelated types (HTTP, cache, validation); to us they all mean "not found".
    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=_HUB_FILES, local_files_only=offline))
    except Exception as e:
        where = "not in the local Hub cache and HF_HUB_OFFLINE is set" if offline else "download failed"
        raise _not_found(name, f"no such folder; {where}: {type(e).__name__}: {e}") from e


def _not_found(name: str, reason: str) -> ModelNotFound:
    return ModelNotFound(
        f"model {name!r} is neither a local folder nor fetchable from the Hugging Face Hub ({reason}); "
        "pass the path of a folder holding config.json and *.safetensors, or a Hub repo id with network "
        "access (HF_HUB_OFFLINE unset) or already downloaded into the Hub cache"
    )


def load_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint folder as a dict; `CheckpointError` if missing or not JSON."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file} not found: a checkpoint folder needs config.json")
    try:
        config: dict[str, Any] = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    return config


def parse_dtype(name: str) -> mx.Dtype:
    """The MLX dtype named "float32", "bfloat16" or "float16"; `ValueError` naming anything else."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_dtype(config: dict[str, Any], device: mx.Device | None = None) -> mx.Dtype:
    """Compute dtype: float32 on CPU (exact, and no slower there); else the checkpoint's own.

    The checkpoint's is `torch_dtype` (transformers 4) or `dtype` (transformers 5); bfloat16 if neither.
    """
    device = device if device is not None else mx.default_device()
    if device == mx.cpu:
        return mx.float32
    own = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return DTYPES.get(str(own), mx.bfloat16)


def load_weights(path: str | Path) -> dict[str, mx.array]:
    """Every tensor in the folder: shards of an index json, `model.safetensors`, or all `*.safetensors`."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder}")
    weights: dict[str, mx.array] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"shard {file.name} listed in {index.name} is missing from {folder}")
        try:
            loaded = mx.load(str(file))
        except (RuntimeError, ValueError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from e
        assert isinstance(loaded, dict)
        weights.update(loaded)
    return weights


def load_model(path: str | Path, dtype: str | None = None) -> tuple[Model, dict[str, Any]]:
    """Build the config's architecture and fill it from the folder's weights; return (model, config).

    `dtype` ("float32" | "bfloat16" | "float16") overrides `default_dtype(config)`; floating weights,
    quantization scales and biases included, are cast to it. Parameters are evaluated before returning.
    """
    folder = Path(path)
    config = load_config(folder)
    target = parse_dtype(dtype) if dtype is not None else default_dtype(config)
    fp8 = Fp8Layout.from_config(config)  # refused before any weight is read where it cannot be honoured
    model = build_model(config)  # random init stays lazy: never computed, replaced below
    assert isinstance(model, nn.Module)  # every architecture is one (`models/base.py`): loaded as one
    weights = load_weights(folder)
    if fp8 is not None:
        weights = fp8.dequantize(weights, target)
    weights = model.sanitize(weights)
    quantization = config.get("quantization")
    if quantization:
        _quantize_like(model, weights, quantization)
    _check_keys(model, weights, folder)
    weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model, config


def load_module(module: nn.Module, weights: dict[str, mx.array], what: str) -> None:
    """Load `weights` into `module` (every parameter, nothing else), computed and in eval mode; a
    `CheckpointError` naming `what` (e.g. "the DFlash draft in FOLDER") where some are missing or extra."""
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{what} lacks weights it needs: {e}") from e
    mx.eval(module.parameters())
    module.eval()


def _quantize_like(model: nn.Module, weights: dict[str, mx.array], quantization: dict[str, Any]) -> None:
    """Swap in quantized layers exactly where the checkpoint has `<path>.scales` (mlx-lm's convention)."""
    group_size, bits = quantization.get("group_size"), quantization.get("bits")
    mode = quantization.get("mode", "affine")

    def predicate(path: str, _module: nn.Module) -> bool | dict[str, Any]:
        if f"{path}.scales" not in weights:
            return False
        override = quantization.get(path)  # mlx-lm's mixed-precision recipes store per-layer settings
        return dict(override) if isinstance(override, dict) else True

    # MLX annotates group_size and bits as int, though their defaults are None (its own defaults then)
    nn.quantize(model, group_size, bits, mode=mode, class_predicate=predicate)  # type: ignore[arg-type]


def _check_keys(model: nn.Module, weights: dict[str, mx.array], folder: Path) -> None:
    """`CheckpointError` naming a few missing/unexpected keys or wrong shapes, before MLX's terser check."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    wrong = [
        f"{k} {tuple(weights[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and tuple(weights[k].shape) != tuple(v.shape)
    ]
    problems = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", wrong)):
        if items:
            more = f" and {len(items) - 5} more" if len(items) > 5 else ""
            problems.append(f"{len(items)} {label}: {', '.join(items[:5])}{more}")
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not fit its config.json: " + "; ".join(problems))


def save_quantized(
    model: nn.Module,
    config: dict[str, Any],
    out_dir: str | Path,
    bits: int = 4,
    group_size: int = 64,
    copy_from: str | Path | None = None,
) -> Path:
    """Quantize `model` in place (affine) and write it as an MLX-quantized checkpoint that `load_model` reads.

    Every Linear/Embedding, and every stack of experts' Linears (`moe.SwitchLinear`, written stacked as
    mlx-community's folders hold them), whose input size divides by `group_size` is quantized.
    `copy_from` names a folder whose tokenizer and generation config files are copied alongside.
    """

    def predicate(_path: str, module: nn.Module) -> bool:
        quantizable = (nn.Linear, nn.Embedding, SwitchLinear)
        return isinstance(module, quantizable) and module.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size, bits, class_predicate=predicate)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    quant = {"group_size": group_size, "bits": bits}
    # mlx-lm writes both keys; transformers-based tools look for quantization_config.
    (out / "config.json").write_text(
        json.dumps({**config, "quantization": quant, "quantization_config": quant}, indent=2)
    )
    if copy_from is not None:
        for name in _TOKENIZER_FILES:
            if (Path(copy_from) / name).is_file():
                shutil.copy2(Path(copy_from) / name, out / name)
    return out
