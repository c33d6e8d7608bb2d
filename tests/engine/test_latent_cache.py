"""DeepSeek-V3's latent KV cache: per token and layer the caches hold the normed latent and the rotated
RoPE key only, and attention runs over them (absorbed, or expanded for long chunks) in every path the
engine has: a sequence's cache, rows prefilled together, decode batches of ragged rows (masked and
ragged-kernel steps), the prefix cache and scoring. Every result is held against transformers'
DeepSeek-V3 on the same tiny random-weight checkpoint, float32, at 1e-4 (tokens exactly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from reference import (
    DEEPSEEK_V3_ROUTING,
    hf_greedy,
    hf_logits,
    load_hf_model,
    make_hf_checkpoint,
    prompt_ids,
    rel_err,
)

from mlxq.jobs.schema import GenerateRequest, ScoreRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.generation_batch import generate
from mlxq.worker.engine.models import deepseek
from mlxq.worker.engine.models.loader import load_model, save_quantized
from mlxq.worker.engine.prefill import prefill, prefill_rows
from mlxq.worker.engine.sampler import Sampler

# Latent 24 wide, RoPE key 8: 32 features a token and layer, where expanded keys and values would take
# 4 heads x (12 + 8 + 10).
MLA = {
    **DEEPSEEK_V3_ROUTING,
    "q_lora_rank": 24,
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 10,
    "head_dim": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}
LAYERS, LATENT, ROPE, HEADS = 2, 24, 8, 4
TEXT = "The capital of France is Paris. A quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("mla"), "DeepseekV3ForCausalLM", **MLA)


@pytest.fixture(scope="module")
def hf(folder: Path) -> Any:
    return load_hf_model(folder)


@pytest.fixture(scope="module")
def engine(folder: Path) -> Engine:
    return Engine.load(str(folder), EngineOptions(dtype="float32", prefill_chunk=16))


def test_a_token_costs_the_latent_and_the_rope_key_per_layer(engine: Engine, folder: Path) -> None:
    model = engine.model
    ids = prompt_ids(folder, TEXT)
    cache = model.make_cache()
    prefill(model, ids, cache, chunk=16)
    for layer in cache:
        keys, values = layer.state
        assert keys.shape == (1, 1, len(ids), LATENT) and values.shape == (1, 1, len(ids), ROPE)
    per_token = (LATENT + ROPE) * LAYERS * 4  # float32
    held = sum(int(k.nbytes + v.nbytes) for k, v in (layer.state for layer in cache))
    assert held == len(ids) * per_token
    assert engine.kv_bytes_per_token == per_token
    expanded = 2 * HEADS * (12 + 8) * LAYERS * 4  # every head's key and (padded) value, as held before
    assert per_token * 4 < expanded


@pytest.mark.parametrize("absorbed", [True, False])
def test_both_ways_of_attending_match_transformers(
    engine: Engine, folder: Path, hf: Any, absorbed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced absorbed (the key and value projections folded into queries and output) or expanded
    (every key's latent through `kv_b_proj`): logits of a whole prompt, and a cached greedy decode."""
    monkeypatch.setattr(deepseek, "absorbed_is_cheaper", lambda *_a: absorbed)
    model = engine.model
    ids = prompt_ids(folder, TEXT)
    assert rel_err(np.array(model(mx.array([ids], dtype=mx.int32))[0]), hf_logits(hf, ids)) < 1e-4
    cache = model.make_cache()
    logits = prefill(model, ids, cache, chunk=16)
    tokens = []
    for _ in range(8):
        token = mx.argmax(logits, axis=-1)
        tokens.append(int(token.item()))
        logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]
    assert tokens == hf_greedy(hf, ids, 8)


def test_the_shape_of_a_forward_chooses_the_way_of_attending() -> None:
    """A decode step absorbs; a chunk of many queries expands (DeepSeek-V3's own widths)."""
    assert deepseek.absorbed_is_cheaper(1, 512, 128, 128)
    assert deepseek.absorbed_is_cheaper(64, 512, 128, 128)
    assert not deepseek.absorbed_is_cheaper(2048, 512, 128, 128)


@pytest.mark.parametrize("ragged_kernel", [False, True])
def test_a_decode_batch_of_ragged_rows_matches_transformers(
    engine: Engine, folder: Path, hf: Any, ragged_kernel: bool
) -> None:
    """Rows of different lengths prefilled together (one forward, padded), then decoded as one
    left-padded batch, by its mask or by each row's first column (the GPU's ragged step)."""
    model = engine.model
    ids = prompt_ids(folder, TEXT)
    prompts = [ids[:9], ids[:31], ids[:50]]
    caches, logits = prefill_rows(model, [(p, model.make_cache()) for p in prompts])
    batch = DecodeBatch(model, ragged_kernel=ragged_kernel)
    batch.add(caches, logits, [Sampler(model.args.vocab_size, temperature=0) for _ in prompts])
    steps = [batch.step() for _ in range(6)]
    for i, prompt in enumerate(prompts):
        assert [step[i] for step in steps] == hf_greedy(hf, prompt, 6), f"row {i}"


def test_a_cached_prefix_decodes_what_transformers_decodes(engine: Engine, hf: Any) -> None:
    ids = engine.tokenizer.encode(TEXT)
    want = hf_greedy(hf, ids, 10)
    assert engine.tokenizer.eos_ids.isdisjoint(want), "an end token would stop our run early"
    request = GenerateRequest.model_validate({"prompt": TEXT, "max_tokens": 10, "temperature": 0})
    cold = generate(engine, request, lambda _t, _i: None)
    warm = generate(engine, request, lambda _t, _i: None)
    assert warm.usage.cached_tokens == len(ids) - 1
    assert cold.token_ids == warm.token_ids == want


def test_score_rows_match_transformers_cold_and_warm(engine: Engine, hf: Any) -> None:
    rows = [
        {"prompt": TEXT + "The capital of Italy is", "candidates": [" the", " a"]},
        {"prompt": TEXT + "The capital of Spain is", "candidates": [" is"]},
        {"prompt": "Queues hold jobs", "candidates": [" a", " the"]},
    ]
    request = ScoreRequest.model_validate({"rows": rows})
    for result in (engine.score(request), engine.score(request)):
        for row, got in zip(rows, result.rows, strict=True):
            prompt = str(row["prompt"])
            ids = engine.tokenizer.encode(prompt)
            candidates = [engine.tokenizer.encode(prompt + str(c))[-1] for c in row["candidates"]]
            want = hf_logits(hf, ids)[-1]
            assert rel_err(np.array(got.logits), want[candidates]) < 1e-4
    assert result.cached_tokens > 0


def test_a_quantized_latent_projection_absorbs_what_it_expands(tmp_path: Path, folder: Path) -> None:
    """An MLX-quantized `kv_b_proj` (a `QuantizedLinear`): absorbed attention reads it dequantized, the
    expanded one through the quantized matmul; both compute the same logits."""
    src = make_hf_checkpoint(tmp_path / "src", "DeepseekV3ForCausalLM", **{**MLA, "kv_lora_rank": 32})
    model, config = load_model(src, dtype="float32")
    save_quantized(model, config, tmp_path / "q", bits=8, group_size=32, copy_from=src)
    quantized = Engine.load(str(tmp_path / "q"), EngineOptions(dtype="float32")).model
    assert isinstance(quantized.layers[0].self_attn.kv_b_proj, nn.QuantizedLinear)
    ids = mx.array([prompt_ids(folder, TEXT)], dtype=mx.int32)
    logits = {}
    for absorbed in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(deepseek, "absorbed_is_cheaper", lambda *_a, absorbed=absorbed: absorbed)
            logits[absorbed] = np.array(quantized(ids)[0])
    assert rel_err(logits[True], logits[False]) < 1e-5
