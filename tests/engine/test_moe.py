"""The new architectures through the engine: the mixtures of experts' routing and stacked (quantized)
experts in mlx-community's layout; for Qwen3-MoE, Mixtral, DeepSeek-V3, Phi-3 (LongRoPE, partial
rotary), Mistral with a sliding window and Gemma 3 batched generation, the ragged decode step, scoring
and the prefix cache.

The models themselves are held against transformers in `test_models.py`; here float32 on the CPU, where
a batched forward is exact per row, every request's tokens must equal the request's run alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from reference import DEEPSEEK_V3_ROUTING, TINY, make_hf_checkpoint, prompt_ids, rel_err
from safetensors.numpy import load_file, save_file

from mlxq.jobs.schema import GenerateRequest, ScoreRequest
from mlxq.worker.engine import Engine, EngineOptions, expert_kernel
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.errors import CheckpointError
from mlxq.worker.engine.generation_batch import GenerationBatch, generate
from mlxq.worker.engine.models import attention, build_model, deepseek, llama, moe
from mlxq.worker.engine.models.loader import load_model, save_quantized
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

LONG = "The capital of France is Paris. " * 8
QWEN3_MOE = {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
MIXTRAL = {"num_local_experts": 5, "num_experts_per_tok": 2}
# Gemma 3 in small: a global layer, then windowed local ones (window 7); head_dim 256 as Gemma 3's (not
# hidden/heads), the scale its own: on a GPU the ragged decode kernel runs at that width.
GEMMA3 = {
    "num_hidden_layers": 3,
    "head_dim": 256,
    "sliding_window": 7,
    "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    "query_pre_attn_scalar": 256,
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3moe")
    return make_hf_checkpoint(folder, "Qwen3MoeForCausalLM", max_position_embeddings=1024, **QWEN3_MOE)


def test_route_is_softmax_then_top_k_with_ties_lower_index_first() -> None:
    logits = mx.array([[0.0, 2.0, 2.0, 1.0, 2.0], [3.0, 0.0, 1.0, 1.0, -1.0]])
    weights, experts = moe.route(logits, 2, renormalize=False)
    probs = np.array(mx.softmax(logits, axis=-1))
    assert experts.tolist() == [[1, 2], [0, 2]]  # row 0: a three-way tie, lower indices first
    np.testing.assert_allclose(np.array(weights), np.take_along_axis(probs, np.array(experts), -1), rtol=1e-6)
    renormed, _ = moe.route(logits, 2, renormalize=True)
    np.testing.assert_allclose(np.array(renormed).sum(-1), [1.0, 1.0], rtol=1e-6)
    assert weights.dtype == mx.float32 and renormed[0, 0].item() == renormed[0, 1].item() == 0.5


@pytest.mark.parametrize("rows", [3, 40])
def test_gathered_experts_equal_each_expert_applied_on_its_own(rows: int) -> None:
    """Few rows gather per (token, expert); many (>= SORT_FROM pairs) are sorted by expert first."""
    mx.random.seed(1)
    block = moe.SwitchGLU(16, 24, 7)
    mx.eval(block.parameters())
    x = mx.random.normal((rows, 16))
    experts = mx.random.randint(0, 7, (rows, 3))
    got = block(x, experts)
    for i in range(rows):
        for j in range(3):
            e = experts[i, j].item()
            g, u = x[i] @ block.gate_proj.weight[e].T, x[i] @ block.up_proj.weight[e].T
            want = (nn.silu(g) * u) @ block.down_proj.weight[e].T
            np.testing.assert_allclose(np.array(got[i, j]), np.array(want), rtol=1e-5, atol=1e-5)
    block.fuse()  # gate and up in one gathered matmul
    assert block.gate_up_proj is not None and "gate_proj" not in block
    np.testing.assert_allclose(np.array(block(x, experts)), np.array(got), rtol=1e-5, atol=1e-5)


def _quantized_switch(hidden: int, width: int, experts: int, group: int, fused: bool) -> moe.SwitchGLU:
    """Stacked experts quantized to 4 bits, gate and up fused where asked (`SwitchGLU.fuse`)."""
    block = moe.SwitchGLU(hidden, width, experts)
    nn.quantize(block, group, 4, class_predicate=lambda _p, m: isinstance(m, moe.SwitchLinear))
    if fused:
        block.fuse()
    return block


@pytest.mark.parametrize("fused", [False, True])
def test_many_pairs_through_quantized_experts_dequantized_equal_the_quantized_matmuls(fused: bool) -> None:
    """From `dense_from` pairs (MLX's CUDA build: `DENSE_FROM_ON_CUDA`) quantized experts are multiplied
    dequantized, by a plain gathered matmul of the pairs sorted by expert: the same outputs as the
    gathered quantized matmuls (float32), and fewer pairs keep those."""
    mx.random.seed(3)
    block = _quantized_switch(64, 32, 7, 32, fused)
    assert block.dense_from is None  # not on the CPU build
    x = mx.random.normal((40, 64))
    experts = mx.random.randint(0, 7, (40, 3))  # 120 pairs: sorted by expert
    quantized = block(x, experts)
    block.dense_from = 100
    calls = {"qmm": 0, "mm": 0}
    real_qmm, real_mm = mx.gather_qmm, mx.gather_mm

    def qmm(*args: Any, **kwargs: Any) -> mx.array:
        calls["qmm"] += 1
        return real_qmm(*args, **kwargs)

    def mm(*args: Any, **kwargs: Any) -> mx.array:
        calls["mm"] += 1
        return real_mm(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx, "gather_qmm", qmm)
        patch.setattr(mx, "gather_mm", mm)
        dense = block(x, experts)
        assert calls == {"qmm": 0, "mm": 2 if fused else 3}
        np.testing.assert_allclose(np.array(dense), np.array(quantized), rtol=1e-4, atol=1e-5)
        few = block(x[:20], experts[:20])  # 60 pairs: the quantized matmuls still
        assert calls["qmm"] == (2 if fused else 3)
        np.testing.assert_allclose(np.array(few), np.array(quantized[:20]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_a_few_dozen_tokens_through_every_quantized_expert_equal_the_pairs_matmuls(fused: bool) -> None:
    """From `every_from` pairs up to `every_tokens` tokens (MLX's CUDA build: as many pairs as experts,
    64 tokens) every token is multiplied by every quantized expert, one slice of each gathered matmul an
    expert, and each token's own experts' outputs taken: the same outputs as the pairs' matmuls; fewer
    pairs, more tokens or `dense_from` pairs take the paths they took."""
    mx.random.seed(5)
    block = _quantized_switch(64, 32, 7, 32, fused)
    assert block.every_from is None  # not on the CPU build
    x = mx.random.normal((12, 1, 64))
    experts = mx.random.randint(0, 7, (12, 1, 3)).astype(mx.uint32)  # 36 pairs of 12 tokens
    pairs = block.expert_outputs(x, experts)
    block.every_from, block.every_tokens = 7, 12
    slices: list[int] = []
    real = mx.gather_qmm

    def qmm(*args: Any, **kwargs: Any) -> mx.array:
        slices.append(kwargs["rhs_indices"].size)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx, "gather_qmm", qmm)
        every = block.expert_outputs(x, experts)
        assert slices == [7] * (2 if fused else 3)  # one slice an expert, each with the 12 tokens
        assert every.shape == pairs.shape and mx.array_equal(every, pairs).item()
        slices.clear()
        mx.eval(block.expert_outputs(x[:2], experts[:2]))  # 6 pairs: the pairs' matmuls
        mx.eval(block.expert_outputs(mx.concatenate([x, x[:1]]), mx.concatenate([experts, experts[:1]])))
        assert slices == [6] * (2 if fused else 3) + [39] * (2 if fused else 3)  # 13 tokens: the pairs'
        slices.clear()
        block.dense_from = 30  # from 30 pairs dequantized: a plain gathered matmul, before every expert
        mx.eval(block.expert_outputs(x, experts))
        assert slices == []


@pytest.mark.parametrize("fused", [False, True])
def test_the_grouped_experts_path_gives_each_pair_its_experts_output(fused: bool) -> None:
    """`grouped` (MLX's CUDA build, 4-bit experts the kernel computes): up to `expert_kernel.MAX_ROWS`
    tokens, each projection one `expert_kernel.expert_matmul` call over the flat pairs, gate and up
    reading each pair's token and down each pair's own row. On the CPU that call is MLX's gathered
    matmul (the kernel itself is tested on the GPU, `test_expert_kernel.py`): the same outputs as the
    pairs' path; more tokens take the other paths."""
    mx.random.seed(6)
    block = _quantized_switch(256, 64, 7, 64, fused)
    assert not block.grouped  # not on the CPU build
    x = mx.random.normal((12, 1, 256))
    experts = mx.random.randint(0, 7, (12, 1, 3)).astype(mx.uint32)
    pairs = block.expert_outputs(x, experts)
    block.grouped = True
    calls: list[tuple[int, int]] = []
    real = expert_kernel.expert_matmul

    def counted(rows: mx.array, *args: Any) -> mx.array:
        calls.append((rows.shape[0], args[-1]))
        return real(rows, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_kernel, "expert_matmul", counted)
        grouped = block.expert_outputs(x, experts)
        assert calls == [(12, 3)] * (1 if fused else 2) + [(36, 1)]  # gate/up by token, down by pair
        assert grouped.shape == pairs.shape and mx.array_equal(grouped, pairs).item()
        calls.clear()
        many = expert_kernel.MAX_ROWS + 1
        mx.eval(block.expert_outputs(mx.zeros((many, 1, 256)), mx.zeros((many, 1, 3), dtype=mx.uint32)))
        assert calls == []


def test_the_grouped_kernel_is_used_only_where_it_fits_and_agrees_with_mlx(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`SwitchGLU._kernel_fits` (what `fuse` asks on MLX's CUDA build): every projection a 4-bit affine
    layout with biases the kernel computes (inputs a multiple of 256), and the kernel's results for
    each shape MLX's own (`expert_kernel.agrees`, once per shape; on the CPU `expert_matmul` is MLX's
    matmul, so it agrees). A kernel that fails or disagrees is logged and not used."""
    mx.random.seed(8)
    blocks = {}
    for width in (256, 64):  # down's inputs: 256 fits, 64 does not
        block = moe.SwitchGLU(256, width, 7)
        nn.quantize(block, 64, 4, class_predicate=lambda _p, m: isinstance(m, moe.SwitchLinear))
        block.fuse(top_k=2)
        blocks[width] = block
    assert blocks[256]._kernel_fits(2) and not blocks[64]._kernel_fits(2)
    expert_kernel.agrees.cache_clear()
    monkeypatch.setattr(expert_kernel, "expert_matmul", lambda *args: mx.zeros((6, args[1].shape[1])))
    with caplog.at_level("WARNING"):
        assert not blocks[256]._kernel_fits(2)
    assert "off MLX's matmul" in caplog.text

    def broken(*_args: Any) -> mx.array:
        raise RuntimeError("nvrtc: error")

    expert_kernel.agrees.cache_clear()
    monkeypatch.setattr(expert_kernel, "expert_matmul", broken)
    with caplog.at_level("WARNING"):
        assert not blocks[256]._kernel_fits(2)
    assert "nvrtc: error" in caplog.text
    expert_kernel.agrees.cache_clear()


def test_every_expert_tokens_hold_a_layers_transients_to_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to 256 tokens, fewer where every expert's outputs for a token are large: a token through 7
    experts of width 32 into 64 outputs is 7 x (3 x 32 + 64) float32 = 4,480 bytes."""
    down = moe.QuantizedSwitchLinear(mx.zeros((7, 64, 32)), 32, 4)
    assert moe.every_expert_tokens(down, 32) == moe.EVERY_EXPERT_TOKENS_ON_CUDA == 256
    monkeypatch.setattr(moe, "EVERY_EXPERT_BYTES_ON_CUDA", 10 * 4480 + 100)
    assert moe.every_expert_tokens(down, 32) == 10


def test_dequantized_experts_are_made_layer_by_layer() -> None:
    """A forward through many sparse layers taking the dequantized path holds about one layer's
    dequantized experts at a time, not every layer's (MLX would otherwise make them all first: nothing
    but `after` orders them)."""
    mx.random.seed(4)
    layers = []
    for _ in range(8):
        block = moe.SwitchGLU(256, 512, 8)
        nn.quantize(block, 64, 4, class_predicate=lambda _p, m: isinstance(m, moe.SwitchLinear))
        block.fuse()
        block.dense_from = 1
        layers.append(block)
    x, experts = mx.random.normal((64, 1, 256)), mx.random.randint(0, 8, (64, 2))
    mx.eval([b.parameters() for b in layers], x, experts)

    def forward() -> mx.array:
        h = x
        for block in layers:
            h = block.expert_outputs(h, experts).sum(axis=1, keepdims=True)
        return h

    mx.eval(forward())
    mx.clear_cache()
    mx.reset_peak_memory()
    resident = mx.get_active_memory()
    mx.eval(forward())
    one_layer = 8 * 3 * 512 * 256 * 4  # gate, up and down of 8 experts, float32
    assert mx.get_peak_memory() - resident < 2.5 * one_layer


def test_a_forward_with_dequantized_experts_keeps_the_host_a_layer_ahead(
    moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where sparse layers take the dequantized path from some size on (MLX's CUDA build), a forward of
    that many tokens waits for each layer's output once the next is queued (`llama._fenced`), so the
    host never encodes every layer's dequantized experts before the device has run the first; its
    output is the same, and a smaller forward never waits."""
    engine = Engine.load(str(moe_dir))
    model = engine.model
    assert model.model.fence_tokens is None  # the CPU build multiplies quantized experts as they are
    ids = mx.array([prompt_ids(moe_dir, LONG)[:20]])
    want = model.hidden(ids)
    for layer in model.layers:
        layer.feed_forward.switch_mlp.dense_from = 7  # pairs: 4 tokens of top-2
    model.fuse()
    assert model.model.fence_tokens == 4
    waits: list[int] = []
    real = llama._fenced

    def counted(h: mx.array, queued: mx.array | None) -> mx.array:
        waits.append(h.shape[1])
        return real(h, queued)

    monkeypatch.setattr(llama, "_fenced", counted)
    got = model.hidden(ids)
    assert waits == [20] * (len(model.layers) - 1)  # every layer but the last, whose output is returned
    assert mx.array_equal(got, want)
    waits.clear()
    mx.eval(model.hidden(ids[:, :3]))
    assert waits == []


def _primitives(out: mx.array, tmp_path: Path) -> list[str]:
    """The primitives of the graph behind `out` (not evaluated), by name."""
    mx.export_to_dot(str(tmp_path / "graph.dot"), out)
    return re.findall(r'\[label ="([A-Za-z_]+)', (tmp_path / "graph.dot").read_text())


@pytest.mark.parametrize("quantized", [False, True])
def test_a_sparse_layer_of_one_row_builds_few_primitives(tmp_path: Path, quantized: bool) -> None:
    """A decode step on a GPU is bound by the host's launch of each op: one token's pass through a fused
    sparse layer builds the router's matmul (logits and their negations), the routing (views, sort,
    slice, gather, softmax), the two gathered matmuls read apart by one split and gated, and the
    weighted sum (a view and a matmul, which also adds the block's residual where given): no negation,
    no index MLX would make for the gathered matmuls, no cast, transpose or other reshape."""
    args = moe.ModelArgs.from_dict({**TINY, "vocab_size": 64, **QWEN3_MOE, "num_experts": 16})
    block = moe.SparseMoeBlock(args)
    if quantized:
        nn.quantize(block, 32, 4, class_predicate=lambda _p, m: isinstance(m, (nn.Linear, moe.SwitchLinear)))
    block.fuse()
    x = mx.random.normal((1, 1, 64))
    mx.eval(block.parameters(), x, block(x))  # the first call makes the views it keeps
    ops = _primitives(block(x), tmp_path)
    # MLX folds a plain matmul's leading axes into its rows by two views (a quantized one needs none)
    router = ["QuantizedMatmul"] if quantized else ["Flatten", "Matmul", "Unflatten"]
    gathered = "GatherQMM" if quantized else "GatherMM"
    swiglu = [op for op in ops if op.startswith("Compiled")]  # named by MLX after its parts
    assert len(swiglu) == 1, ops
    # the router's logits and their negations side by side, read apart by two views: no negation
    routing = [*router, "Slice", "Slice", "ArgSort", "Slice", "GatherAxis", "Softmax"]
    experts = [gathered, "Split", swiglu[0], gathered, "Reshape", "Matmul"]
    assert sorted(ops) == sorted(routing + experts), ops
    # a block's residual is added by the weighted sum itself (its transformer block's add): no Add
    added = _primitives(block(x, residual=x), tmp_path)
    assert sorted(added) == sorted([*routing, *experts[:-1], "AddMM"]), added
    np.testing.assert_allclose(np.array(block(x, residual=x)), np.array(x + block(x)), rtol=1e-5, atol=1e-5)


def _dequantized_copy(model: Any, config: dict[str, Any]) -> Any:
    """The same network with every quantized weight (stacked experts too) dequantized to a float one."""
    plain = build_model(config)
    weights = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding, moe.QuantizedSwitchLinear)):
            weights[f"{path}.weight"] = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits
            )
        elif isinstance(module, nn.RMSNorm):
            weights[f"{path}.weight"] = module.weight
    plain.load_weights(list(weights.items()), strict=True)
    return plain


@pytest.mark.parametrize(
    ("arch", "overrides", "block"),
    [("Qwen3MoeForCausalLM", QWEN3_MOE, "mlp"), ("MixtralForCausalLM", MIXTRAL, "block_sparse_moe")],
)
def test_quantized_folder_keeps_stacked_experts_quantized(
    tmp_path: Path, arch: str, overrides: dict[str, Any], block: str
) -> None:
    src = make_hf_checkpoint(tmp_path / "src", arch, **overrides)
    original, config = load_model(src)
    out = save_quantized(original, config, tmp_path / "q", bits=4, group_size=32, copy_from=src)
    stored = load_file(out / "model.safetensors")
    prefix = f"model.layers.0.{block}.switch_mlp"  # mlx-community's names and shapes
    assert stored[f"{prefix}.gate_proj.weight"].dtype == np.uint32
    width = original.layers[0].feed_forward.switch_mlp.width
    assert stored[f"{prefix}.gate_proj.scales"].shape == (5, width, 64 // 32)
    assert stored[f"{prefix}.down_proj.weight"].shape == (5, 64, width * 4 // 32)
    assert f"model.layers.0.{block}.gate.scales" in stored

    model, qconfig = load_model(out)
    switch = model.layers[1].feed_forward.switch_mlp
    assert isinstance(switch.up_proj, moe.QuantizedSwitchLinear) and switch.up_proj.weight.dtype == mx.uint32
    ids = mx.array([prompt_ids(src) * 3], dtype=mx.int32)  # enough (token, expert) pairs to sort
    for few in (ids, ids[:, :5]):
        got = np.array(model(few)[0])
        assert rel_err(got, np.array(_dequantized_copy(model, qconfig)(few)[0])) < 1e-4
    before = np.array(model(ids)[0])
    model.fuse()  # quantized gate and up stacked side by side
    assert isinstance(switch.gate_up_proj, moe.QuantizedSwitchLinear)
    assert rel_err(np.array(model(ids)[0]), before) < 1e-5


def test_a_missing_expert_is_a_checkpoint_error(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "Qwen3MoeForCausalLM", **QWEN3_MOE)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp: .*up_proj.weight of 4 experts.*says 5"):
        load_model(folder)


def test_experts_per_token_beyond_the_experts_is_a_checkpoint_error(moe_dir: Path) -> None:
    config = {**json.loads((moe_dir / "config.json").read_text()), "num_experts_per_tok": 6}
    with pytest.raises(CheckpointError, match="num_experts_per_tok 6"):
        build_model(config)


def _no_eos(engine: Engine) -> dict[int, float]:
    return {i: -100.0 for i in engine.tokenizer.eos_ids}


# Checkpoints run through the engine's batches: the mixtures of experts (DeepSeek-V3's with its latent
# attention), and Phi-3 with LongRoPE (its
# attention factor scales q and k after RoPE, in the batched decode's fused rotation too) and a partial
# rotary factor.
BATCHED = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", QWEN3_MOE),
    "mixtral": ("MixtralForCausalLM", MIXTRAL),
    "deepseek-v3": (  # latent attention: the caches hold the latent and the RoPE key, unequal widths
        "DeepseekV3ForCausalLM",
        {
            **DEEPSEEK_V3_ROUTING,
            "q_lora_rank": 24,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 12,
            "v_head_dim": 10,
            "head_dim": 8,
            "num_key_value_heads": 4,
        },
    ),
    "phi3-longrope-partial": (
        "Phi3ForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.5 * i for i in range(6)],
                "long_factor": [4.0] * 6,
            },
            "original_max_position_embeddings": 128,
        },
    ),
    # sliding windows far shorter than the prompts: every path's masks narrowed, the ragged decode
    # step's rows starting later, a cached prefix restored past the window
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 8}),
    "gemma3": ("Gemma3ForCausalLM", GEMMA3),
}


@pytest.fixture(scope="module", params=sorted(BATCHED))
def batched_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = BATCHED[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return make_hf_checkpoint(folder, arch, max_position_embeddings=1024, **overrides)


@pytest.mark.parametrize("pad_shapes", [False, True])
def test_batched_generation_equals_each_request_alone(batched_dir: Path, pad_shapes: bool) -> None:
    engine = Engine.load(str(batched_dir), EngineOptions(prefill_chunk=16, prefix_cache_bytes=0))
    requests = [
        GenerateRequest.model_validate(
            {
                "prompt": LONG[: 20 + 37 * i] + f"#{i}",
                "max_tokens": 6 + 5 * i,
                "temperature": 0,
                "logit_bias": _no_eos(engine),
            }
        )
        for i in range(5)
    ]
    alone = [generate(engine, r, lambda _t, _i: None) for r in requests]
    assert len({tuple(a.token_ids) for a in alone}) == len(requests)
    batched = Engine.load(
        str(batched_dir), EngineOptions(prefill_chunk=16, prefix_cache_bytes=0, pad_shapes=pad_shapes)
    )
    batch = GenerationBatch(batched, max_sequences=4)
    done: dict[int, Any] = {}
    todo = list(enumerate(requests))
    while todo or len(batch):
        if todo and batch.free_slots > 0:
            i, request = todo.pop(0)
            batch.admit(str(i), request, lambda _t, _i: None, lambda: False)
        for finished in batch.step():
            done[int(finished.key)] = finished
    for i, want in enumerate(alone):
        got = done[i].result
        assert got is not None, done[i].error
        assert got.token_ids == want.token_ids, f"request {i}"


def test_scores_equal_a_full_forward_and_a_warm_prefix_changes_nothing(batched_dir: Path) -> None:
    engine = Engine.load(str(batched_dir), EngineOptions(prefill_chunk=32))
    rows = [
        {"prompt": LONG + "The capital of France is", "candidates": [" the", " a"]},
        {"prompt": LONG + "The capital of Italy is", "candidates": [" is"]},
        {"prompt": "Queues hold jobs", "candidates": [" a", " the"]},
    ]
    request = ScoreRequest.model_validate({"rows": rows})
    cold = engine.score(request)
    for row, got in zip(rows, cold.rows, strict=True):
        ids = engine.tokenizer.encode(str(row["prompt"]))
        logits = engine.model(mx.array([ids]))[0, -1]
        cand = [engine.tokenizer.encode(str(row["prompt"]) + c)[-1] for c in row["candidates"]]  # type: ignore[attr-defined]
        assert got.logits == pytest.approx(logits[mx.array(cand)].tolist(), rel=1e-4, abs=1e-5)
    assert cold.rows[1].cached_tokens > 50  # the shared prefix computed once
    warm = engine.score(request)
    assert warm.cached_tokens > cold.cached_tokens
    for a, b in zip(cold.rows, warm.rows, strict=True):
        assert a.logits == pytest.approx(b.logits, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("pad_shapes", [False, True])
def test_a_prefix_started_ahead_scores_as_without(batched_dir: Path, pad_shapes: bool) -> None:
    """A batch's shared prefix started into the prefix cache before its rows are scored
    (`JobScorer.start`, chunk by chunk; sliding windows narrower than it) leaves every row's scores and
    counts as they are without it."""
    rows = [
        {"prompt": LONG + "The capital of France is", "candidates": [" the", " a"]},
        {"prompt": LONG + "The capital of Italy is", "candidates": [" is"]},
        {"prompt": "Queues hold jobs", "candidates": [" a", " the"]},
    ]
    request = ScoreRequest.model_validate({"rows": rows})
    options = EngineOptions(prefill_chunk=32, pad_shapes=pad_shapes)
    want = Engine.load(str(batched_dir), options).score(request)
    engine = Engine.load(str(batched_dir), options)
    shared = engine.score_requests.shared_start([request])
    assert len(shared) > 64 and engine.scorer.start(shared, engine.prefix_cache) == len(shared)
    got = engine.score(request)
    for a, b in zip(got.rows, want.rows, strict=True):
        assert a.logits == pytest.approx(b.logits, rel=1e-5, abs=1e-6)
        assert (a.input_tokens, a.cached_tokens) == (b.input_tokens, b.cached_tokens)


def test_prefix_cache_reuse_gives_the_same_tokens(batched_dir: Path) -> None:
    engine = Engine.load(str(batched_dir), EngineOptions(prefill_chunk=32))
    request = GenerateRequest.model_validate(
        {"prompt": LONG, "max_tokens": 12, "temperature": 0, "logit_bias": _no_eos(engine)}
    )
    cold = generate(engine, request, lambda _t, _i: None)
    warm = generate(engine, request, lambda _t, _i: None)
    assert (
        cold.usage.cached_tokens == 0 and warm.usage.cached_tokens == len(engine.tokenizer.encode(LONG)) - 1
    )
    assert warm.token_ids == cold.token_ids


@pytest.mark.parametrize(
    ("arch", "config"),
    [
        ("Qwen3MoeForCausalLM", {"num_experts": 5, "moe_intermediate_size": 32}),
        ("MixtralForCausalLM", {"num_local_experts": 5}),  # an expert as wide as intermediate_size (128)
    ],
)
def test_random_checkpoints_write_experts_stacked_and_load_as_they_are(
    tmp_path: Path, arch: str, config: dict[str, Any]
) -> None:
    """What benchmarks run on: experts written stacked (mlx-community's layout), read without stacking."""
    folder = write_random_checkpoint(
        tmp_path, {"architectures": [arch], "num_experts_per_tok": 2, **config}, dtype="bfloat16"
    )
    raw = (folder / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    block = "block_sparse_moe" if arch == "MixtralForCausalLM" else "mlp"
    width = config.get("moe_intermediate_size", 128)
    assert header[f"model.layers.1.{block}.switch_mlp.down_proj.weight"]["shape"] == [5, 64, width]
    model, _ = load_model(folder, dtype="float32")
    assert isinstance(model.layers[1].feed_forward, moe.SparseMoeBlock)
    assert np.isfinite(np.array(model(mx.array([[1, 2, 3, 4]], dtype=mx.int32)))).all()


def test_the_ragged_decode_path_decodes_what_the_mask_path_decodes(
    batched_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode step of left-padded rows that GPUs take (`ragged_kernel`: each row's first column in
    place of a mask; here `decode_attention` computes it with MLX) gives the mask path's tokens, for the
    latent attention's cache (the latent and the RoPE key) and LongRoPE's scaled rotation too."""
    engine = Engine.load(str(batched_dir), EngineOptions(prefix_cache_bytes=0))
    model = engine.model
    calls: list[int] = []
    for module, name in ((attention, "decode_attention"), (deepseek, "ragged_mask")):
        original = getattr(module, name)

        def counted(*a: Any, _original: Any = original, **k: Any) -> mx.array:
            calls.append(1)
            return _original(*a, **k)

        monkeypatch.setattr(module, name, counted)
    ids = engine.tokenizer.encode(LONG)
    prompts = [ids[:n] for n in (7, 30, 55)]

    def start(kernel: bool) -> DecodeBatch:
        batch = DecodeBatch(model, ragged_kernel=kernel)
        caches = [model.make_cache() for _ in prompts]
        logits = [prefill(model, p, c, chunk=16) for p, c in zip(prompts, caches, strict=True)]
        batch.add(
            caches, mx.concatenate(logits), [Sampler(model.args.vocab_size, temperature=0) for _ in prompts]
        )
        return batch

    masked, ragged = start(False), start(True)
    steps = [(masked.step(), ragged.step()) for _ in range(6)]
    assert all(a == b for a, b in steps), steps
    assert len(calls) == 6 * len(model.layers)


def test_a_drawn_quantized_moe_has_the_layout_save_quantized_writes(tmp_path: Path) -> None:
    """The bench's 30B MoE is drawn and quantized tensor by tensor on the device (its bf16 source would
    not fit the GPU host's disk): the folder holds exactly the tensors, shapes and dtypes that quantizing
    a loaded random checkpoint writes, and loads with its experts quantized."""
    from bench.checkpoints import draw_quantized

    config = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 5, "moe_intermediate_size": 64}
    config["num_experts_per_tok"] = 2
    source = write_random_checkpoint(tmp_path / "source", config, dtype="bfloat16")
    model, full_config = load_model(source, dtype="bfloat16")  # as the GPU loads it
    save_quantized(model, full_config, tmp_path / "saved", bits=4)
    drawn = draw_quantized(tmp_path / "drawn", config, "bfloat16", 4)

    def layout(folder: Path) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in mx.load(str(folder / "model.safetensors")).items()}

    assert layout(drawn) == layout(tmp_path / "saved")
    assert json.loads((drawn / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 4}
    loaded, _ = load_model(drawn)
    assert isinstance(loaded.layers[0].feed_forward.switch_mlp.down_proj, moe.QuantizedSwitchLinear)
    assert np.isfinite(np.array(loaded(mx.array([[1, 2, 3, 4]], dtype=mx.int32)).astype(mx.float32))).all()
    assert draw_quantized(tmp_path / "drawn", config, "bfloat16", 4) == drawn  # written once


def test_the_forms_by_dtype_and_pairs() -> None:
    """16-bit inputs take the tensor-core form from `MMA_FROM` pairs where the outputs split into its
    blocks; float32, fewer pairs and other widths the scalar form."""
    assert expert_kernel.form(mx.bfloat16, 2048, 1536, 64, expert_kernel.MMA_FROM) == "mma"
    assert expert_kernel.form(mx.float16, 768, 2048, 32, 256) == "mma"
    assert expert_kernel.form(mx.bfloat16, 2048, 1536, 64, expert_kernel.MMA_FROM - 1) == "scalar"
    assert expert_kernel.form(mx.float32, 2048, 1536, 64, 256) == "scalar"
    assert expert_kernel.form(mx.bfloat16, 2048, 96, 64, 256) == "scalar"
    # rows of many groups are shared among a span's warps, rows of few are not
    assert expert_kernel._mma_layout(2048, 64) is expert_kernel._MMA_SHARED
    assert expert_kernel._mma_layout(768, 64) is expert_kernel._MMA_OWN
    assert expert_kernel._mma_layout(256, 128) is expert_kernel._MMA_OWN
