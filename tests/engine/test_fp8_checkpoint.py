"""FP8 checkpoints in DeepSeek-V3's released layout (float8 e4m3 weights, one float32
`weight_scale_inv` per block): a tiny one is written here with torch, from a transformers checkpoint.
The loaded weights equal the reference dequantization exactly, the logits equal transformers' loading
the very same FP8 folder (it dequantizes too, on the CPU), and layouts the loader cannot honour are
refused naming the setting.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from reference import DEEPSEEK_V3_ROUTING, hf_logits, load_hf_model, make_hf_checkpoint, prompt_ids, rel_err
from safetensors.torch import load_file, save_file

from mlxq.worker.engine.errors import CheckpointError, UnsupportedArchitecture
from mlxq.worker.engine.models.loader import load_model

DEEPSEEK = {
    **DEEPSEEK_V3_ROUTING,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 12,
    "head_dim": 8,
    "num_key_value_heads": 4,
}
# Widths that leave partial blocks at the edges of 16 x 16 blocks, as DeepSeek-V3's own 576-row
# kv_a_proj_with_mqa leaves one of 128 x 128 (transformers' dequantization refuses them).
RAGGED = {**DEEPSEEK, "q_lora_rank": 24, "kv_lora_rank": 24, "v_head_dim": 10}
E4M3_MAX = 448.0


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, per-block scale_inv, the reference dequantization: e4m3 value x its block's scale)."""
    rows, cols = w.shape
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    padded = torch.zeros(grid[0] * bm, grid[1] * bn)
    padded[:rows, :cols] = w
    amax = padded.reshape(grid[0], bm, grid[1], bn).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:rows, :cols]
    stored = (w / full).to(torch.float8_e4m3fn)
    return stored, scale.float(), stored.float() * full


def write_fp8(src: Path, out: Path, block: tuple[int, int]) -> Path:
    """`src` with every projection of the decoder layers stored in FP8; beside it `out`-dequantized, the
    same model with the reference dequantization's float32 weights (and no quantization_config)."""
    tensors = load_file(src / "model.safetensors")
    fp8, dequantized = {}, {}
    for key, value in tensors.items():
        if key.startswith("model.layers.") and key.endswith("proj.weight") and value.ndim == 2:
            stored, scale, reference = quantize_fp8(value.float(), block)
            fp8[key], fp8[key.replace(".weight", ".weight_scale_inv")] = stored, scale
            dequantized[key] = reference
        else:
            fp8[key] = dequantized[key] = value
    assert any(v.dtype == torch.float8_e4m3fn for v in fp8.values())
    config = json.loads((src / "config.json").read_text())
    quantization = {
        "quant_method": "fp8",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
    }
    for folder, weights, extra in (
        (out, fp8, {"quantization_config": quantization}),
        (out.with_name(out.name + "-dequantized"), dequantized, {}),
    ):
        folder.mkdir()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (src / name).is_file():
                (folder / name).write_bytes((src / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("fp8-src"), "DeepseekV3ForCausalLM", **DEEPSEEK)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("block", [(16, 16), (128, 128)])
def test_fp8_weights_load_as_the_reference_dequantization(
    src: Path, tmp_path: Path, block: tuple[int, int], ragged: bool
) -> None:
    """Blocks of 16 (several per weight; whole, or partial at the edges) and DeepSeek-V3's own 128 (one,
    partial, per tiny weight): every parameter equals the float32 checkpoint of the dequantized
    weights, bit for bit."""
    if ragged:
        src = make_hf_checkpoint(tmp_path / "src", "DeepseekV3ForCausalLM", **RAGGED)
    folder = write_fp8(src, tmp_path / "fp8", block)
    ours, _ = load_model(folder, dtype="float32")
    reference, _ = load_model(tmp_path / "fp8-dequantized", dtype="float32")
    got, want = dict(tree_flatten(ours.parameters())), dict(tree_flatten(reference.parameters()))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert mx.array_equal(got[key], value).item(), key


def test_fp8_logits_match_transformers_loading_the_same_folder(src: Path, tmp_path: Path) -> None:
    folder = write_fp8(src, tmp_path / "fp8", (16, 16))
    hf = load_hf_model(folder)  # transformers dequantizes FP8 itself where no FP8-capable GPU is present
    ids = prompt_ids(folder)
    ours, _ = load_model(folder, dtype="float32")
    want = hf_logits(hf, ids)
    assert rel_err(np.array(ours(mx.array([ids], dtype=mx.int32))[0]), want) < 1e-4
    # The quantization mattered: the FP8 model is not the float32 one it was made from.
    assert rel_err(hf_logits(load_hf_model(src), ids), want) > 1e-3


def test_bfloat16_is_one_rounding_of_the_dequantized_weight(src: Path, tmp_path: Path) -> None:
    folder = write_fp8(src, tmp_path / "fp8", (16, 16))
    ours, _ = load_model(folder, dtype="bfloat16")
    reference, _ = load_model(tmp_path / "fp8-dequantized", dtype="float32")
    got = ours.layers[0].self_attn.q_a_proj.weight
    want = reference.layers[0].self_attn.q_a_proj.weight
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, want.astype(mx.bfloat16)).item()


@pytest.mark.parametrize(
    ("settings", "error", "named"),
    [
        ({"quant_method": "gptq", "bits": 4}, UnsupportedArchitecture, "quant_method 'gptq'"),
        ({"activation_scheme": "static"}, UnsupportedArchitecture, "activation_scheme 'static'"),
        ({"fmt": "e5m2"}, UnsupportedArchitecture, "fmt 'e5m2'"),
        ({"weight_block_size": [128]}, CheckpointError, "weight_block_size [128]"),
        ({"weight_block_size": [8, 8]}, CheckpointError, "needs"),  # scales written for 16x16 blocks
    ],
)
def test_fp8_layouts_it_cannot_honour_are_refused_naming_them(
    src: Path, tmp_path: Path, settings: dict[str, object], error: type[Exception], named: str
) -> None:
    folder = write_fp8(src, tmp_path / "fp8", (16, 16))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **settings}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(error) as e:
        load_model(folder, dtype="float32")
    assert named in str(e.value)
