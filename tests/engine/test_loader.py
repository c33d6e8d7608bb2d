"""Loading checkpoints: shards, MLX quantization, dtype policy, and the errors a person would hit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference import hf_logits, load_hf_model, make_hf_checkpoint, prompt_ids, rel_err
from safetensors.numpy import load_file, save_file

from mlxq.worker.engine.errors import CheckpointError, ModelNotFound, UnsupportedArchitecture, WorkerError
from mlxq.worker.engine.models import build_model
from mlxq.worker.engine.models.loader import (
    default_dtype,
    load_model,
    parse_dtype,
    resolve_model_path,
    save_quantized,
)
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint


def logits_of(model: Any, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids], dtype=mx.int32))[0].astype(mx.float32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint written without torch, for the error cases (copied before being broken)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"))


def broken_copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --- shards and dtypes -------------------------------------------------------------------------------


def test_sharded_checkpoint(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "Qwen2ForCausalLM", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    model, config = load_model(folder)
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    ids = prompt_ids(folder)
    assert rel_err(logits_of(model, ids), hf_logits(load_hf_model(folder), ids)) < 1e-4


def test_bf16_checkpoint_cast_policy(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "LlamaForCausalLM", dtype="bfloat16")
    config = json.loads((folder / "config.json").read_text())
    assert default_dtype(config, mx.cpu) == mx.float32  # CPU: exact and no slower
    assert default_dtype(config, mx.gpu) == mx.bfloat16  # GPU: the checkpoint's own
    assert default_dtype({"torch_dtype": "float16"}, mx.gpu) == mx.float16
    model, _ = load_model(folder)  # this host is CPU: float32
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    ids = prompt_ids(folder)
    assert rel_err(logits_of(model, ids), hf_logits(load_hf_model(folder), ids)) < 1e-4
    half, _ = load_model(folder, dtype="bfloat16")
    assert {v.dtype for _, v in tree_flatten(half.parameters())} == {mx.bfloat16}
    assert rel_err(logits_of(half, ids), logits_of(model, ids)) < 0.05


def test_parse_dtype_rejects_unknown() -> None:
    assert parse_dtype("float16") == mx.float16
    with pytest.raises(ValueError, match="'fp8'"):
        parse_dtype("fp8")


# --- MLX quantization ------------------------------------------------------------------------------------


def dequantized_copy(model: Any, config: dict[str, Any]) -> Any:
    """The same network with every quantized layer's weight dequantized back to a plain float layer."""
    plain = build_model(config)
    weights = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
            weights[f"{path}.weight"] = w
            if "bias" in module:
                weights[f"{path}.bias"] = module.bias
        elif isinstance(module, nn.RMSNorm):
            weights[f"{path}.weight"] = module.weight
    plain.load_weights(list(weights.items()), strict=True)
    return plain


@pytest.mark.parametrize(("bits", "tied"), [(4, True), (8, False)])
def test_quantized_round_trip(tmp_path: Path, bits: int, tied: bool) -> None:
    src = make_hf_checkpoint(tmp_path / "src", "Qwen2ForCausalLM", tie_word_embeddings=tied)
    original, config = load_model(src)
    ids = prompt_ids(src)
    float_logits = logits_of(original, ids)
    out = save_quantized(original, config, tmp_path / "q", bits=bits, group_size=32, copy_from=src)
    assert (out / "tokenizer.json").is_file()
    model, qconfig = load_model(out)
    assert qconfig["quantization"] == {"group_size": 32, "bits": bits}
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.uint32  # packed, not dequantized
    if not tied:
        assert isinstance(model.lm_head, nn.QuantizedLinear)
    quant_logits = logits_of(model, ids)
    assert rel_err(quant_logits, logits_of(dequantized_copy(model, qconfig), ids)) < 1e-4
    model.fuse()  # as the engine does: q/k/v and gate/up each one quantized layer, the same products
    fused = (model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj)
    assert all(type(f) is nn.QuantizedLinear for f in fused) and "q_proj" not in model.layers[0].self_attn
    assert np.array_equal(logits_of(model, ids), quant_logits)
    # Against the float model only a sanity bound: this random model is chaotic, errors compound.
    corr = np.corrcoef(quant_logits.ravel(), float_logits.ravel())[0, 1]
    assert corr > (0.8 if bits == 4 else 0.99)


# --- errors --------------------------------------------------------------------------------------------


def test_unsupported_architecture(tiny: Path, tmp_path: Path) -> None:
    folder = broken_copy(tiny, tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel") as e:
        load_model(folder)
    assert "LlamaForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)
    assert "MixtralForCausalLM" in str(e.value) and "Qwen3MoeForCausalLM" in str(e.value)
    assert "Phi3ForCausalLM" in str(e.value) and "DeepseekV3ForCausalLM" in str(e.value)
    assert "Gemma3ForCausalLM" in str(e.value) and "Gemma3ForConditionalGeneration" in str(e.value)
    assert isinstance(e.value, WorkerError)


def test_unsupported_rope_type(tiny: Path, tmp_path: Path) -> None:
    folder = broken_copy(tiny, tmp_path / "dynamic")
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match=r"rope_type 'dynamic'.*longrope, yarn"):
        load_model(folder)


def test_missing_unexpected_and_misshaped_keys(tiny: Path, tmp_path: Path) -> None:
    folder = broken_copy(tiny, tmp_path / "broken")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
    tensors["model.norm.weight"] = np.ones(7, np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    message = str(e.value)
    assert "1 missing keys: model.layers.1.mlp.up_proj.weight" in message
    assert "1 unexpected keys: model.layers.0.self_attn.extra.weight" in message
    assert "model.norm.weight (7,) != (64,)" in message


def test_missing_files(tiny: Path, tmp_path: Path) -> None:
    no_weights = broken_copy(tiny, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_model(no_weights)
    (no_weights / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_model(no_weights)


def test_resolve_local_folder(tiny: Path) -> None:
    assert resolve_model_path(str(tiny)) == tiny


def test_missing_local_path_is_model_not_found(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ModelNotFound, match="neither a local folder nor fetchable") as e:
        resolve_model_path(missing)
    assert missing in str(e.value)


def test_repo_id_offline_is_model_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)  # so "mlxq-test/no-such-model" cannot be a relative folder
    with pytest.raises(ModelNotFound, match="'mlxq-test/no-such-model'") as e:
        resolve_model_path("mlxq-test/no-such-model")
    assert "HF_HUB_OFFLINE" in str(e.value)
