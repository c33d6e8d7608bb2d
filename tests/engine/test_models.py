"""Every supported architecture against transformers: prompt logits, and greedy decoding with the cache."""

from __future__ import annotations

import json
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
from safetensors.numpy import load_file, save_file

from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.cache.kv_cache import broadcast_batch, copy_cache
from mlxq.worker.engine.errors import CheckpointError, UnsupportedArchitecture
from mlxq.worker.engine.models import build_model, supported_architectures
from mlxq.worker.engine.models.attention import Attention
from mlxq.worker.engine.models.fused_linear import TransposedWeightLinear, kept_transpose
from mlxq.worker.engine.models.loader import load_model
from mlxq.worker.engine.models.model_args import ModelArgs
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so the scaled band covers most frequencies
}

# LongRoPE with Phi-3's per-pair factors, on a context 8x the original one: within the original context
# (to which the model's is capped) the short factors and the attention factor apply.
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.25 * i for i in range(8)],
    "long_factor": [2.0 + i for i in range(8)],
    "original_max_position_embeddings": 64,
}

QWEN3_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
}
# DeepSeek-V3 in small: latent attention (q through a low rank; keys 12 + 8 rotated features wide,
# values 10), 6 routed experts in 3 groups (2 groups kept, 2 experts per token), 1 shared expert, the
# first layer dense. transformers writes the RoPE width as head_dim.
DEEPSEEK_V3 = {
    **DEEPSEEK_V3_ROUTING,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 10,
    "head_dim": 8,
    "num_key_value_heads": 4,
}
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}

LAYERS = ["full_attention", "sliding_attention"]

# Gemma 3 in small: local layers (window 6, their own RoPE base) around a global one (linear RoPE
# scaling); head_dim 32 is not hidden/heads, and the attention scale is not head_dim's.
GEMMA3: dict[str, Any] = {
    "num_hidden_layers": 3,
    "head_dim": 32,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 24,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    },
}
GEMMA3_PATTERN = ["sliding_attention", "sliding_attention", "full_attention"]  # sliding_window_pattern 3

# name -> (architecture, config overrides, config.json style)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama-gqa": ("LlamaForCausalLM", {}, "v5"),
    "llama-mha-v4": ("LlamaForCausalLM", {"num_key_value_heads": 4}, "v4"),
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}, "v5"),
    "llama-head-dim-32": ("LlamaForCausalLM", {"head_dim": 32}, "v5"),
    "llama3-rope-v5": ("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}, "v5"),
    "llama3-rope-v4": ("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}, "v4"),
    "linear-rope-v4": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "v4"),
    "mistral": ("MistralForCausalLM", {}, "v5"),
    # a window far shorter than the prompt (21 tokens): every path's masks narrowed (`window.py`)
    "mistral-window-8": ("MistralForCausalLM", {"sliding_window": 8}, "v5"),
    "mistral-window-5-v4": ("MistralForCausalLM", {"sliding_window": 5, "num_key_value_heads": 1}, "v4"),
    "qwen2-bias-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}, "v5"),
    # Qwen2's windows from max_window_layers on, as transformers 5 writes them into layer_types
    "qwen2-window-layers": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        "v5",
    ),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"head_dim": 32}, "v5"),
    "qwen3-v4": ("Qwen3ForCausalLM", {"num_key_value_heads": 1}, "v4"),
    "mixtral-5-experts": ("MixtralForCausalLM", {"num_local_experts": 5, "num_experts_per_tok": 2}, "v5"),
    "mixtral-window-7": (
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 7},
        "v5",
    ),
    "mixtral-router-ties-v4": (
        "MixtralForCausalLM",
        {"num_local_experts": 5, "num_experts_per_tok": 3, "head_dim": 32},
        "v4",
    ),
    "qwen3-moe-dense-layer-v4": (
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 7,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
        "v4",
    ),
    "qwen3-moe-router-ties": (
        "Qwen3MoeForCausalLM",
        {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False},
        "v5",
    ),
    "phi3": ("Phi3ForCausalLM", {}, "v5"),
    "phi3-window-6": ("Phi3ForCausalLM", {"sliding_window": 6}, "v5"),  # Phi-3-mini's window, in small
    "phi3-partial-rotary": ("Phi3ForCausalLM", {"rope_parameters": {"partial_rotary_factor": 0.75}}, "v5"),
    "phi3-partial-rotary-tied-v4": (
        "Phi3ForCausalLM",
        {
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75},
            "tie_word_embeddings": True,
        },
        "v4",
    ),
    "phi3-longrope": (
        "Phi3ForCausalLM",
        {"rope_parameters": PHI3_LONGROPE, "original_max_position_embeddings": 64},
        "v5",
    ),
    "phi3-longrope-v4": (
        "Phi3ForCausalLM",
        {"rope_parameters": PHI3_LONGROPE, "original_max_position_embeddings": 64},
        "v4",
    ),
    "qwen3-yarn": ("Qwen3ForCausalLM", {"rope_parameters": QWEN3_YARN}, "v5"),
    "gemma3": ("Gemma3ForCausalLM", GEMMA3, "v5"),
    "gemma3-tied-v4": (
        "Gemma3ForCausalLM",
        {**GEMMA3, "tie_word_embeddings": True, "layer_types": GEMMA3_PATTERN, "num_key_value_heads": 1},
        "v4",
    ),
    "deepseek-v3": ("DeepseekV3ForCausalLM", DEEPSEEK_V3, "v5"),
    "deepseek-v3-yarn-no-q-lora-v4": (
        "DeepseekV3ForCausalLM",
        {**DEEPSEEK_V3, "q_lora_rank": None, "v_head_dim": 24, "rope_parameters": DEEPSEEK_YARN},
        "v4",
    ),
    # one group of experts (Moonlight's routing): no group is masked
    "deepseek-v3-one-group": ("DeepseekV3ForCausalLM", {**DEEPSEEK_V3, "n_group": 1, "topk_group": 1}, "v5"),
}


def correction_bias(folder: Path) -> None:
    """DeepSeek-V3's routers with a random `e_score_correction_bias` (transformers initialises it to 0)."""
    path = folder / "model.safetensors"
    w = load_file(path)
    rng = np.random.default_rng(0)
    for key in [k for k in w if k.endswith("e_score_correction_bias")]:
        w[key] = (0.3 * rng.standard_normal(w[key].shape)).astype(np.float32)
    save_file(w, path, metadata={"format": "pt"})


def tie_routers(folder: Path) -> None:
    """Rewrite a two-layer mixture of experts so its routers tie. Layer 0: experts 1 and 2 share a router
    row v, the others' rows are -a·v with distinct a, so for every token the tied pair either leads (a
    tie inside the top-k between different experts, weighted equally) or trails. Layer 1: experts 3 and 4
    share a router row and all their weights, so a tie at the k-th place gives one output whichever wins
    (which one wins is each sort's own choice: transformers' torch.topk does not say)."""
    path = folder / "model.safetensors"
    w = load_file(path)
    for layer in (0, 1):
        (gate,) = [k for k in w if k.startswith(f"model.layers.{layer}.") and k.endswith(".gate.weight")]
        rows = w[gate].copy()
        if layer == 0:
            v = rows[1]
            rows[:] = [-0.5 * v, v, v, -1.0 * v, -2.0 * v]
        else:
            rows[4] = rows[3]
            prefix = gate[: -len("gate.weight")] + "experts."
            for key in [k for k in w if k.startswith(prefix + "3.")]:
                w[prefix + "4." + key[len(prefix + "3.") :]] = w[key]
        w[gate] = rows
    save_file(w, path, metadata={"format": "pt"})


def spread_final_norm(folder: Path) -> None:
    """Gemma with tied embeddings: a token's own embedding (scaled by sqrt(hidden)) rides the residual
    and wins the logits, so greedy decoding repeats it; a final norm of wide random weights breaks that."""
    path = folder / "model.safetensors"
    w = load_file(path)
    w["model.norm.weight"] = (
        2.0 * np.random.default_rng(0).standard_normal(w["model.norm.weight"].shape)
    ).astype(np.float32)
    save_file(w, path, metadata={"format": "pt"})


EDITS = {
    "gemma3-tied-v4": spread_final_norm,
    "mixtral-router-ties-v4": tie_routers,
    "qwen3-moe-router-ties": tie_routers,
    "deepseek-v3": correction_bias,
    "deepseek-v3-yarn-no-q-lora-v4": correction_bias,
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(checkpoint folder, our model as the engine runs it (projections fused), transformers' model)."""
    arch, overrides, style = CASES[request.param]
    folder = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch, config_style=style, **overrides)
    if request.param in EDITS:
        EDITS[request.param](folder)
    model, _ = load_model(folder, dtype="float32")
    model.fuse()
    return folder, model, load_hf_model(folder)


def test_fused_projections_compute_what_the_checkpoint_layout_does(pair: tuple[Path, Any, Any]) -> None:
    folder, fused, _ = pair
    plain, _ = load_model(folder, dtype="float32")
    fused.fuse()  # a second time changes nothing
    attn = fused.layers[0].self_attn
    if isinstance(attn, Attention):  # DeepSeek's latent attention has nothing to fuse
        assert attn.qkv_proj is not None and "q_proj" not in attn and "q_proj" in plain.layers[0].self_attn
    ids = mx.array([prompt_ids(folder)], dtype=mx.int32)
    np.testing.assert_allclose(np.array(fused(ids)), np.array(plain(ids)), rtol=1e-5, atol=1e-5)
    last = ids.shape[1] - 3  # a prefill's last position only: q sliced after the fused matmul
    got, want = (m.hidden(ids, cache=m.make_cache(), last=last) for m in (fused, plain))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_per_head_norms_normalise_q_and_k_side_by_side_then_one_rope(pair: tuple[Path, Any, Any]) -> None:
    """Qwen3's per-head q and k norms: once fused, q and k heads are normalised side by side (one norm,
    one product by both norms' weights) and rotated by one RoPE, as layers without such norms are, and
    give what each norm and RoPE of their own gives (a decode step's one position and a prefill's)."""
    _, model, _ = pair
    attn = model.layers[0].self_attn
    if not isinstance(attn, Attention) or not attn.qk_norm:
        pytest.skip("no per-head norms")
    plain_norms = type(attn.q_norm) is nn.RMSNorm  # Gemma 3's norms scale by 1 + weight: apart
    assert attn.qk_together == plain_norms
    if not plain_norms:
        return
    h, hkv = attn.n_heads, attn.n_kv_heads
    calls = {"rope": 0, "rms_norm": 0}
    rope, rms_norm = type(attn.rope).__call__, mx.fast.rms_norm

    def counted_rope(*a: Any, **k: Any) -> mx.array:
        calls["rope"] += 1
        return rope(*a, **k)  # type: ignore[no-any-return]

    def counted_norm(*a: Any, **k: Any) -> mx.array:
        calls["rms_norm"] += 1
        return rms_norm(*a, **k)

    for positions, offset in ((1, 5), (6, 0)):
        x = mx.random.normal((2, positions, model.args.hidden_size))
        assert attn._one_matmul(x)
        calls.update(rope=0, rms_norm=0)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(attn.rope), "__call__", counted_rope)
            patch.setattr(mx.fast, "rms_norm", counted_norm)
            qk, v = attn.rotated(x, offset)
        assert calls == {"rope": 1, "rms_norm": 1}
        q, k, want_v = attn._projected(x, None)  # each normalised by its own norm, not rotated
        want = mx.concatenate([attn.rope(q, offset=offset), attn.rope(k, offset=offset)], axis=1)
        np.testing.assert_allclose(np.array(qk), np.array(want), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(v), np.array(want_v), rtol=1e-6, atol=1e-6)
        assert qk.shape[1] == h + hkv


@pytest.mark.parametrize("bias", [False, True])
def test_a_kept_transpose_linear_computes_exactly_what_nn_linear_does(bias: bool) -> None:
    """`kept_transpose` keeps the layer's arrays and products (bit for bit: the same matmul of the same
    view); a weight replaced later is followed, not the transpose of the old one."""
    plain = nn.Linear(16, 24, bias=bias)
    kept = kept_transpose(plain)
    assert isinstance(kept, TransposedWeightLinear) and kept.weight is plain.weight
    assert kept_transpose(kept) is kept
    x = mx.random.normal((3, 2, 16))
    for _ in range(2):  # the view made, then reused
        assert mx.array_equal(kept(x), plain(x))
    plain.weight = kept.weight = mx.random.normal((24, 16))
    assert mx.array_equal(kept(x), plain(x))


def test_every_architecture_has_a_case() -> None:
    # the multimodal Gemma 3 is held against transformers' own in its test below
    multimodal = {"Gemma3ForConditionalGeneration"}
    assert {arch for arch, _, _ in CASES.values()} | multimodal == set(supported_architectures())


def test_logits_match_transformers(pair: tuple[Path, Any, Any]) -> None:
    folder, model, hf = pair
    ids = prompt_ids(folder)
    ours = np.array(model(mx.array([ids], dtype=mx.int32))[0])
    assert rel_err(ours, hf_logits(hf, ids)) < 1e-4


def test_greedy_with_cache_matches_generate(pair: tuple[Path, Any, Any]) -> None:
    folder, model, hf = pair
    ids = prompt_ids(folder)
    cache = model.make_cache()
    model(mx.array([ids[:5]], dtype=mx.int32), cache=cache)  # prefill in two chunks
    logits = model(mx.array([ids[5:]], dtype=mx.int32), cache=cache)[:, -1, :]
    ours = []
    for _ in range(16):
        token = mx.argmax(logits, axis=-1)
        ours.append(int(token.item()))
        logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]
    assert ours == hf_greedy(hf, ids, 16)
    assert len(set(ours)) > 4, "degenerate reference: a repeated token would hide position bugs"
    assert cache[0].offset == len(ids) + 16


def test_hidden_then_logits_equals_call(pair: tuple[Path, Any, Any]) -> None:
    folder, model, _ = pair
    x = mx.array([prompt_ids(folder)], dtype=mx.int32)
    hidden = model.hidden(x)
    assert hidden.shape == (1, x.shape[1], model.args.hidden_size)
    last = model.logits(hidden[:, -1:, :])
    assert mx.allclose(last, model(x)[:, -1:, :], atol=1e-5).item()


@pytest.mark.parametrize("last_from_end", [1, 3])
def test_hidden_of_one_position_equals_its_row_of_all_positions(
    pair: tuple[Path, Any, Any], last_from_end: int
) -> None:
    """`hidden(last=i)`: the final layer computes position i only (a prefill's last token, or the last
    real one before right padding), yet writes every position's keys and values, as a full forward."""
    folder, model, _ = pair
    ids = prompt_ids(folder)
    prefix, rest = ids[:5], ids[5:]
    full_cache, one_cache = model.make_cache(), model.make_cache()
    for cache in (full_cache, one_cache):
        model(mx.array([prefix], dtype=mx.int32), cache=cache)
    x = mx.array([rest], dtype=mx.int32)
    i = len(rest) - last_from_end
    full = model.hidden(x, cache=full_cache)
    one = model.hidden(x, cache=one_cache, last=i)
    assert one.shape == (1, 1, model.args.hidden_size)
    assert mx.allclose(one[:, 0], full[:, i], atol=1e-5).item()
    for a, b in zip(one_cache, full_cache, strict=True):
        assert a.offset == b.offset == len(ids)
        assert mx.array_equal(a.state[0], b.state[0]) and mx.array_equal(a.state[1], b.state[1])


@pytest.mark.parametrize("last", [None, 2])
def test_bucketed_key_columns_give_what_exact_keys_give(
    pair: tuple[Path, Any, Any], last: int | None
) -> None:
    """`bucket_keys` (GPUs): a forward on top of a cached prefix reads whole cache steps, the extra
    columns masked. Its hidden states and cache equal the exact-length forward's; stale keys past the
    prefix (a trimmed cache) stay hidden."""
    folder, model, _ = pair
    ids = prompt_ids(folder)
    prefix, rest = ids[:6], ids[6:]
    exact, bucketed = model.make_cache(), model.make_cache()
    for cache in (exact, bucketed):
        model(mx.array([prefix + rest], dtype=mx.int32), cache=cache)  # then trimmed: stale columns
        for c in cache:
            c.trim(len(rest))
    x = mx.array([rest], dtype=mx.int32)
    want = model.hidden(x, cache=exact, last=last)
    model.bucket_keys = True
    try:
        got = model.hidden(x, cache=bucketed, last=last)
    finally:
        model.bucket_keys = False
    assert bucketed[0].keys.shape[2] % bucketed[0].step == 0
    assert mx.allclose(got, want, atol=1e-5).item()
    for a, b in zip(bucketed, exact, strict=True):
        assert a.offset == b.offset == len(ids)
        assert mx.array_equal(a.state[0], b.state[0]) and mx.array_equal(a.state[1], b.state[1])


def test_right_padded_batch_on_shared_prefix_with_explicit_mask(pair: tuple[Path, Any, Any]) -> None:
    """Scoring's use: one cached prefix, rows of different lengths batched with a boolean mask."""
    folder, model, _ = pair
    ids = prompt_ids(folder)
    prefix, rows = ids[:6], [ids[6:9], ids[9:14]]
    base = model.make_cache()
    model(mx.array([prefix], dtype=mx.int32), cache=base)
    width = max(len(r) for r in rows)
    padded = mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
    lengths = mx.array([len(r) for r in rows])[:, None, None, None]
    q = mx.arange(width)[None, None, :, None]
    k = mx.arange(len(prefix) + width)[None, None, None, :] - len(prefix)
    mask = (k < 0) | ((k <= q) & (k < lengths))  # (B, 1, L, P + L): prefix, then causal within the row
    batched = model(padded, cache=broadcast_batch(base, len(rows)), mask=mask)
    for i, row in enumerate(rows):
        alone = model(mx.array([row], dtype=mx.int32), cache=copy_cache(base))
        assert mx.allclose(batched[i, : len(row)], alone[0], atol=1e-5).item()


def test_model_args_read_both_config_styles() -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 8, "num_attention_heads": 4}
    v4 = ModelArgs.from_dict(
        {
            **base,
            "vocab_size": 10,
            "rope_theta": 5e5,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "x": 1,
        }
    )
    v5 = ModelArgs.from_dict(
        {
            **base,
            "vocab_size": 10,
            "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0},
        }
    )
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling == v5.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (v4.head_dim, v4.n_kv_heads) == (16, 4)
    plain = ModelArgs.from_dict(
        {**base, "vocab_size": 10, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}
    )
    assert plain.rope_scaling is None


def test_config_missing_required_keys_is_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="lacks intermediate_size, vocab_size"):
        build_model(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )


def test_additive_float32_mask_on_bfloat16_model(tmp_path: Path) -> None:
    model, _ = load_model(write_random_checkpoint(tmp_path), dtype="bfloat16")
    ids = mx.array([[3, 1, 4, 1, 5, 9]], dtype=mx.int32)
    allowed = mx.tril(mx.ones((6, 6), dtype=mx.bool_))
    additive = mx.where(allowed, 0.0, -1e9).astype(mx.float32)
    by_bool = model(ids, mask=allowed)
    assert mx.array_equal(model(ids, mask=additive), by_bool).item()
    assert mx.array_equal(model(ids), by_bool).item()


def test_build_model_is_lazy_and_shaped() -> None:
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "vocab_size": 50,
        "head_dim": 8,
    }
    model = build_model(config)
    assert model.layers[0].self_attn.q_norm.weight.shape == (8,)
    assert model(mx.array([[1, 2, 3]], dtype=mx.int32)).shape == (1, 3, 50)


@pytest.mark.parametrize(
    ("arch", "window", "extra", "windows"),
    [
        ("MistralForCausalLM", 511, {}, [511, 511]),  # Mistral's window is on whenever it is set
        ("MistralForCausalLM", 512, {}, [None, None]),  # as long as the context: never slides
        ("Qwen2ForCausalLM", 8, {"use_sliding_window": False}, [None, None]),  # off unless switched on
        ("Qwen2ForCausalLM", 8, {"use_sliding_window": True, "layer_types": LAYERS}, [None, 8]),
        ("Phi3ForCausalLM", 8, {}, [8, 8]),
    ],
)
def test_each_layer_takes_the_window_transformers_applies_to_it(
    arch: str, window: int, extra: dict[str, Any], windows: list[int | None]
) -> None:
    config = {
        "architectures": [arch],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "vocab_size": 50,
        "max_position_embeddings": 512,
        "sliding_window": window,
        **extra,
    }
    assert build_model(config).model.windows == windows  # type: ignore[attr-defined]


def test_a_window_layout_the_engine_cannot_read_is_refused_naming_it() -> None:
    """Qwen2's older configs switch windows on from `max_window_layers` on: not read, so refused."""
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "vocab_size": 50,
        "sliding_window": 8,
        "use_sliding_window": True,
    }
    with pytest.raises(UnsupportedArchitecture, match="use_sliding_window without layer_types"):
        build_model(config)
    with pytest.raises(CheckpointError, match="layer_types"):
        build_model({**config, "layer_types": ["full_attention", "chunked_attention"]})


def test_phi3_rope_reads_partial_rotary_and_longrope_and_caps_the_context(tmp_path: Path) -> None:
    """What the Phi-3 cases above run on: 12 of 16 features rotated; LongRoPE's short factors and attention
    factor (a context 8x the original: sqrt(1 + ln 8 / ln 64)), the context capped at the original one."""
    partial = make_hf_checkpoint(
        tmp_path / "p", "Phi3ForCausalLM", config_style="v4", rope_parameters={"partial_rotary_factor": 0.75}
    )
    assert load_model(partial)[0].layers[0].self_attn.rope.dims == 12
    folder = make_hf_checkpoint(
        tmp_path / "l", "Phi3ForCausalLM", rope_parameters=PHI3_LONGROPE, original_max_position_embeddings=64
    )
    model, config = load_model(folder)
    rope = model.layers[0].self_attn.rope
    assert config["max_position_embeddings"] == 512 and model.args.max_position_embeddings == 64
    assert rope.magnitude == pytest.approx((1 + np.log(8) / np.log(64)) ** 0.5)
    old = {
        **config,
        "rope_parameters": None,
        "rope_scaling": {**PHI3_LONGROPE, "type": "su", "rope_type": None},
    }
    assert build_model(old).layers[0].self_attn.rope.magnitude == rope.magnitude
    engine = Engine.load(str(folder), EngineOptions(prefix_cache_bytes=0))
    assert engine.context_length == 64  # longer requests are refused (ContextTooLong), never approximated


def test_phi3_quantized_folder_with_fused_projections(tmp_path: Path) -> None:
    """mlx-community's Phi-3 folders keep qkv_proj and gate_up_proj fused and quantized: split by rows at
    load, they compute what the same weights dequantized compute."""
    src = make_hf_checkpoint(tmp_path / "src", "Phi3ForCausalLM")
    weights = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for key, value in weights.items():
        if value.ndim == 2 and key.endswith(".weight") and "embed" not in key and "lm_head" not in key:
            w, scales, biases = mx.quantize(mx.array(value), group_size=32, bits=4)
            stem = key[: -len(".weight")]
            quantized |= {
                key: np.array(w),
                f"{stem}.scales": np.array(scales),
                f"{stem}.biases": np.array(biases),
            }
            dequantized[key] = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=4))
        else:
            quantized[key] = dequantized[key] = value
    assert "model.layers.0.self_attn.qkv_proj.scales" in quantized
    config = json.loads((src / "config.json").read_text())
    for name, tensors, extra in (
        ("q", quantized, {"quantization": {"group_size": 32, "bits": 4}}),
        ("d", dequantized, {}),
    ):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "mlx"})
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    model, _ = load_model(tmp_path / "q", dtype="float32")
    plain, _ = load_model(tmp_path / "d", dtype="float32")
    assert isinstance(model.layers[0].self_attn.k_proj, nn.QuantizedLinear)
    ids = mx.array([prompt_ids(src)], dtype=mx.int32)
    assert rel_err(np.array(model(ids)[0]), np.array(plain(ids)[0])) < 1e-4


def test_deepseek_reads_mlx_lm_split_latent_projection(tmp_path: Path) -> None:
    """mlx-community's DeepSeek-V3 folders (written by mlx-lm) hold kv_b_proj per head as `embed_q`
    (heads, latent, nope) and `unembed_out` (heads, v_dim, latent), each quantized on its own: joined
    back, the float parts compute what transformers computes, and the quantized ones what their
    dequantized values compute."""
    config = {**DEEPSEEK_V3, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "v_head_dim": 16}
    src = make_hf_checkpoint(tmp_path / "src", "DeepseekV3ForCausalLM", **config)
    heads, nope = 4, 32
    base = load_file(src / "model.safetensors")
    split, quantized, joined = {}, {}, {}
    for key, value in base.items():
        if not key.endswith("kv_b_proj.weight"):
            split[key] = quantized[key] = joined[key] = value
            continue
        stem = key[: -len("kv_b_proj.weight")]
        per_head = value.reshape(heads, -1, value.shape[-1])
        parts = {"embed_q": per_head[:, :nope].swapaxes(1, 2), "unembed_out": per_head[:, nope:]}
        dequantized = {}
        for name, part in parts.items():
            split[f"{stem}{name}.weight"] = np.ascontiguousarray(part)
            w, scales, biases = mx.quantize(mx.array(part), group_size=32, bits=4)
            quantized |= {
                f"{stem}{name}.{k}": np.array(v)
                for k, v in (("weight", w), ("scales", scales), ("biases", biases))
            }
            dequantized[name] = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=4))
        both = np.concatenate([dequantized["embed_q"].swapaxes(1, 2), dequantized["unembed_out"]], axis=1)
        joined[key] = both.reshape(-1, both.shape[-1])
    hf_config = json.loads((src / "config.json").read_text())
    for name, tensors, extra in (
        ("split", split, {}),
        ("quantized", quantized, {"quantization": {"group_size": 32, "bits": 4}}),
        ("joined", joined, {}),
    ):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "mlx"})
        (tmp_path / name / "config.json").write_text(json.dumps({**hf_config, **extra}))
    ids = prompt_ids(src)
    batch = mx.array([ids], dtype=mx.int32)
    ours = load_model(tmp_path / "split", dtype="float32")[0]
    assert rel_err(np.array(ours(batch)[0]), hf_logits(load_hf_model(src), ids)) < 1e-4
    from_quantized = np.array(load_model(tmp_path / "quantized", dtype="float32")[0](batch)[0])
    assert (
        rel_err(from_quantized, np.array(load_model(tmp_path / "joined", dtype="float32")[0](batch)[0]))
        < 1e-5
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("final_logit_softcapping", 30.0),
        ("attn_logit_softcapping", 50.0),
        ("use_bidirectional_attention", True),
        ("hidden_activation", "silu"),
    ],
)
def test_a_gemma3_feature_not_implemented_is_refused_naming_it(key: str, value: Any) -> None:
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "vocab_size": 50,
        "head_dim": 16,
        key: value,
    }
    with pytest.raises(UnsupportedArchitecture, match=key):
        build_model(config)
    del config[key]
    model = build_model(config)  # without it, Gemma 3's defaults: window 4096, every 6th layer global
    assert model.model.windows == [4096, 4096]  # type: ignore[attr-defined]


def test_gemma3_reads_transformers_4_rope_and_pattern() -> None:
    """transformers 4: `rope_theta`/`rope_scaling` for the global layers, `rope_local_base_freq` for the
    local ones, every `sliding_window_pattern`-th layer global."""
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "vocab_size": 50,
        "head_dim": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "rope_theta": 50000.0,
        "rope_local_base_freq": 500.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }
    model = build_model(config)
    assert model.model.windows == [8, None, 8, None]  # type: ignore[attr-defined]
    local, global_ = (model.layers[i].self_attn.rope for i in (0, 1))
    assert local.base == 500.0 and global_.base == 50000.0 and global_.scale == 0.25
    with pytest.raises(CheckpointError, match="Gemma3ForConditionalGeneration has no text_config"):
        build_model({**config, "architectures": ["Gemma3ForConditionalGeneration"]})


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 4B and up ship as `Gemma3ForConditionalGeneration`: its language model alone computes
    what transformers' multimodal model computes for text, under either prefix of its weights."""
    import torch
    import transformers
    from reference import TINY, randomize

    from mlxq.worker.modelfiles.tiny_model import build_tokenizer

    folder = tmp_path / "mm"
    vocab = build_tokenizer(folder)
    text = {**TINY, **GEMMA3, "vocab_size": vocab, "tie_word_embeddings": True, "pad_token_id": 0}
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    tokens = {"image_token_index": vocab - 3, "boi_token_index": vocab - 2, "eoi_token_index": vocab - 1}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, **tokens
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config)
    randomize(hf)
    hf.save_pretrained(folder)
    ids = prompt_ids(folder)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0].float().numpy()
    model, _ = load_model(folder, dtype="float32")
    assert model.model.windows == [6, None, 6]  # type: ignore[attr-defined]
    assert rel_err(np.array(model(mx.array([ids], dtype=mx.int32))[0]), want) < 1e-4
    weights = load_file(folder / "model.safetensors")
    renamed = {k.replace("language_model.model.", "model.language_model."): v for k, v in weights.items()}
    assert renamed.keys() != weights.keys()
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    again, _ = load_model(folder, dtype="float32")
    assert rel_err(np.array(again(mx.array([ids], dtype=mx.int32))[0]), want) < 1e-4


def test_gemma3_quantized_folder_with_quantized_tied_embeddings(tmp_path: Path) -> None:
    """mlx-community's Gemma 3 folders quantize every projection and the tied embedding (read scaled
    for the input, as a linear for the logits); Gemma's norms stay plain. Computes what the same
    weights dequantized compute, over a prompt past the window and decoding with the cache."""
    src = make_hf_checkpoint(tmp_path / "src", "Gemma3ForCausalLM", **{**GEMMA3, "tie_word_embeddings": True})
    quantized, dequantized = {}, {}
    for key, value in load_file(src / "model.safetensors").items():
        if value.ndim == 2:
            w, scales, biases = mx.quantize(mx.array(value), group_size=32, bits=4)
            stem = key[: -len(".weight")]
            quantized |= {
                key: np.array(w),
                f"{stem}.scales": np.array(scales),
                f"{stem}.biases": np.array(biases),
            }
            dequantized[key] = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=4))
        else:
            quantized[key] = dequantized[key] = value
    assert "model.embed_tokens.scales" in quantized and "lm_head.weight" not in quantized
    config = json.loads((src / "config.json").read_text())
    for name, tensors, extra in (
        ("q", quantized, {"quantization": {"group_size": 32, "bits": 4}}),
        ("d", dequantized, {}),
    ):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "mlx"})
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    model, _ = load_model(tmp_path / "q", dtype="float32")
    plain, _ = load_model(tmp_path / "d", dtype="float32")
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    ids = prompt_ids(src)
    x = mx.array([ids], dtype=mx.int32)
    assert rel_err(np.array(model(x)[0]), np.array(plain(x)[0])) < 1e-4
    tokens = []
    for m in (model, plain):
        cache = m.make_cache()
        logits = m(x, cache=cache)[:, -1]
        out = []
        for _ in range(8):
            out.append(int(mx.argmax(logits, axis=-1).item()))
            logits = m(mx.array([[out[-1]]], dtype=mx.int32), cache=cache)[:, -1]
        tokens.append(out)
    assert tokens[0] == tokens[1]


def test_random_gemma3_checkpoints_load_and_slide(tmp_path: Path) -> None:
    """What the Gemma 3 benchmark shape is written as: Gemma's norms, offsets from one, near zero."""
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "head_dim": 32,
        "sliding_window": 4,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 32,
    }
    folder = write_random_checkpoint(tmp_path, config)
    stored = load_file(folder / "model.safetensors")
    assert abs(float(stored["model.layers.0.pre_feedforward_layernorm.weight"].mean())) < 0.1
    model, _ = load_model(folder, dtype="float32")
    assert model.model.windows == [4, None]  # type: ignore[attr-defined]
    assert np.isfinite(np.array(model(mx.array([list(range(1, 12))], dtype=mx.int32)))).all()
