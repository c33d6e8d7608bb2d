"""Quantized layers with dense copies for many rows (`worker/engine/models/quantized_rows.py`).

The copy is the layer's own weight dequantized, so on the CPU (float32) both paths give the same
numbers: a model answers the same with or without copies, whichever path each call takes, and a
batched job (many rows: the copies) generates exactly the tokens it generates alone (one row: the
quantized kernel).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.generation_batch import GenerationBatch, generate
from mlxq.worker.engine.models.loader import load_config, load_model, save_quantized
from mlxq.worker.engine.models.quantized_rows import (
    DenseRowsEmbedding,
    DenseRowsLinear,
    FusedDenseRows,
    _planned_bytes,
    dense_rows_by_default,
    use_dense_rows,
    with_rows_negated,
)
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint
from mlxq.worker.settings import WorkerSettings


@pytest.fixture(scope="module", params=[False, True], ids=["lm_head", "tied"])
def quantized_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = write_random_checkpoint(
        tmp_path_factory.mktemp("float"),
        {"max_position_embeddings": 512, "tie_word_embeddings": request.param},
    )
    model, _ = load_model(src)
    return save_quantized(model, load_config(src), tmp_path_factory.mktemp("q4"), bits=4, copy_from=src)


def _ids(n_rows: int, n: int) -> mx.array:
    return mx.array([[(7 * r + 3 * i) % 200 + 1 for i in range(n)] for r in range(n_rows)], dtype=mx.int32)


def test_copies_answer_as_the_quantized_layers(quantized_dir: Path) -> None:
    plain = Engine.load(str(quantized_dir), EngineOptions(dense_rows=0)).model
    dense = Engine.load(str(quantized_dir), EngineOptions(dense_rows=4)).model
    attn, mlp = dense.model.layers[0].self_attn, dense.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, FusedDenseRows) and isinstance(mlp.gate_up_proj, FusedDenseRows)
    assert isinstance(attn.o_proj, DenseRowsLinear) and isinstance(mlp.down_proj, DenseRowsLinear)
    # the fused copy replaced the parts' own; for few rows the parts are one quantized layer
    assert type(attn.qkv_proj.quantized) is nn.QuantizedLinear and not attn.qkv_proj.parts
    assert type(plain.model.layers[0].self_attn.qkv_proj) is nn.QuantizedLinear  # fused alone too
    head = dense.model.embed_tokens if dense.args.tie_word_embeddings else dense.lm_head
    assert isinstance(head, DenseRowsEmbedding if dense.args.tie_word_embeddings else DenseRowsLinear)
    # 1 and 3 rows: the quantized kernels; 2 x 8 and 6 x 5 rows: the copies.
    for ids in (_ids(1, 1), _ids(1, 3), _ids(2, 8), _ids(6, 5)):
        expected, got = np.array(plain(ids)), np.array(dense(ids))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_copies_are_no_parameters(quantized_dir: Path) -> None:
    model, _ = load_model(quantized_dir)
    before = {k: v.shape for k, v in tree_flatten(model.parameters())}
    added = use_dense_rows(model, 8, mx.float32)
    assert added > 0
    assert {k: v.shape for k, v in tree_flatten(model.parameters())} == before  # saving writes no copy
    assert use_dense_rows(model, 8, mx.float32) == 0  # already done: nothing more
    with pytest.raises(ValueError, match="min_rows"):
        use_dense_rows(model, 0, mx.float32)


def test_copies_over_budget_are_not_made(quantized_dir: Path) -> None:
    model, _ = load_model(quantized_dir)
    planned = _planned_bytes(model, mx.float32)
    assert use_dense_rows(model, 8, mx.float32, max_bytes=planned - 1) == 0
    assert type(model.model.layers[0].mlp.down_proj) is nn.QuantizedLinear  # nothing changed
    assert use_dense_rows(model, 8, mx.float32, max_bytes=planned) == planned  # the estimate is exact
    assert _planned_bytes(model, mx.float32) == 0  # nothing quantized is left without its copy


def test_unquantized_model_is_left_alone(tmp_path: Path) -> None:
    model, _ = load_model(write_random_checkpoint(tmp_path / "f", {}))
    assert use_dense_rows(model, 1, mx.float32) == 0
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear


def test_generation_batch_decodes_through_the_copies(
    quantized_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step of 4 rows multiplies by the copies, a job alone by the quantized kernels. (Their
    sums run in different orders, as a quantized kernel's do for 1 and 4 rows: this chaotic random model
    then picks other tokens, so only the layers' outputs are compared, above.)"""
    engine = Engine.load(str(quantized_dir), EngineOptions(dense_rows=2, prefix_cache_bytes=0))
    rows_seen: list[tuple[int, bool]] = []
    apart = FusedDenseRows.apart

    def counted(self: FusedDenseRows, x: mx.array) -> bool:
        rows_seen.append((x.size // x.shape[-1], x.ndim == 2 or x.shape[1] == 1))  # 2-D: a flat step
        return apart(self, x)

    monkeypatch.setattr(FusedDenseRows, "apart", counted)
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    requests = [
        GenerateRequest(prompt="The capital of France is" + " Paris." * i, max_tokens=12, logit_bias=no_eos)
        for i in range(4)
    ]
    batch = GenerationBatch(engine, max_sequences=4)
    for i, r in enumerate(requests):
        batch.admit(str(i), r, lambda _t, _ids: None, lambda: False)
    done = {}
    while len(batch):
        for f in batch.step():
            done[int(f.key)] = f
    assert sorted(done) == [0, 1, 2, 3]
    assert all(f.result is not None and f.result.usage.completion_tokens == 12 for f in done.values())
    assert any(rows >= 2 and decode for rows, decode in rows_seen)  # batched decode steps: the copies
    rows_seen.clear()
    generate(engine, requests[0], lambda _t, _ids: None)
    assert any(rows == 1 and decode for rows, decode in rows_seen)  # alone: the quantized kernels


def test_setting_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXQ_DENSE_ROWS", "16")
    assert WorkerSettings(model="m").dense_rows == 16
    monkeypatch.setenv("MLXQ_DENSE_ROWS", "-1")
    with pytest.raises(ValueError, match="dense_rows"):
        WorkerSettings(model="m")
    monkeypatch.delenv("MLXQ_DENSE_ROWS")
    assert WorkerSettings(model="m").dense_rows is None
    assert dense_rows_by_default() == 0  # the CPU: quantized kernels only


@pytest.mark.parametrize("dense_rows", [False, True])
def test_a_layer_with_its_rows_negated_gives_its_outputs_then_their_negations(dense_rows: bool) -> None:
    """A MoE router's logits and their negations from one matmul (`moe.SparseMoeBlock.fuse`): exactly
    the layer's outputs, then the same negated, through the quantized kernel (few rows) and, with dense
    copies, through the copy (many rows)."""
    mx.random.seed(5)
    holder = nn.Sequential(nn.Linear(64, 12, bias=False))
    nn.quantize(holder, 32, 4)
    if dense_rows:
        use_dense_rows(holder, 4, mx.float32)
    layer = holder.layers[0]
    signed = with_rows_negated(layer)
    assert signed is not None and type(signed) is type(layer)
    for rows in (1, 6):  # 6: the dense copy where there is one
        x = mx.random.normal((rows, 64))
        want = layer(x)
        got = signed(x)
        assert np.array_equal(np.array(got[:, :12]), np.array(want))
        assert np.array_equal(np.array(got[:, 12:]), -np.array(want))
    assert with_rows_negated(nn.Linear(8, 4)) is None  # plain layers: `moe._signed_router`'s own
