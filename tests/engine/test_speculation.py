"""Speculative decoding in generation batches: prompt lookup drafts, one verify forward per step, each
row keeps what the target agrees with.

Lossless is the claim held here: greedy requests give exactly the tokens, text, stream and finish of
plain decoding (float32 on the CPU, tiny random-weight model whose greedy output loops, so lookup
proposes and some proposals are kept), whoever the batch-mates are; sampled requests follow the
distribution plain steps draw from (a chi-square test over many seeded draws).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from engines import assert_same_draws, closed_after_test
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine import launcher as launchers
from mlxq.worker.engine.cache.batch_cache import BatchKVCache, whole_steps
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.generation_batch import Finished, GenerationBatch, generate
from mlxq.worker.engine.launcher import Launcher
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.sampler_rows import SamplerRows
from mlxq.worker.engine.speculation.draft_choice import DraftChoice
from mlxq.worker.engine.speculation.draft_gate import DraftGate
from mlxq.worker.engine.speculation.draft_model import DraftTarget
from mlxq.worker.engine.speculation.policy import DraftPolicy, RowSpeculation
from mlxq.worker.engine.speculation.prompt_lookup import PromptLookup
from mlxq.worker.engine.speculation.row_tokens import RowTokens
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

PROMPT = "The capital of France is Paris. "
TEMPERATURE = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 512})


def _engine(model_dir: Path, **options: Any) -> Engine:
    return closed_after_test(
        Engine.load(str(model_dir), EngineOptions(prefill_chunk=16, prefix_cache_bytes=0, **options))
    )


@pytest.fixture
def plain(model_dir: Path) -> Engine:
    return _engine(model_dir)


@pytest.fixture
def spec(model_dir: Path) -> Engine:
    """Prompt lookup on every step a row finds a match (the policy never turns it down)."""
    policy = DraftPolicy(min_acceptance=0.0, only_likely=False)  # verify steps at every step
    return _engine(model_dir, speculation="prompt_lookup", draft_policy=policy)


def _no_eos(engine: Engine) -> dict[int, float]:
    return {i: -100.0 for i in engine.tokenizer.eos_ids}


def _run(
    engine: Engine, requests: list[GenerateRequest], max_sequences: int
) -> tuple[dict[int, Finished], dict[int, list[list[int]]]]:
    """Admit requests as slots free up, one per step; run until all finish. Returns the results and the
    ids of each sink call."""
    batch = GenerationBatch(engine, max_sequences=max_sequences)
    done: dict[int, Finished] = {}
    streamed: dict[int, list[list[int]]] = {i: [] for i in range(len(requests))}
    todo = list(enumerate(requests))
    while todo or len(batch):
        if todo and batch.free_slots > 0:
            i, request = todo.pop(0)
            batch.admit(str(i), request, lambda _t, ids, i=i: streamed[i].append(list(ids)), lambda: False)
        for f in batch.step():
            done[int(f.key)] = f
    batch.close()
    return done, streamed


def _result(f: Finished) -> GenerateResult:
    assert f.error is None and f.result is not None, f.error
    return f.result


def _same_but_speed(a: GenerateResult, b: GenerateResult) -> bool:
    """Equal but for timings and the draft counts of usage."""
    usage = b.usage.model_copy(update={"draft_tokens": 0, "accepted_tokens": 0})
    return a == b.model_copy(update={"timings": a.timings, "usage": usage})


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    lookup = PromptLookup(min_ngram=2, max_ngram=3)
    # "1 2 3" occurs twice before the end; the latest occurrence (followed by 9) wins
    assert lookup.propose([1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 1, 2, 3], 3) == [9, 8, 7]
    assert lookup.propose([1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 1, 2, 3], 2) == [9, 8]
    # the longest matching suffix wins over a later shorter one: "5 2 3" -> 6, not "2 3" -> 4
    assert lookup.propose([5, 2, 3, 6, 7, 2, 3, 4, 5, 2, 3], 2) == [6, 7]
    assert lookup.propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert lookup.propose([1, 2, 1, 2], 0) == []
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(min_ngram=3, max_ngram=2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=30),
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), max_size=25),
    st.integers(1, 6),
)
def test_the_lookups_index_finds_what_scanning_the_text_finds(
    start: list[int], arrivals: list[list[int]], depth: int
) -> None:
    """The n-gram index (each row's n-grams indexed once, as its tokens arrive) proposes what a scan of
    the last `window` tokens for the latest occurrence of the longest matching suffix does."""

    def scanned(tokens: list[int]) -> list[int]:
        seen = tokens[-20:]
        for n in range(min(4, len(seen) - 1), 1, -1):
            for at in range(len(seen) - n - 1, -1, -1):
                if seen[at : at + n] == seen[len(seen) - n :]:
                    return seen[at + n : at + n + depth]
        return []

    lookup, tokens = PromptLookup(min_ngram=2, max_ngram=4, window=20), list(start)
    for more in [[], *arrivals]:
        tokens += more
        assert lookup.propose(tokens, depth) == scanned(tokens)
        assert lookup.may_propose(tokens) == bool(scanned(tokens))


def test_the_policy_follows_acceptance_and_stops_drafting_in_large_batches() -> None:
    policy = DraftPolicy(max_depth=4, max_batch=8, min_acceptance=0.3, smoothing=0.5, retry_every=3)
    row = RowSpeculation(PromptLookup(), policy, cap=4)
    assert row.depth(batch=1, budget=100) == 4
    assert row.depth(batch=9, budget=100) == 0  # the step is bound by arithmetic there
    assert row.depth(batch=1, budget=2) == 2  # never past the request's budget
    for _ in range(4):
        row.observe(4, 0)
    assert row.acceptance < 0.3 and not row.wants(1, 100) and not row.wants(1, 100)
    assert not row.wants(1, 100)
    assert row.wants(1, 100) and row.depth(1, 100) == 1  # a retry of one token after 3 idle steps
    row.observe(1, 1)
    row.observe(1, 1)
    assert row.depth(1, 100) >= 2
    assert (row.drafted, row.kept) == (18, 2)
    with pytest.raises(ValueError, match="min_acceptance"):
        DraftPolicy(min_acceptance=2.0)


def test_the_draft_choice_gives_drafters_only_to_rows_that_may_draft(plain: Engine) -> None:
    """`DraftChoice.speculation_for`: prompt lookup's cap is the larger of the policy's depth and run,
    cut by the job's own; no drafter where the job asks none, the sampler has penalties or the row
    reports logprobs, nor with speculation off. An unknown kind is refused when the choice is made;
    a draft kind whose draft was never loaded, when a request asks for a drafter."""
    target = DraftTarget(plain.model, plain.tokenizer)
    policy = DraftPolicy(max_depth=4, max_run=16)
    lookup = DraftChoice("prompt_lookup", policy, None, target)
    request = GenerateRequest(prompt=PROMPT, max_tokens=8)
    row = lookup.speculation_for(request, Sampler(10))
    assert row is not None and isinstance(row.drafter, PromptLookup) and row.cap == 16
    capped = lookup.speculation_for(request.model_copy(update={"max_draft_tokens": 3}), Sampler(10))
    assert capped is not None and capped.cap == 3
    reporting = Sampler(10)
    reporting.logprobs = 2
    for request_, sampler in (
        (request.model_copy(update={"max_draft_tokens": 0}), Sampler(10)),
        (request, Sampler(10, repetition_penalty=1.3)),
        (request, reporting),
    ):
        assert lookup.speculation_for(request_, sampler) is None
    assert DraftChoice("off", policy, None, target).speculation_for(request, Sampler(10)) is None
    assert lookup.taps == ()
    with pytest.raises(ValueError, match="unknown speculation kind 'lookup'"):
        DraftChoice("lookup", policy, None, target)
    with pytest.raises(ValueError, match="speculation mtp: the engine has no draft"):
        DraftChoice("mtp", policy, None, target).speculation_for(request, Sampler(10))


def _cache_rows(lengths: list[int], heads: int = 2, dim: int = 4) -> list[KVCache]:
    """Batch-1 caches whose keys/values at position t of row r hold 100 * r + t (easy to check)."""
    rows = []
    for r, n in enumerate(lengths):
        a = (100 * r + mx.arange(n, dtype=mx.float32))[None, None, :, None] * mx.ones((1, heads, n, dim))
        rows.append(KVCache.from_state(a, a + 0.5))
    return rows


def test_trim_rows_keeps_each_rows_columns_and_a_copy_of_the_buffers_squeezes_the_holes_out() -> None:
    cache = BatchKVCache()
    cache.add(_cache_rows([3, 5]))
    new = mx.broadcast_to(mx.array([[7.0, 8.0, 9.0]])[:, None, :, None], (2, 2, 3, 4))
    cache.update_and_fetch(new, new)  # a verify step: 3 columns for each row
    cache.trim_rows(3, [1, 2])  # row 0 keeps its pending token only, row 1 one draft too
    assert cache.lengths == [4, 7] and cache.holes == [1, 0]
    assert cache.offset.tolist() == [4, 7]  # type: ignore[union-attr]
    mask = cache.mask(2)
    assert mask is not None and mask.shape == (2, 1, 2, cache.end + 2)
    assert mask[0, 0, 0].tolist() == [False, False, True, True, True, True, False, True, False]
    assert mask[1, 0, 1].tolist() == [True] * 9
    row0 = cache.row(0).state[0][0, 0, :, 0].tolist()
    assert row0 == [0.0, 1.0, 2.0, 7.0]  # its own tokens, the hole left out
    assert cache.row(1).state[0][0, 0, :, 0].tolist() == [100.0, 101.0, 102.0, 103.0, 104.0, 7.0, 8.0]
    cache.add(_cache_rows([9]))  # a longer newcomer: the others padded further, holes kept in place
    assert cache.lengths == [4, 7, 9] and cache.holes == [1, 0, 0]
    assert cache.row(0).state[0][0, 0, :, 0].tolist() == row0
    assert cache.put([2], _cache_rows([1, 1, 3])[2:]) and cache.holes == [1, 0, 0]  # a newcomer has none
    cache.keep([2, 0], padding=[1])  # the buffers copied: the holes squeezed out on the way
    assert cache.lengths == [3, 4, 0] and cache.holes == [0, 0, 0] and not cache.has_holes
    assert cache.row(1).state[0][0, 0, :, 0].tolist() == row0
    assert cache.row(1).state[1][0, 0, :, 0].tolist() == [0.5, 1.5, 2.5, 7.0]  # values move with keys
    assert cache.row(0).state[0][0, 0, :, 0].tolist() == [200.0, 201.0, 202.0]
    assert cache.offset.tolist() == [3, 4, 0]  # type: ignore[union-attr]
    assert cache.capacity > cache.end  # room for the next step's write


def test_a_verify_forward_reads_whole_steps_of_columns_its_mask_hides_past_the_new_tokens() -> None:
    cache = BatchKVCache()
    cache.add(_cache_rows([3, 5]))
    new = mx.broadcast_to(mx.array([[7.0, 8.0, 9.0]])[:, None, :, None], (2, 2, 3, 4))
    cache.update_and_fetch(new, new)
    cache.trim_rows(3, [1, 2])  # holes, as after a verify step
    end, exact = cache.end, cache.mask(2)
    assert exact is not None
    columns = cache.read_whole_steps(2)
    assert columns == BatchKVCache.step and cache.capacity >= columns
    keys, values = cache.update_and_fetch(new[:, :, :2], new[:, :, :2])
    assert keys.shape[2] == values.shape[2] == columns and cache.end == end + 2
    cache.end = end  # the mask is the one the forward was built with: before its write
    wide = cache.mask(2, columns)
    assert wide is not None and wide.shape == (2, 1, 2, columns)
    assert mx.array_equal(wide[..., : end + 2], exact) and not wide[..., end + 2 :].any().item()
    cache.read_exactly()
    cache.end = end + 2
    assert cache.update_and_fetch(new[:, :, :1], new[:, :, :1])[0].shape[2] == end + 3
    with pytest.raises(ValueError, match="windowed"):
        BatchKVCache(window=8).read_whole_steps(1)
    with pytest.raises(ValueError, match="columns or more"):
        cache.mask(2, cache.end + 1)


@pytest.mark.parametrize("whole", [False, True])
def test_empty_rows_enter_their_first_tokens_together_each_keeping_its_count(whole: bool) -> None:
    """Rows holding nothing (`of_empty_rows`, an MTP batch's joining rows) make their buffers at their
    first write, whole steps wide, even for a forward reading whole steps; each row keeps its count."""
    cache = BatchKVCache.of_empty_rows(3)
    assert cache.keys is None and cache.lengths == [0, 0, 0] and cache.offset == 0
    new = (mx.arange(4, dtype=mx.float32)[None, :] + 10 * mx.arange(3)[:, None])[:, None, :, None]
    new = mx.broadcast_to(new, (3, 2, 4, 5))
    with whole_steps([cache], 4, whole) as columns:
        assert (columns == BatchKVCache.step) if whole else columns is None
        assert (cache.mask(4, columns) is not None) == whole  # else plain causal attention is exact
        keys, values = cache.update_and_fetch(new, new + 0.5)
    assert keys.shape == (3, 2, BatchKVCache.step if whole else 4, 5) and values.shape == keys.shape
    assert cache.capacity == BatchKVCache.step
    cache.trim_rows(4, [2, 4, 0])  # right-padded: each row's padding columns become its holes
    assert cache.lengths == [2, 4, 0] and cache.holes == [2, 0, 4]
    assert cache.row(0).state[0][0, 0, :, 0].tolist() == [0.0, 1.0]
    assert cache.row(1).state[1][0, 0, :, 0].tolist() == [10.5, 11.5, 12.5, 13.5]
    assert cache.row(2).offset == 0
    with pytest.raises(AssertionError, match="add rows"):
        BatchKVCache().reserve(1)


def test_rows_holding_nothing_have_no_buffers_to_reserve_their_first_write_makes_them() -> None:
    """`reserve` refuses rows holding no tokens (`of_empty_rows`): they have no buffers, whose shape
    comes with their first keys. A forward reading whole steps leaves them to its write, which makes
    buffers as wide as the columns it reads."""
    with pytest.raises(AssertionError, match="no buffers"):
        BatchKVCache.of_empty_rows(2).reserve(1)
    cache = BatchKVCache.of_empty_rows(2)
    new = mx.ones((2, 1, 300, 4))
    with whole_steps([cache], 300, True) as columns:
        assert columns == 2 * BatchKVCache.step and cache.keys is None
        keys, values = cache.update_and_fetch(new, new)
    assert keys.shape[2] == values.shape[2] == columns == cache.capacity
    assert cache.lengths == [300, 300] and cache.read_to is None


def _greedy_requests(engine: Engine) -> list[GenerateRequest]:
    no_eos = _no_eos(engine)
    return [
        GenerateRequest(
            prompt=PROMPT * (1 + i % 3) + f"#{i}", max_tokens=8 + 9 * i, temperature=0, logit_bias=no_eos
        )
        for i in range(5)
    ]


def test_greedy_speculation_gives_plain_decodings_tokens_and_stream_in_a_batch(
    plain: Engine, spec: Engine
) -> None:
    requests = _greedy_requests(plain)
    free = generate(plain, requests[4], lambda _t, _ids: None)
    # a stop string met in the middle of a verify step's kept drafts ends the request there
    requests.append(requests[4].model_copy(update={"stop": [free.text[12:15]], "max_tokens": 60}))
    expected, expected_stream = _run(plain, requests, max_sequences=3)
    got, got_stream = _run(spec, requests, max_sequences=3)
    drafted = accepted = 0
    for i in range(len(requests)):
        a, b = _result(expected[i]), _result(got[i])
        assert _same_but_speed(a, b), (i, a.token_ids, b.token_ids)
        assert got_stream[i] == expected_stream[i]  # every token its own event, in order
        assert a.usage.draft_tokens == 0 and b.usage.accepted_tokens <= b.usage.draft_tokens
        drafted, accepted = drafted + b.usage.draft_tokens, accepted + b.usage.accepted_tokens
    assert _result(got[5]).finish_reason == "stop"
    assert drafted > 0 and accepted > 0  # lookup proposed, and the target kept some


def test_rows_that_draft_nothing_decode_exactly_as_plain_steps_beside_rows_that_draft(
    plain: Engine, spec: Engine
) -> None:
    """A job that turned drafting off and rows with penalties (never drafting: their penalties would
    depend on the drafts) take their tokens from the verify steps' first positions: greedy or seeded,
    the very tokens of plain decoding, whatever their batch-mates draft."""
    no_eos = _no_eos(plain)
    drafting = GenerateRequest(prompt=PROMPT * 2, max_tokens=30, temperature=0, logit_bias=no_eos)
    requests = [
        drafting,
        drafting.model_copy(update={"max_draft_tokens": 0}),
        GenerateRequest(
            prompt=PROMPT, max_tokens=20, temperature=0, logit_bias=no_eos, repetition_penalty=1.3
        ),
        GenerateRequest(
            prompt=PROMPT, max_tokens=20, temperature=1.1, seed=4, logit_bias=no_eos, max_draft_tokens=0
        ),
        GenerateRequest(
            prompt=PROMPT * 2,
            max_tokens=25,
            temperature=0.9,
            seed=9,
            top_k=30,
            frequency_penalty=0.5,
            logit_bias=no_eos,
        ),
    ]
    expected, _ = _run(plain, requests, max_sequences=5)
    got, _ = _run(spec, requests, max_sequences=5)
    for i in range(len(requests)):
        assert _same_but_speed(_result(expected[i]), _result(got[i])), i
    assert _result(got[0]).usage.accepted_tokens > 0  # the batch did take verify steps
    assert all(_result(got[i]).usage.draft_tokens == 0 for i in range(1, 5))
    assert spec.speculation_for(requests[2], Sampler(10, repetition_penalty=1.3)) is None


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_speculative_sampling_draws_the_targets_distribution() -> None:
    """Verify steps over fixed logits (a row's distribution at each position, its drafts fixed): the
    first token (the draft or its replacement) follows p0 after temperature and top-k, and after a
    kept draft the next one follows p1. Seeded: the test always draws the same."""
    vocab, rows, temperature, top_k = 6, 4000, 0.8, 5
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 1.5
    samplers = [Sampler(vocab, temperature=temperature, top_k=top_k, seed=s) for s in range(rows)]
    batch = SamplerRows(samplers, vocab)
    drafts = [int(np.argsort(logits[0])[-2]), int(np.argmax(logits[1]))]  # a likely and a top guess
    kept, following = batch.verify(
        mx.broadcast_to(mx.array(logits)[None], (rows, 3, vocab)),
        mx.array([drafts] * rows, dtype=mx.int32),
        mx.full((rows,), 2, dtype=mx.int32),
    )
    kept_np, next_np = np.array(kept), np.array(following)

    def probs(x: np.ndarray) -> np.ndarray:
        z = x / temperature
        z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
        p = np.exp(z - z.max())
        return p / p.sum()

    first = np.where(kept_np >= 1, drafts[0], next_np)
    second = np.where(kept_np >= 2, drafts[1], next_np)[kept_np >= 1]
    # chi-square, 5 degrees of freedom (4 free with top-k): 20.5 is the 0.1% point
    assert _chi_square(np.bincount(first, minlength=vocab), probs(logits[0])) < 20.5
    assert _chi_square(np.bincount(second, minlength=vocab), probs(logits[1])) < 20.5
    assert (kept_np == 0).sum() > 0 and (kept_np == 2).sum() > 0  # both outcomes were met
    expected_rate = probs(logits[0])[drafts[0]]
    assert abs((kept_np >= 1).mean() - expected_rate) < 4 * math.sqrt(expected_rate / rows)


def test_sampled_generation_with_speculation_follows_plain_decodings_distribution(
    model_dir: Path, plain: Engine
) -> None:
    """End to end on the tiny model: the first tokens of many seeded draws of a repeating prompt, with
    and without prompt lookup, come from one distribution (a two-sample chi-square test)."""
    spec = _engine(
        model_dir,
        speculation="prompt_lookup",
        draft_policy=DraftPolicy(min_acceptance=0.0, max_batch=64, only_likely=False),
    )
    n, tokens = 192, 4
    # three tokens made likely and a prompt cycling through them: the draws repeat the prompt's
    # pieces, so lookup proposes and the drafts are often kept
    likely = plain.tokenizer.encode(PROMPT)[:3]
    bias = {**_no_eos(plain), **{t: 9.0 for t in likely}}
    prompt = plain.tokenizer.decode(likely * 8)
    base = dict(prompt=prompt, max_tokens=tokens, temperature=1.0, logit_bias=bias)
    requests = [GenerateRequest.model_validate({**base, "seed": s}) for s in range(n)]
    runs, accepted = [], 0
    for engine in (plain, spec):
        done, _ = _run(engine, requests, max_sequences=64)
        runs.append([_result(done[i]).token_ids for i in range(n)])
        accepted = sum(_result(f).usage.accepted_tokens for f in done.values())
    assert accepted > n // 4  # the drafts were tested, and often kept
    assert_same_draws(runs, tokens)  # with and without speculation: one distribution at each position


def test_holes_of_a_steps_worth_are_squeezed_out_and_decoding_goes_on_the_same(
    plain: Engine, spec: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows keeping different numbers of drafts leave holes; once a row's reach a step (4 columns
    here) the buffers are copied without them, and every row decodes on as before."""
    squeezed = []
    original = BatchKVCache._squeezed

    def spy(self: BatchKVCache, index: mx.array, live: int, like: BatchKVCache | None = None) -> Any:
        squeezed.append(live)
        return original(self, index, live, like)

    monkeypatch.setattr(BatchKVCache, "step", 4)
    monkeypatch.setattr(BatchKVCache, "_squeezed", spy)
    requests = _greedy_requests(plain)
    expected, _ = _run(plain, requests, max_sequences=5)
    got, _ = _run(spec, requests, max_sequences=5)
    for i in range(len(requests)):
        assert _same_but_speed(_result(expected[i]), _result(got[i])), i
    assert squeezed


def test_a_batch_holding_a_constrained_row_verifies_drafts_and_gives_plain_results(
    plain: Engine, spec: Engine
) -> None:
    """A constrained row's drafts are checked against its grammar (`test_structured_output.py` holds
    the rest): its batch-mates draft beside it, and every row gets what plain steps give it."""
    no_eos = _no_eos(plain)
    regex = {"type": "regex", "regex": "[a-z]{4}"}
    requests = [
        GenerateRequest(prompt=PROMPT * 2, max_tokens=40, temperature=0, logit_bias=no_eos),
        GenerateRequest(prompt=PROMPT, max_tokens=20, temperature=0, response_format=regex),
    ]
    expected, _ = _run(plain, requests, max_sequences=2)
    got, _ = _run(spec, requests, max_sequences=2)
    for i in range(len(requests)):
        assert _same_but_speed(_result(expected[i]), _result(got[i])), i
    assert _result(got[0]).usage.draft_tokens > 0


def test_the_policy_turns_verify_steps_off_for_large_batches_and_rows_that_find_nothing(
    model_dir: Path, plain: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above `max_batch` decoding rows nobody drafts; a row whose lookup keeps finding nothing drops to
    plain steps (one in flight) and retries now and then. Output as plain decoding's either way."""
    verify_steps: list[int] = []
    original = DecodeBatch.verify_with

    def counted(self: DecodeBatch, *args: Any, **kwargs: Any) -> Any:
        verify_steps.append(len(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecodeBatch, "verify_with", counted)
    no_eos = _no_eos(plain)
    pair = [
        GenerateRequest(prompt=PROMPT * 2, max_tokens=30, temperature=0, logit_bias=no_eos),
        GenerateRequest(prompt=PROMPT * 3, max_tokens=30, temperature=0, logit_bias=no_eos),
    ]
    small = _engine(model_dir, speculation="prompt_lookup", draft_policy=DraftPolicy(max_batch=1))
    expected, _ = _run(plain, pair, max_sequences=2)
    got, _ = _run(small, pair, max_sequences=2)
    assert [_result(got[i]).token_ids for i in range(2)] == [_result(expected[i]).token_ids for i in range(2)]
    assert verify_steps and max(verify_steps) == 1  # only once one row was left alone
    # a prompt of distinct tokens (nothing to look up) and a model that never repeats: few tries, then off
    verify_steps.clear()
    distinct = plain.tokenizer.decode(list(range(40, 90)))
    bias = {t: -100.0 for t in plain.tokenizer.encode(distinct)} | no_eos
    alone = GenerateRequest(prompt=distinct, max_tokens=60, temperature=0, logit_bias=bias)
    policy = DraftPolicy(min_acceptance=0.3, smoothing=0.5, retry_every=16)
    result = _result(
        _run(_engine(model_dir, speculation="prompt_lookup", draft_policy=policy), [alone], 1)[0][0]
    )
    assert result.token_ids == _result(_run(plain, [alone], 1)[0][0]).token_ids
    assert 0 < len(verify_steps) < 10  # of ~60 steps


def test_verify_steps_padded_to_few_shapes_decode_the_same(model_dir: Path, plain: Engine) -> None:
    """With `pad_shapes` (a GPU's default) a verify step's width is a power of two and its rows a
    padded batch: the columns past the drafts are never kept, the tokens are plain decoding's."""
    padded = _engine(
        model_dir,
        speculation="prompt_lookup",
        draft_policy=DraftPolicy(min_acceptance=0.0, only_likely=False),
        pad_shapes=True,
    )
    requests = _greedy_requests(plain)
    expected, _ = _run(plain, requests, max_sequences=3)
    got, _ = _run(padded, requests, max_sequences=3)
    for i in range(len(requests)):
        assert _same_but_speed(_result(expected[i]), _result(got[i])), i
    assert sum(_result(f).usage.accepted_tokens for f in got.values()) > 0


@pytest.mark.parametrize(
    "arch, config",
    [
        ("DeepseekV3ForCausalLM", "latent"),  # MLA's latent cache: keys and values of other widths
        ("Qwen3MoeForCausalLM", "moe"),
        ("MistralForCausalLM", "window"),  # a verify step's mask with holes, narrowed to the window
        ("Gemma3ForCausalLM", "window"),
    ],
)
def test_speculation_on_other_architectures_gives_plain_decodings_tokens(
    tmp_path: Path, arch: str, config: str
) -> None:
    """Verify steps and per-row trimming on caches other than Llama's: MLA's latent cache (whose
    attention folds the batch's mask into its RoPE scores), a mixture of experts, and sliding windows
    (the verify mask's holes are not positions: the window counts only a row's own columns)."""
    from reference import make_hf_checkpoint

    overrides: dict[str, Any] = {"max_position_embeddings": 512}
    if config == "latent":
        from test_latent_cache import MLA

        overrides = {**MLA, **overrides}
    elif config == "window":
        overrides.update(sliding_window=8)
    else:
        overrides.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    folder = make_hf_checkpoint(tmp_path / "ckpt", arch, **overrides)
    plain = _engine(folder, dtype="float32")
    spec = _engine(  # padded shapes: verify forwards read whole steps of columns (windowed layers: exact)
        folder,
        dtype="float32",
        speculation="prompt_lookup",
        draft_policy=DraftPolicy(min_acceptance=0.0, only_likely=False),
        pad_shapes=True,
    )
    requests = _greedy_requests(plain)[:4]
    expected, _ = _run(plain, requests, max_sequences=3)
    got, _ = _run(spec, requests, max_sequences=3)
    drafted = 0
    for i in range(len(requests)):
        a, b = _result(expected[i]), _result(got[i])
        assert a.token_ids == b.token_ids, (i, a.token_ids, b.token_ids)
        drafted += b.usage.draft_tokens
    assert drafted > 0


def test_rows_with_nothing_to_copy_take_plain_steps_rather_than_empty_verify_steps(
    model_dir: Path, plain: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`only_likely` (the default): a row drafts at a step only when its text ends in a match now
    (`PromptLookup.may_propose`, asked before its pending token is read back), so a verify step comes
    out empty only where that token ended the copy, and a row that never copies decodes with plain
    steps, one in flight. Tokens as plain decoding's either way."""
    empty_verify_steps, verify_steps = [], []
    original = DecodeBatch.verify_with

    def recorded(self: DecodeBatch, drafts_for: Any, *args: Any, **kwargs: Any) -> Any:
        def drafts(tokens: list[int]) -> list[list[int]]:
            out = drafts_for(tokens)
            verify_steps.append(1)
            if not any(out):
                empty_verify_steps.append(1)
            return out

        return original(self, drafts, *args, **kwargs)

    monkeypatch.setattr(DecodeBatch, "verify_with", recorded)
    no_eos = _no_eos(plain)
    distinct = plain.tokenizer.decode(list(range(40, 90)))
    bias = {t: -100.0 for t in plain.tokenizer.encode(distinct)} | no_eos
    requests = [
        GenerateRequest(prompt=PROMPT * 3, max_tokens=30, temperature=0, logit_bias=no_eos),
        GenerateRequest(prompt=distinct, max_tokens=30, temperature=0, logit_bias=bias),
    ]
    expected, _ = _run(plain, requests, max_sequences=2)
    counts: dict[bool, tuple[int, int]] = {}
    for only_likely in (False, True):
        policy = DraftPolicy(min_acceptance=0.0, only_likely=only_likely)
        got, _ = _run(_engine(model_dir, speculation="prompt_lookup", draft_policy=policy), requests, 2)
        assert [_result(got[i]).token_ids for i in range(2)] == [
            _result(expected[i]).token_ids for i in range(2)
        ]
        assert _result(got[0]).usage.draft_tokens > 0  # the copying row drafted
        counts[only_likely] = (len(verify_steps), len(empty_verify_steps))
        verify_steps.clear()
        empty_verify_steps.clear()
    (every, every_empty), (likely, likely_empty) = counts[False], counts[True]
    assert 0 < likely < every and likely_empty < every_empty / 2, counts


def test_padded_batches_squeeze_a_verify_steps_holes_out_at_once_and_decode_the_same(plain: Engine) -> None:
    """With `pad_shapes` (a GPU) a verify step whose rows kept different numbers of drafts copies the
    small buffers once, so the plain steps after it need no mask (the ragged kernel serves them); each
    row's tokens are those it gets alone."""
    model, vocab = plain.model, plain.model.args.vocab_size
    prompts = [plain.tokenizer.encode(PROMPT * 2), plain.tokenizer.encode(PROMPT)]
    alone = []
    for p in prompts:
        one, cache = DecodeBatch(model), model.make_cache()
        one.add([cache], prefill(model, p, cache, 16), [Sampler(vocab, temperature=0.0)])
        alone.append([one.step()[0] for _ in range(9)])
    batch = DecodeBatch(model, pad_shapes=True)
    caches = [model.make_cache() for _ in prompts]
    logits = mx.concatenate([prefill(model, p, c, chunk=16) for p, c in zip(prompts, caches, strict=True)])
    batch.add(caches, logits, [Sampler(vocab, temperature=0.0) for _ in prompts])
    got = [[t] for t in batch.step()]
    # row 0 drafts the three tokens it gets next (all kept), row 1 none: row 1 would keep holes
    runs = batch.verify_with(lambda tokens: [alone[0][2:5], []], lambda runs: runs)
    assert runs[0] == alone[0][1:5] and not batch.cache[0].has_holes
    for row, run in zip(got, runs, strict=True):
        row.extend(run)
    while len(got[0]) < 9 or len(got[1]) < 9:
        for row, token in zip(got, batch.step(), strict=True):
            row.append(token)
    assert [row[:9] for row in got] == alone
    batch.quiet()


def test_rows_leaving_with_holes_wait_for_the_launch_in_flight(
    plain: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With steps launched on the launcher's thread (a GPU's default) a plain step may follow a verify
    step (`only_likely`), so a row can leave with holes in its cache while the next step launches.
    Taking its own columns reads the holes back (an evaluation), which must not run beside a launch
    (it crashed the CUDA build): the batch waits for the launch first."""
    launcher = launchers.acquire()
    busy_when_read: list[bool] = []
    original = BatchKVCache.row

    def recorded(self: BatchKVCache, i: int) -> Any:
        if self.holes[i]:
            busy_when_read.append(launcher.busy)
        return original(self, i)

    monkeypatch.setattr(BatchKVCache, "row", recorded)
    try:
        model = plain.model
        batch = DecodeBatch(model, launcher=launcher)
        prompts = [plain.tokenizer.encode(PROMPT * 2), plain.tokenizer.encode(PROMPT)]
        caches = [model.make_cache() for _ in prompts]
        logits = mx.concatenate(
            [prefill(model, p, c, chunk=16) for p, c in zip(prompts, caches, strict=True)]
        )
        vocab = model.args.vocab_size
        batch.add(caches, logits, [Sampler(vocab, temperature=0.0) for _ in prompts])
        first = batch.step()
        # row 0 drafts the three tokens greedy decoding gives next (all kept), row 1 none: row 1 keeps
        # one column of the four (holes)
        alone, cache = DecodeBatch(model), model.make_cache()
        alone.add([cache], prefill(model, prompts[0], cache, 16), [Sampler(vocab, temperature=0.0)])
        ahead = [alone.step()[0] for _ in range(5)]
        assert ahead[0] == first[0]
        runs = batch.verify_with(lambda tokens: [ahead[2:5], []], lambda runs: runs)
        assert runs[0] == ahead[1:5] and batch.cache[0].holes[1] == 3
        clock = batch.verify_step.clock  # one verify step timed: 2 rows x 4 columns fed, 4 + 1 tokens given
        assert (clock.steps, clock.fed, clock.given) == (1, 8, 5)
        assert clock.per_step_ms()["step_ms"] == pytest.approx(1e3 * clock.total_s) and clock.total_s > 0
        batch.step()  # a plain step: the next one is launching when this returns
        assert launcher.busy
        (cache,) = batch.remove([1])
        assert busy_when_read == [False] * len(model.layers)  # each layer's columns, read once it ended
        assert cache[0].offset == len(prompts[1]) + 3  # its prompt, then one token a step
        batch.quiet()
    finally:
        launchers.release(launcher)


def test_a_verify_forward_launched_in_pieces_decodes_as_one_launched_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a launcher (`decode_overlap`: a GPU's default) a verify step's forward is launched in pieces
    as its layers are built (`forward_pieces.py`): each on the launcher's thread behind the one before,
    the next layers built on it meanwhile, nothing read before all ended. Its tokens are those of the
    forward launched whole (no launcher) and of plain decoding."""
    engine = _engine(write_random_checkpoint(tmp_path / "deep", {"num_hidden_layers": 4}))
    model, vocab = engine.model, engine.model.args.vocab_size
    prompt = engine.tokenizer.encode(PROMPT * 2)
    one, cache = DecodeBatch(model), model.make_cache()
    one.add([cache], prefill(model, prompt, cache, 16), [Sampler(vocab, temperature=0.0)])
    alone = [one.step()[0] for _ in range(12)]
    launched: list[int] = []  # the first array of each piece: its dimensions
    original = Launcher.launch_behind

    def recorded(self: Launcher, *arrays: mx.array) -> None:
        launched.append(arrays[0].ndim)
        original(self, *arrays)

    monkeypatch.setattr(Launcher, "launch_behind", recorded)
    launcher = launchers.acquire()
    try:
        runs, busy = {}, []
        # after the pending token: two drafts the target agrees with, then one it does not
        drafts = [[*alone[2:4], (alone[4] + 1) % vocab]]

        def handled(run: list[list[int]]) -> list[list[int]]:
            busy.append(launcher.busy)  # the kept tokens are read once every piece's launch ended
            return run

        for way, held in (("whole", None), ("pieces", launcher)):
            batch, cache = DecodeBatch(model, launcher=held), model.make_cache()
            batch.add([cache], prefill(model, prompt, cache, 16), [Sampler(vocab, temperature=0.0)])
            got = batch.step()
            run = batch.verify_with(lambda _tokens: drafts, handled)
            assert run == [alone[1:4]]
            got += run[0]
            while len(got) < len(alone):
                got += batch.step()
            batch.quiet()
            runs[way] = got[: len(alone)]
        assert runs["whole"] == runs["pieces"] == alone
        # layers 0-2 (the last layer's output is the last piece's), then the kept counts and the rest
        assert launched == [3, 3, 3, 1] and busy == [False, False]
    finally:
        launchers.release(launcher)


def test_a_row_whose_proposals_are_kept_whole_drafts_longer_runs_up_to_its_cap() -> None:
    policy = DraftPolicy(max_depth=4, max_run=15)
    row = RowSpeculation(PromptLookup(), policy, cap=15)
    depths = []
    for _ in range(4):
        depths.append(row.depth(batch=1, budget=100))
        row.observe(depths[-1], depths[-1])
    assert depths == [4, 8, 15, 15]  # a copied run doubles, bounded by the row's cap
    assert row.depth(batch=1, budget=6) == 6  # never past the request's budget
    row.observe(15, 3)  # the run ended: back to the acceptance-based depth within max_depth
    assert row.depth(batch=1, budget=100) <= 4
    assert row.depth(batch=9, budget=100) == 0  # large batches draft nothing, runs or not
    with pytest.raises(ValueError, match="max_run"):
        DraftPolicy(max_run=-1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 9), max_size=8),
    st.lists(st.integers(0, 9), max_size=8),
    st.one_of(st.none(), st.integers(0, 9)),
    st.integers(-20, 20),
    st.integers(-20, 20),
    st.sampled_from([None, 1, 2, -1]),
)
def test_a_rows_tokens_read_as_their_concatenation(
    prompt: list[int], generated: list[int], pending: int | None, start: int, stop: int, step: int | None
) -> None:
    """What drafters read (`RowTokens`: no copy of the row per step) reads as the list it stands for."""
    whole = [*prompt, *generated, *([] if pending is None else [pending])]
    row = RowTokens(prompt, generated, pending)
    assert len(row) == len(whole) and list(row) == whole
    assert row[start:stop:step] == whole[start:stop:step]
    for i in range(-len(whole), len(whole)):
        assert row[i] == whole[i]
    with pytest.raises(IndexError):
        row[len(whole)]


def _gated_run(
    engine: Engine, request: GenerateRequest, monkeypatch: pytest.MonkeyPatch, verify_s: float
) -> tuple[GenerateResult, int, DraftGate]:
    """One request through a batch whose draft gate reads a fake clock: a plain step takes 0.01 s, a
    verify step `verify_s`. Returns its result, the verify steps taken (that verified drafts) and the
    gate."""
    now = [0.0]
    verify_steps = [0]
    original_verify, original_step = DecodeBatch.verify_with, DecodeBatch.step_with

    def verify(self: DecodeBatch, *args: Any, **kwargs: Any) -> Any:
        result = original_verify(self, *args, **kwargs)
        verify_steps[0] += self.verify_step.verified  # else nothing was proposed: it took a plain step
        now[0] += verify_s if self.verify_step.verified else 0.01
        return result

    def step(self: DecodeBatch, *args: Any, **kwargs: Any) -> Any:
        now[0] += 0.01
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(DecodeBatch, "verify_with", verify)
    monkeypatch.setattr(DecodeBatch, "step_with", step)
    assert engine.draft_gate is not None  # the policy asks for one
    engine.draft_gate = gate = DraftGate(clock=lambda: now[0], window=4, backoff=8)
    batch = GenerationBatch(engine, max_sequences=1)
    done: list[Finished] = []
    batch.admit("0", request, lambda _t, _ids: None, lambda: False)
    while len(batch):
        done.extend(batch.step())
    batch.close()
    monkeypatch.undo()
    return _result(done[0]), verify_steps[0], gate


def test_the_draft_gate_stops_drafting_where_verify_steps_lose_and_output_is_unchanged(
    model_dir: Path, plain: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the gate (the worker's default) a batch whose verify steps lose against its plain steps
    pauses drafting, again and again for longer; where they gain it keeps drafting. The tokens are
    plain decoding's either way."""
    request = GenerateRequest(prompt=PROMPT * 3, max_tokens=80, temperature=0, logit_bias=_no_eos(plain))
    expected = _result(_run(plain, [request], 1)[0][0])
    gated = _engine(
        model_dir,
        speculation="prompt_lookup",
        draft_policy=DraftPolicy(min_acceptance=0.0, only_likely=False, gate=True),
    )
    slow, slow_verifies, slow_gate = _gated_run(gated, request, monkeypatch, verify_s=1.0)
    fast, fast_verifies, fast_gate = _gated_run(gated, request, monkeypatch, verify_s=0.002)
    assert slow.token_ids == fast.token_ids == expected.token_ids
    assert slow_gate.paused > 0 and slow_verifies < 8  # of ~80 steps: a probe or two, then pauses
    assert fast_gate.paused <= 4  # only the plain steps measured first (one stretch)
    assert fast.usage.accepted_tokens > 0 and fast_verifies > slow_verifies


def test_the_gate_counts_a_steps_progress_by_the_batchs_slowest_row(
    model_dir: Path, plain: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch ends with its slowest row: a step advances it by its rows times what the slowest row
    gained, a row's lead counting once the others catch up, a row joining level with the slowest. The
    gate is told exactly that, step by step, in the batch's absolute counts of tokens."""
    gated = _engine(
        model_dir,
        speculation="prompt_lookup",
        draft_policy=DraftPolicy(min_acceptance=0.0, only_likely=False, gate=True),
    )
    no_eos = _no_eos(plain)
    requests = [
        GenerateRequest(prompt=PROMPT * 4, max_tokens=40, temperature=0, logit_bias=no_eos),
        GenerateRequest(prompt="Once upon a time", max_tokens=40, temperature=0, logit_bias=no_eos),
        GenerateRequest(prompt=PROMPT, max_tokens=24, temperature=0, logit_bias=no_eos),
    ]
    steps: list[list[tuple[str, int]]] = []  # each step's rows: (key, tokens taken)
    told: list[int] = []
    take_runs, take_tokens, end = GenerationBatch._take_runs, GenerationBatch._take_tokens, DraftGate.end

    def recorded(take: Any) -> Any:
        def taking(self: GenerationBatch, out: Any) -> Any:
            before = [(seq.key, len(seq.run.ids)) for seq in self.decoding]
            leaving = take(self, out)
            steps.append(
                [(key, len(seq.run.ids) - n) for (key, n), seq in zip(before, self.decoding, strict=True)]
            )
            return leaving

        return taking

    def recorded_end(self: DraftGate, kind: Any, progress: int, new_shape: bool = False) -> None:
        told.append(progress)
        end(self, kind, progress, new_shape)

    monkeypatch.setattr(GenerationBatch, "_take_runs", recorded(take_runs))
    monkeypatch.setattr(GenerationBatch, "_take_tokens", recorded(take_tokens))
    monkeypatch.setattr(DraftGate, "end", recorded_end)
    gated.draft_gate = DraftGate(window=1, loss_limit=1e9)  # one plain step, then drafting throughout
    got, _ = _run(gated, requests, max_sequences=2)
    monkeypatch.undo()
    expected, _ = _run(plain, requests, max_sequences=2)
    for i in range(len(requests)):
        assert _result(expected[i]).token_ids == _result(got[i]).token_ids
    assert len(told) == len(steps)
    taken: dict[str, int] = {}  # each row's tokens so far
    start: dict[str, int] = {}  # where a row's count starts: level with the slowest when it joined
    for rows, progress in zip(steps, told, strict=True):
        for key, _ in rows:
            if key not in taken:
                present = [taken[k] - start[k] for k, _ in rows if k in taken]
                taken[key], start[key] = 0, -min(present, default=0)
        slowest = min(taken[k] - start[k] for k, _ in rows)
        for key, gain in rows:
            taken[key] += gain
        assert progress == len(rows) * (min(taken[k] - start[k] for k, _ in rows) - slowest)
    # rows took different numbers of tokens at some steps, and a lead counted later at others
    assert any(len({gain for _, gain in rows}) > 1 for rows in steps)
    assert any(
        progress > len(rows) * min(g for _, g in rows) for rows, progress in zip(steps, told, strict=True)
    )
