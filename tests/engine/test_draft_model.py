"""A separate draft model drafts for a generation batch: found beside the target or named, checked
against the target's tokenizer, its cache per row rolled back with the target's.

The target drafting for itself keeps every drafted token (greedy): the machinery's ceiling, and a check
that each row's draft cache follows the row exactly (one token out of step and the drafts would miss).
Any draft leaves the output as plain decoding gives it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from engines import closed_after_test, run_requests

from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.speculation.draft_model import DraftMismatch
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.modelfiles.tiny_model import build_tokenizer, write_random_checkpoint

PROMPT = "The capital of France is Paris. "


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("target"), {"max_position_embeddings": 512})


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller draft with other weights and the target's tokenizer."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("draft"), {"max_position_embeddings": 512, "num_hidden_layers": 1}, seed=3
    )


def _engine(model: Path, **options: Any) -> Engine:
    return closed_after_test(
        Engine.load(str(model), EngineOptions(prefill_chunk=16, prefix_cache_bytes=0, **options))
    )


def _drafting(model: Path, **options: Any) -> Engine:
    policy = DraftPolicy(min_acceptance=0.0, max_batch=64)
    return _engine(model, speculation="draft_model", draft_policy=policy, **options)


def _run(engine: Engine, requests: list[GenerateRequest], max_sequences: int) -> list[GenerateResult]:
    return run_requests(engine, requests, max_sequences, one_per_step=True)


def _requests(engine: Engine) -> list[GenerateRequest]:
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    return [
        GenerateRequest(
            prompt=PROMPT * (1 + i % 2) + f"#{i}", max_tokens=6 + 7 * i, temperature=0, logit_bias=no_eos
        )
        for i in range(4)
    ]


def test_the_target_as_its_own_draft_beside_it_keeps_every_drafted_token(
    target: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(target, model)
    shutil.copytree(target, model / "draft")  # found where the ollama runner stores a draft
    plain = _engine(target)
    requests = _requests(plain)
    expected = _run(plain, requests, max_sequences=3)
    got = _run(_drafting(model), requests, max_sequences=3)
    for a, b in zip(expected, got, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert b.usage.draft_tokens > 0 and b.usage.accepted_tokens == b.usage.draft_tokens


def test_another_draft_named_by_the_setting_leaves_the_output_unchanged(
    target: Path, other_draft: Path
) -> None:
    plain = _engine(target)
    requests = _requests(plain)
    sampled = requests[0].model_copy(update={"temperature": 0.8, "seed": 5, "max_tokens": 12})
    expected = _run(plain, requests, max_sequences=4)
    got = _run(_drafting(target, draft_model=str(other_draft)), [*requests, sampled], max_sequences=4)
    for a, b in zip(expected, got[:-1], strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert sum(r.usage.draft_tokens for r in got) > 0
    assert len(got[-1].token_ids) == 12  # a sampled row verifies drafts too, and ends as it should


def test_a_draft_with_another_tokenizer_or_architecture_or_none_is_refused_clearly(
    target: Path, tmp_path: Path
) -> None:
    wrong = write_random_checkpoint(tmp_path / "wrong", {"max_position_embeddings": 512})
    build_tokenizer(wrong, vocab_size=300)  # the same ids mean other tokens
    with pytest.raises(DraftMismatch, match="another tokenizer than the target"):
        _drafting(target, draft_model=str(wrong))
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "architectures": ["MadeUpDrafter"]}))
    with pytest.raises(DraftMismatch, match=r"MadeUpDrafter.*supported: .*LlamaForCausalLM"):
        _drafting(target, draft_model=str(wrong))
    with pytest.raises(DraftMismatch, match="needs a draft model"):
        _drafting(target)
