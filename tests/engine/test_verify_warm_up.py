"""Warming a drafting engine's verify steps up: every shape a drafting batch meets first is met in the
warm-up, noted as met for the draft gate, and nothing it leaves changes what jobs decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engines import closed_after_test

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.generation_batch import GenerationBatch
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.engine.warm_up import WarmUpShapes, verify_widths, warm_up
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

PROMPT = "The capital of France is Paris. "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 1024})


def _engine(model_dir: Path, **options: Any) -> Engine:
    return closed_after_test(
        Engine.load(str(model_dir), EngineOptions(prefill_chunk=64, prefix_cache_bytes=0, **options))
    )


def _decode(engine: Engine, requests: list[GenerateRequest]) -> list[list[int]]:
    batch = GenerationBatch(engine, max_sequences=len(requests))
    for i, request in enumerate(requests):
        batch.admit(str(i), request, lambda _t, _ids: None, lambda: False)
    tokens: dict[str, list[int]] = {}
    while len(batch):
        for done in batch.step():
            assert done.error is None and done.result is not None, done.error
            tokens[done.key] = list(done.result.token_ids)
    batch.close()
    return [tokens[str(i)] for i in range(len(requests))]


def test_warm_up_meets_each_verify_shape_so_a_drafting_batch_meets_none_first(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With padded shapes (a GPU's default) the warm-up runs a verify step of each batch size that may
    draft, each padded width, each cache step of key columns up to `verify_columns`; the batches that
    follow meet no verify shape first, and decode as plain decoding does."""
    policy = DraftPolicy(max_depth=3, max_run=7, max_batch=2, min_acceptance=0.0, only_likely=False)
    engine = _engine(model_dir, speculation="prompt_lookup", draft_policy=policy, pad_shapes=True)
    assert verify_widths(engine) == [2, 4, 8]  # a pending token and up to 7 copied tokens, padded
    seconds = warm_up(engine, WarmUpShapes(max_sequences=4, verify_columns=512))
    assert seconds["verify"] > 0
    warmed = {(rows, width, columns) for rows in (1, 2) for width in (2, 4, 8) for columns in (256, 512)}
    assert warmed <= engine.verify_shapes, sorted(warmed - engine.verify_shapes)
    assert all(rows <= 2 for rows, _, _ in engine.verify_shapes)  # no size the policy lets draft more

    met_first: list[bool] = []
    original = DecodeBatch.verify_with

    def noted(self: DecodeBatch, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if self.verify_step.verified:
            met_first.append(self.verify_step.new_shape)
        return out

    monkeypatch.setattr(DecodeBatch, "verify_with", noted)
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    requests = [
        GenerateRequest(prompt=PROMPT * (4 + 3 * i), max_tokens=40, temperature=0, logit_bias=no_eos)
        for i in range(2)
    ]
    plain = _engine(model_dir)
    assert _decode(engine, requests) == _decode(plain, requests)
    assert met_first and not any(met_first)


def test_no_verify_warm_up_without_speculation_or_padded_shapes(model_dir: Path) -> None:
    """Unpadded (the CPU's default) every verify step's shape is new anyway and builds nothing: none are
    warmed; without speculation there are none."""
    shapes = WarmUpShapes(max_sequences=2, verify_columns=256)
    unpadded = _engine(model_dir, speculation="prompt_lookup", pad_shapes=False)
    assert "verify" not in warm_up(unpadded, shapes) and not unpadded.verify_shapes
    off = _engine(model_dir, pad_shapes=True)
    assert "verify" not in warm_up(off, shapes) and not off.verify_shapes
