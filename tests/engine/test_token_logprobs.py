"""Generated-token logprobs (`token_logprobs.py`) against torch's log-softmax and top-k, and a
generation's logprobs against transformers' model (float32, CPU, tiny random checkpoint)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from reference import hf_logits, load_hf_model, make_hf_checkpoint

from mlxq.jobs.schema import (
    GeneratedLogprob,
    GenerateRequest,
    GenerateResult,
    TokenEvent,
    TopLogprob,
    parse_event,
)
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.generation_batch import GenerationBatch, generate
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.engine.token_logprobs import step_logprobs
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

V = 97


def _logits(rows: int, seed: int = 0) -> np.ndarray:
    return (4.0 * np.random.default_rng(seed).standard_normal((rows, V))).astype(np.float32)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_chosen_and_top_match_torch(rows: list[int]) -> None:
    logits = _logits(4)
    tokens = np.array([5, 17, 0, 96], dtype=np.int32)
    ks = [(3 * j + 1) % 21 for j in range(len(rows))]
    step = step_logprobs(mx.array(logits), mx.array(tokens), rows, ks)
    mx.eval(step.arrays())
    got = step.read(dict(enumerate(tokens.tolist())))
    ref = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    assert sorted(got) == rows
    for row, k in zip(rows, ks, strict=True):
        lp = got[row]
        assert lp.id == int(tokens[row])
        assert abs(lp.logprob - float(ref[row, tokens[row]])) < 1e-4
        values, ids = torch.topk(ref[row], k)
        assert [i for i, _ in lp.top] == ids.tolist()
        np.testing.assert_allclose([p for _, p in lp.top], values.numpy(), atol=1e-4)


def test_zero_alternatives_still_reports_the_chosen_token() -> None:
    logits = _logits(2, seed=1)
    step = step_logprobs(mx.array(logits), mx.array([3, 4], dtype=mx.int32), [0, 1], [0, 0])
    mx.eval(step.arrays())
    got = step.read({0: 3, 1: 4})
    ref = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    assert got[0].top == [] and got[1].top == []
    assert abs(got[1].logprob - float(ref[1, 4])) < 1e-4


def test_bfloat16_logits_are_widened() -> None:
    logits = _logits(1, seed=2)
    step = step_logprobs(mx.array(logits).astype(mx.bfloat16), mx.array([7], dtype=mx.int32), [0], [2])
    mx.eval(step.arrays())
    assert step.chosen.dtype == mx.float32 and step.top_logprobs.dtype == mx.float32


def test_no_rows_is_an_error() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        step_logprobs(mx.array(_logits(1)), mx.array([0], dtype=mx.int32), [], [])


# --- generation's logprobs against transformers -------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def hf_model(hf_folder: Path) -> torch.nn.Module:
    return load_hf_model(hf_folder)


def _request(i: int, eos: list[int]) -> GenerateRequest:
    """Ragged prompts, greedy and seeded sampling (filters and a bias that the logprobs ignore)."""
    sampled = {"temperature": 1.3, "top_k": 12, "seed": 7 + i} if i % 2 else {"temperature": 0.0}
    return GenerateRequest.model_validate(
        {
            "prompt": "The capital of France is Paris. " * (1 + i) + f"#{i}",
            "max_tokens": 6 + 3 * i,
            "logit_bias": dict.fromkeys(eos, -100.0),
            "logprobs": [0, 3, 5, 20][i % 4],
            **sampled,
        }
    )


def _check_against_hf(
    model: torch.nn.Module, engine: Engine, request: GenerateRequest, result: GenerateResult
) -> None:
    prompt = engine.prompt_tokens(request)
    ids = result.token_ids
    assert result.logprobs is not None and len(result.logprobs) == len(ids) > 0
    ref = torch.log_softmax(torch.from_numpy(hf_logits(model, prompt + ids)), dim=-1)
    for j, (token, lp) in enumerate(zip(ids, result.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]  # the model's raw distribution the token was drawn from
        assert lp.id == token
        assert abs(lp.logprob - float(row[token])) < 1e-4
        k = request.logprobs or 0
        values, top = torch.topk(row, k)
        assert len(lp.top) == k
        np.testing.assert_allclose([a.logprob for a in lp.top], values.numpy(), atol=1e-4)
        # ids agree except where two alternatives tie within the tolerance
        for a, want, v in zip(lp.top, top.tolist(), values.tolist(), strict=True):
            assert a.id == want or abs(float(row[a.id]) - v) < 1e-4
            assert a.text == engine.tokenizer.decode([a.id])
        assert lp.text == engine.tokenizer.decode([token])


@pytest.mark.parametrize(
    ("prefix_cache", "pad_shapes", "overlap"),
    [(False, False, False), (True, False, False), (True, True, True)],
)
def test_batched_ragged_rows_report_transformers_logprobs(
    hf_folder: Path, hf_model: torch.nn.Module, prefix_cache: bool, pad_shapes: bool, overlap: bool
) -> None:
    """Rows join at once and leave one by one (ragged budgets); with the overlap, steps launch on the
    launcher's thread and the logprobs are read back from that launch, as on a GPU."""
    engine = Engine.load(
        str(hf_folder),
        EngineOptions(
            prefill_chunk=16,
            prefix_cache_bytes=(1 << 26) * prefix_cache,
            pad_shapes=pad_shapes,
            decode_overlap=overlap,
        ),
    )
    try:
        requests = [_request(i, list(engine.tokenizer.eos_ids)) for i in range(4)]
        rounds = 2 if prefix_cache else 1  # the second round's prompts come from the warm prefix cache
        for _ in range(rounds):
            results = _run_batch(engine, requests)
            for request, result in zip(requests, results, strict=True):
                _check_against_hf(hf_model, engine, request, result)
        if prefix_cache:
            assert results[3].usage.cached_tokens > 0
    finally:
        engine.close()


def _run_batch(engine: Engine, requests: list[GenerateRequest]) -> list[GenerateResult]:
    batch = GenerationBatch(engine, max_sequences=len(requests))
    for i, request in enumerate(requests):
        batch.admit(str(i), request, lambda text, ids: None, lambda: False)
    results: dict[str, GenerateResult] = {}
    while len(results) < len(requests):
        for done in batch.step():
            assert done.error is None and done.result is not None
            results[done.key] = done.result
    batch.settle()
    batch.close()
    return [results[str(i)] for i in range(len(requests))]


@pytest.fixture(scope="module")
def looping_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny checkpoint: its greedy text repeats itself, so prompt lookup drafts."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 512})


def test_rows_with_logprobs_beside_drafting_rows_and_constrained_rows(looping_folder: Path) -> None:
    """Speculation on: a row asking logprobs takes plain steps inside verify steps (its batch-mate
    drafts) and reports the model's logprobs; a constrained row reports the raw model's, not the
    grammar-masked distribution it draws from."""
    options = EngineOptions(
        prefill_chunk=16,
        prefix_cache_bytes=0,
        speculation="prompt_lookup",
        draft_policy=DraftPolicy(min_acceptance=0.0),
    )
    engine = Engine.load(str(looping_folder), options)
    hf_model = load_hf_model(looping_folder)
    try:
        eos = dict.fromkeys(engine.tokenizer.eos_ids, -100.0)
        echo = "The capital of France is Paris. " * 2
        drafting = GenerateRequest(prompt=echo, max_tokens=40, temperature=0.0, logit_bias=eos)
        asking = GenerateRequest(prompt=echo, max_tokens=40, temperature=0.0, logit_bias=eos, logprobs=4)
        regex = {"type": "regex", "regex": "[0-9]{4}-[0-9]{2}"}
        constrained = GenerateRequest.model_validate(
            {"prompt": "Date:", "max_tokens": 12, "temperature": 0.0, "response_format": regex, "logprobs": 2}
        )
        results = _run_batch(engine, [drafting, asking, constrained])
        assert results[0].usage.draft_tokens > 0 and results[1].usage.draft_tokens == 0
        assert results[1].token_ids == results[0].token_ids  # plain steps give the drafted tokens
        _check_against_hf(hf_model, engine, asking, results[1])
        _check_against_hf(hf_model, engine, constrained, results[2])
    finally:
        engine.close()


def test_a_lone_row_without_logprobs_has_none_and_one_with_them_streams_them(hf_folder: Path) -> None:
    engine = Engine.load(str(hf_folder), EngineOptions(prefill_chunk=16, prefix_cache_bytes=0))
    try:
        plain = generate(
            engine, GenerateRequest(prompt="Hello", max_tokens=4, temperature=0.0), lambda t, i: None
        )
        assert plain.logprobs is None and "logprobs" not in plain.model_dump()
        sink = _LogprobSink()
        asked = generate(
            engine, GenerateRequest(prompt="Hello", max_tokens=4, temperature=0.0, logprobs=2), sink
        )
        assert asked.logprobs is not None
        assert sink.ids == asked.token_ids
        assert sink.got == asked.logprobs
    finally:
        engine.close()


class _LogprobSink:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.got: list[GeneratedLogprob] = []

    def __call__(self, text: str, ids: list[int]) -> None:
        self.ids += ids

    def logprobs(self, items: list[GeneratedLogprob]) -> None:
        self.got += items


def test_a_token_event_carries_its_logprobs_through_a_stream_entry() -> None:
    top = [TopLogprob(id=5, logprob=-0.25, text="hi"), TopLogprob(id=9, logprob=-1.5, text="ho")]
    logprobs = [GeneratedLogprob(id=5, logprob=-0.25, text="hi", top=top)]
    event = TokenEvent(text="hi", ids=[5], index=0, logprobs=logprobs)
    assert parse_event(event.fields()) == event
    plain = TokenEvent(text="hi", ids=[5], index=0)
    assert "logprobs" not in plain.fields() and parse_event(plain.fields()) == plain
