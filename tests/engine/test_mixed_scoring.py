"""One scorer, two heads: candidate rows and token-by-token rows in one batch share their prefixes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.jobs.schema import ScoreRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.scoring import CandidateHead, PrefixScorer
from mlxq.worker.engine.token_scoring import TokenHead, TokenSeq

FEW_SHOT = "Question: what do queues hold? Answer: jobs.\n" * 4


def _rows(i: int) -> list[dict[str, Any]]:
    return [
        {"prompt": FEW_SHOT + f"Question {i}: which is it? It is", "candidates": [" the", " a"]},
        {"prompt": FEW_SHOT + f"Question {i}: what runs? Answer:", "continuations": [" jobs", " models"]},
        {"prompt": FEW_SHOT + f"Question {i}: done.", "prompt_logprobs": True, "top_logprobs": 2},
    ]


@pytest.mark.parametrize("pad_shapes", [False, True], ids=["exact-shapes", "padded-shapes"])
def test_a_mixed_batch_scores_as_each_row_alone_and_computes_the_prefix_once(
    model_dir: Path, pad_shapes: bool
) -> None:
    """With padded shapes (a GPU's default, forced here) too: right padding changes no real position."""
    engine = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0, pad_shapes=pad_shapes))
    rows = _rows(1)
    mixed = engine.score(ScoreRequest.model_validate({"rows": rows}))
    exact = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0, pad_shapes=False))
    alone = [exact.score(ScoreRequest.model_validate({"rows": [row]})).rows[0] for row in rows]
    cand, cont, prompt = mixed.rows
    assert cand.logits == pytest.approx(alone[0].logits, abs=1e-5)
    assert cand.logprobs == pytest.approx(alone[0].logprobs, abs=1e-5)
    assert cont.continuations is not None and alone[1].continuations is not None
    for a, b in zip(cont.continuations, alone[1].continuations, strict=True):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
        assert a.is_greedy == b.is_greedy
    assert prompt.prompt_logprobs is not None and alone[2].prompt_logprobs is not None
    assert prompt.prompt_logprobs.token_logprobs == pytest.approx(
        alone[2].prompt_logprobs.token_logprobs, abs=1e-5
    )
    assert [[t.id for t in top] for top in prompt.prompt_logprobs.top_logprobs] == [
        [t.id for t in top] for top in alone[2].prompt_logprobs.top_logprobs
    ]
    # The few-shot prefix is computed by the candidate row only: the other kinds find it shared.
    shared = len(engine.tokenizer.encode(FEW_SHOT)) - 2  # its last tokens may merge with what follows
    assert cand.cached_tokens == 0
    assert cont.cached_tokens >= 2 * shared and prompt.cached_tokens >= shared
    assert mixed.cached_tokens > sum(r.cached_tokens for r in alone) + 2 * shared


def test_a_position_both_heads_need_goes_through_the_lm_head_once(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0))
    model = engine.model
    context = engine.tokenizer.encode(FEW_SHOT + "Question: what runs? Answer:")
    continuation = engine.tokenizer.encode(" jobs and models", add_special_tokens=False)
    head_rows: list[int] = []
    logits = model.logits

    def recorded(hidden: mx.array) -> mx.array:
        head_rows.append(int(hidden.shape[0]))
        return logits(hidden)

    monkeypatch.setattr(model, "logits", recorded)
    candidates = CandidateHead([context])
    tokens = TokenHead([TokenSeq(context + continuation, len(context))])
    computed = PrefixScorer(model, min_shared=4).score([candidates, tokens])
    # The context's last position serves the candidate row and the continuation's first token.
    assert sum(head_rows) == len(continuation)
    assert computed == [[len(context)], [len(continuation) - 1]]
    full = logits(model.hidden(mx.array([context + continuation]), cache=model.make_cache()))[0]
    full = full.astype(mx.float32)
    assert candidates.logits[0] is not None
    assert mx.allclose(candidates.logits[0], full[len(context) - 1], atol=1e-4).item()
    lp = full - mx.logsumexp(full, axis=-1, keepdims=True)
    want = [lp[len(context) - 1 + i, t].item() for i, t in enumerate(continuation)]
    assert tokens.scores[0].logprobs == pytest.approx(want, abs=1e-4)
