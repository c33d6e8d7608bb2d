"""A score batch's shared prefix started on the device before its rows are tokenized
(`Engine.start_shared_prefix`): the batch scores as it would without, counts the prefix as computed by
its first row as it would without, and a prefix cached already is not started again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxq.jobs.schema import ScoreRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.engine import START_FROM

DOCUMENT = "The queue holds jobs; the worker takes them, one batch at a time, and writes results. " * 24


def _jobs(tag: str) -> list[ScoreRequest]:
    """Two jobs of candidate rows on one long document (and a short third row of its own)."""
    rows = [
        [
            {
                "prompt": DOCUMENT + f"Question {tag}{j}{i}: what does it hold? It holds",
                "candidates": [" jobs", " a"],
            }
            for i in range(3)
        ]
        for j in range(2)
    ]
    rows[1].append({"prompt": "Short and alone:", "candidates": [" jobs", " a"]})
    return [ScoreRequest.model_validate({"rows": r}) for r in rows]


def _dump(results: list[Any]) -> list[dict[str, Any]]:
    return [r.model_dump(mode="json") for r in results]


@pytest.mark.parametrize("pad_shapes", [False, True], ids=["exact-shapes", "padded-shapes"])
def test_a_started_prefix_scores_as_without_and_counts_as_computed(model_dir: Path, pad_shapes: bool) -> None:
    started = Engine.load(str(model_dir), EngineOptions(pad_shapes=pad_shapes, start_shared_prefix=True))
    plain = Engine.load(str(model_dir), EngineOptions(pad_shapes=pad_shapes))
    jobs = _jobs("a")
    n = started.start_shared_prefix(jobs)
    assert n >= START_FROM
    first = started.score_requests.score_tokens(jobs[0])[0][0]
    assert started.prefix_cache is not None and started.prefix_cache.peek(first) >= n  # held before scoring
    got = started.score_many([started.score_tokens(j) for j in jobs])
    want = plain.score_many([plain.score_tokens(j) for j in jobs])
    for g, w in zip(_dump(got), _dump(want), strict=True):
        assert g["input_tokens"] == w["input_tokens"] and g["cached_tokens"] == w["cached_tokens"]
        for gr, wr in zip(g["rows"], w["rows"], strict=True):
            assert gr["cached_tokens"] == wr["cached_tokens"]  # the first row computed the prefix
            assert gr["logprobs"] == pytest.approx(wr["logprobs"], abs=1e-5)
            assert gr["logits"] == pytest.approx(wr["logits"], abs=1e-4)
    assert got[0].rows[0].cached_tokens == 0 and got[0].rows[1].cached_tokens > START_FROM

    # The same document again: cached, nothing started; the rows count it as cached, as without.
    again = _jobs("b")
    assert started.start_shared_prefix(again) == 0
    second = started.score_many([started.score_tokens(j) for j in again])
    assert second[0].rows[0].cached_tokens > START_FROM


def test_what_is_shared_is_the_first_two_candidate_rows_common_tokens(model_dir: Path) -> None:
    engine = Engine.load(str(model_dir), EngineOptions(start_shared_prefix=True))
    requests = _jobs("c")
    a, b = (engine.tokenizer.encode(requests[0].rows[i].prompt) for i in range(2))
    shared = engine.score_requests.shared_start(requests)
    assert shared == a[: len(shared)] == b[: len(shared)] and a[len(shared)] != b[len(shared)]
    one = ScoreRequest.model_validate({"rows": [requests[0].rows[0].model_dump()]})
    assert engine.score_requests.shared_start([one]) == []  # one row: nothing to hide behind
    assert engine.start_shared_prefix([one]) == 0
    # A prompt twice: all but its last token (whose logits the rows need).
    twice = ScoreRequest.model_validate({"rows": [requests[0].rows[0].model_dump()] * 2})
    assert engine.score_requests.shared_start([twice]) == a[:-1]
    # A job over this worker's limits is passed over.
    too_many = ScoreRequest.model_validate(
        {"rows": [requests[0].rows[0].model_dump()] * (engine.options.max_score_rows + 1)}
    )
    assert engine.score_requests.shared_start([too_many, one]) == []
    # No prefix cache: nothing to start into.
    bare = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0, start_shared_prefix=True))
    assert bare.start_shared_prefix(requests) == 0
    # The CPU build by default: nothing starts (it would compute the prefix before returning).
    default = Engine.load(str(model_dir), EngineOptions())
    assert not default.starts_shared_prefix and default.start_shared_prefix(requests) == 0
