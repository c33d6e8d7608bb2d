"""Warming a drafter's batched forwards up (`draft_warm_up.py`): with padded shapes (a GPU's default), a
drafting generation after the warm-up runs no attention of its draft batch (rows entering their prompts,
rows catching up) of a shape the warm-up did not meet, and its output is plain decoding's; without a
drafter whose rows draft together, or without padding, nothing is warmed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from drafting import PROMPT, assert_same_results, record_draft_attention, run_drafting
from engines import closed_after_test

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.draft_warm_up import catch_up_widths, join_widths, warm_drafts
from mlxq.worker.engine.speculation.draft_model import DraftModel
from mlxq.worker.engine.speculation.mtp import MtpDraft
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.engine.warm_up import WarmUpShapes, warm_up, warm_verify_steps
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

CHUNK = 256  # every prompt here fits a chunk: its draft enters it in one forward


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("target"), {"max_position_embeddings": 1024})


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("draft"), {"max_position_embeddings": 1024, "num_hidden_layers": 2}, seed=3
    )


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.checkpoints import checkpoint

    return checkpoint("tiny-deepseek-mtp", tmp_path_factory.mktemp("mtp"))


def _engine(model: Path, **options: Any) -> Engine:
    settings: dict[str, Any] = {"prefill_chunk": CHUNK, "prefix_cache_bytes": 0, "dtype": "float32"}
    return closed_after_test(Engine.load(str(model), EngineOptions(**settings, **options)))


def _requests(engine: Engine) -> list[GenerateRequest]:
    """Prompts of 14 to 230 tokens (the longest's context grows past a cache step), 40 tokens each."""
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    return [
        GenerateRequest(prompt=PROMPT * k + f"#{i}", max_tokens=40, temperature=0, logit_bias=no_eos)
        for i, k in enumerate((1, 17, 3, 7, 2))
    ]


@pytest.mark.parametrize("kind", ["draft_model", "mtp"])
def test_a_drafting_generation_after_the_warm_up_meets_no_draft_shape_first(
    kind: str, target: Path, draft_dir: Path, mtp_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows joining one a step, up to the policy's three, drafting with a draft model or an MTP layer
    (random: few drafts kept, so rows stop drafting and retry, catching up several tokens) past a cache
    step of context: every attention over several queries their draft batch runs has a shape (rows,
    queries, key columns) the warm-up ran, and they decode as plain decoding does."""
    model = mtp_model if kind == "mtp" else target
    policy = DraftPolicy(max_depth=3, max_batch=3, min_acceptance=0.9, retry_every=3, only_likely=False)
    folder = {"draft_model": str(draft_dir)} if kind == "draft_model" else {}
    engine = _engine(model, speculation=kind, draft_policy=policy, pad_shapes=True, **folder)
    met = record_draft_attention(monkeypatch)
    warm_verify_steps(engine, WarmUpShapes(max_sequences=4, verify_columns=512))
    warmed = set(met)
    assert max(rows for rows, _, _ in warmed) == 4  # three rows joining at once: padded to four
    met.clear()

    requests = _requests(engine)
    got = run_drafting(engine, requests, max_sequences=3)
    assert_same_results(run_drafting(_engine(model), requests, max_sequences=3), got)
    assert sum(r.result.usage.draft_tokens for r in got.values() if r.result) > 0
    assert {columns for _, queries, columns in met if queries < 16} >= {256, 512}  # catch-ups, two steps
    assert met <= warmed, sorted(met - warmed)


def test_the_warm_up_runs_the_drafts_part_where_a_draft_batch_pads_shapes(
    target: Path, draft_dir: Path
) -> None:
    """`warm_up` times a `drafts` part with a draft model and padded shapes; not without padding (every
    shape is new anyway and builds nothing) nor with prompt lookup (nothing drafts together)."""
    shapes = WarmUpShapes(max_sequences=2, verify_columns=256)
    padded = _engine(target, speculation="draft_model", draft_model=str(draft_dir), pad_shapes=True)
    assert warm_up(padded, shapes)["drafts"] > 0
    unpadded = _engine(target, speculation="draft_model", draft_model=str(draft_dir), pad_shapes=False)
    assert warm_drafts(unpadded, 2, 256) == 0 and "drafts" not in warm_up(unpadded, shapes)
    lookup = _engine(target, speculation="prompt_lookup", pad_shapes=True)
    assert warm_drafts(lookup, 2, 256) == 0


def test_the_widths_warmed(target: Path, draft_dir: Path, mtp_model: Path) -> None:
    """A draft model's joining prompts are padded as the engine's prefills (`padded_width`), an MTP
    batch's to powers of two, both within a chunk; catch-ups up to a lag of a retry's wait."""
    draft = _engine(target, speculation="draft_model", draft_model=str(draft_dir)).draft_choice.draft
    mtp = _engine(mtp_model, speculation="mtp").draft_choice.draft
    assert isinstance(draft, DraftModel) and isinstance(mtp, MtpDraft)
    assert join_widths(draft, 256) == [16, 32, 64, 128, 192, 256]
    assert join_widths(draft, 100) == [16, 32, 64, 100]
    assert join_widths(mtp, 256) == [2, 4, 8, 16, 32, 64, 128, 256]
    assert catch_up_widths(DraftPolicy(retry_every=16)) == [2, 4, 8, 16, 32]
    assert catch_up_widths(DraftPolicy(retry_every=1)) == [2, 4]
