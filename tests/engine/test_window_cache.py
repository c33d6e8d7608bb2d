"""Sliding-window layers' caches drop the columns their windows no longer see (`kv_cache.py`,
`batch_cache.py`, `prefix_cache.py`), and every result stays what it was.

The sequences here are far longer than a window plus what a windowed cache keeps beyond it
(`ROLLBACK` and whole steps), so every path runs on caches that have dropped columns: logits against
transformers (float32, 1e-4) through chunked prefills smaller and larger than the window, greedy
tokens against transformers' `generate`, batches of rows of different lengths (joining late, leaving,
with verify steps and their rollbacks), the prefix cache restoring a prefix far longer than the window,
and scoring. Memory: the windowed layers' buffers stay within their bound however long the sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from engines import closed_after_test
from reference import hf_greedy, hf_logits, load_hf_model, make_hf_checkpoint, rel_err

from mlxq.jobs.schema import GenerateRequest, ScoreRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import ROLLBACK, KVCache, held_columns, key_columns
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.generation_batch import Finished, GenerationBatch, generate
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.loader import load_model
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.ragged_attention import RaggedRows, decode_attention
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.scoring import CandidateHead, PrefixScorer
from mlxq.worker.engine.speculation.policy import DraftPolicy

# Past window - 1 + ROLLBACK + two steps: a windowed cache has dropped columns by then.
LONG = 900
assert 8 + ROLLBACK + 2 * KVCache.step < LONG

GEMMA3: dict[str, Any] = {
    "num_hidden_layers": 3,
    "head_dim": 32,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 24,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    },
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("Gemma3ForCausalLM", GEMMA3),
    "mistral-window-8": ("MistralForCausalLM", {"sliding_window": 8}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, config = CASES[request.param]
    return make_hf_checkpoint(
        tmp_path_factory.mktemp(request.param), arch, max_position_embeddings=4096, **config
    )


@pytest.fixture(scope="module")
def model(folder: Path) -> Model:
    loaded, _ = load_model(folder, dtype="float32")
    loaded.fuse()
    return loaded


@pytest.fixture(scope="module")
def hf(folder: Path) -> Any:
    return load_hf_model(folder)


def _engine(folder: Path, **options: Any) -> Engine:
    settings: dict[str, Any] = {"prefill_chunk": 64, "prefix_cache_bytes": 0, **options}
    return closed_after_test(Engine.load(str(folder), EngineOptions(**settings)))


def _ids(model: Model, n: int, seed: int = 0) -> list[int]:
    """`n` random ordinary token ids (the tiny tokenizer's specials are its first and last few)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(5, model.args.vocab_size - 8, n)]


def _windowed(caches: list[Any], model: Model) -> list[Any]:
    return [c for c, w in zip(caches, model.model.windows, strict=True) if w is not None]


def _assert_bounded(caches: list[Any], model: Model, length: int) -> None:
    """Windowed layers dropped columns and hold at most their bound; global layers hold everything."""
    for cache, window in zip(caches, model.model.windows, strict=True):
        assert cache.keys is not None
        if window is None:
            assert cache.base == 0 and cache.keys.shape[2] >= length
        else:
            assert cache.base > 0, "a windowed layer past its window and slack drops columns"
            assert cache.keys.shape[2] <= held_columns(length, window)


@pytest.mark.parametrize(("chunk", "bucketed"), [(5, False), (64, False), (64, True), (300, False)])
def test_chunked_prefill_past_the_window_gives_transformers_logits(
    model: Model, hf: Any, chunk: int, bucketed: bool
) -> None:
    """Chunks smaller and larger than the window: each chunk's queries see the window - 1 positions
    before them, dropped columns or not; `bucketed`: keys read in whole steps, a mask over every
    column (`masks.bucketed_keys`), right-aligned to the windowed layers' held ones."""
    ids = _ids(model, LONG)
    cache = model.make_cache()
    model.bucket_keys = bucketed
    try:
        parts = [
            np.array(model(mx.array([ids[a : a + chunk]], dtype=mx.int32), cache=cache)[0])
            for a in range(0, LONG, chunk)
        ]
    finally:
        model.bucket_keys = False
    assert rel_err(np.concatenate(parts), hf_logits(hf, ids)) < 1e-4
    _assert_bounded(cache, model, LONG)


def test_greedy_decoding_past_the_window_gives_transformers_tokens(model: Model, hf: Any) -> None:
    ids = _ids(model, LONG, seed=1)
    cache = model.make_cache()
    logits = prefill(model, ids, cache, chunk=128)
    ours = []
    for _ in range(12):
        token = mx.argmax(logits, axis=-1)
        ours.append(int(token.item()))
        logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]
    assert ours == hf_greedy(hf, ids, 12)
    _assert_bounded(cache, model, LONG + 12)


def test_a_long_decode_holds_a_window_and_slack_alone_and_batched(model: Model) -> None:
    """A memory bound: after 1,100 positions of decode a windowed layer holds at most its window plus
    `ROLLBACK` and whole steps (less than the sequence), batch-1 and in a decode batch, and the tokens
    are the same."""
    prompt, steps = _ids(model, 20, seed=2), 1080
    cache = model.make_cache()
    logits = prefill(model, prompt, cache, chunk=64)
    alone = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        alone.append(int(token.item()))
        logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]
    _assert_bounded(cache, model, 1100)
    assert all(c.keys.shape[2] < 1100 - KVCache.step for c in _windowed(cache, model))

    batch = DecodeBatch(model)
    cache = model.make_cache()
    batch.add(
        [cache], prefill(model, prompt, cache, chunk=64), [Sampler(model.args.vocab_size, temperature=0.0)]
    )
    batched = [batch.step()[0] for _ in range(steps)]
    assert batched == alone
    assert all(isinstance(c, BatchKVCache) for c in batch.cache)
    _assert_bounded(batch.cache, model, 1100)
    assert all(c.keys.shape[2] < 1100 - KVCache.step for c in _windowed(batch.cache, model))


def _greedy(engine: Engine, ids: list[int], max_tokens: int) -> GenerateRequest:
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    return GenerateRequest(prompt_ids=ids, max_tokens=max_tokens, temperature=0, logit_bias=no_eos)


def _run(engine: Engine, requests: list[GenerateRequest], max_sequences: int) -> dict[int, Finished]:
    """Admit requests as slots free up (rows join late and leave); run until all finish."""
    batch = GenerationBatch(engine, max_sequences=max_sequences)
    done: dict[int, Finished] = {}
    todo = list(enumerate(requests))
    while todo or len(batch):
        if todo and batch.free_slots > 0:
            i, request = todo.pop(0)
            batch.admit(str(i), request, lambda _t, _ids: None, lambda: False)
        for f in batch.step():
            done[int(f.key)] = f
    batch.close()
    return done


def _tokens(f: Finished) -> list[int]:
    assert f.error is None and f.result is not None, f.error
    return f.result.token_ids


def _requests(engine: Engine, model: Model) -> list[GenerateRequest]:
    """Rows of different lengths: long prompts, and a short one decoding far past the window."""
    shapes = [(700, 30), (350, 260), (30, 560), (610, 15), (560, 40)]
    return [_greedy(engine, _ids(model, n, seed=10 + i), t) for i, (n, t) in enumerate(shapes)]


@pytest.mark.parametrize("pad_shapes", [False, True])
def test_rows_of_different_lengths_decode_as_alone(folder: Path, model: Model, pad_shapes: bool) -> None:
    """Four rows at a time, joining late (with padded shapes a row of padding takes the fourth, without
    a copy of the buffers; else the buffers are copied for it), the fifth when the first leaves."""
    engine = _engine(folder, pad_shapes=pad_shapes)
    alone = _engine(folder)
    requests = _requests(engine, model)
    done = _run(engine, requests, 4)
    for i, request in enumerate(requests):
        assert _tokens(done[i]) == generate(alone, request, lambda _t, _i: None).token_ids, i


def test_prompts_on_a_cached_prefix_past_the_window_prefill_together_as_alone(
    folder: Path, model: Model
) -> None:
    """Short prompts after a long cached prefix are prefilled in one forward, their cached parts (the
    windowed layers' held columns only) left-padded side by side (`PrefillRowsCache`)."""
    # A chunk longer than the cached prefix: a prompt with a longer one would be prefilled alone.
    engine = _engine(folder, prefix_cache_bytes=1 << 28, prefill_chunk=1024)
    cold = _engine(folder)
    prefix = _ids(model, 720, seed=70)
    generate(engine, _greedy(engine, prefix + [7], 1), lambda _t, _i: None)
    requests = [_greedy(engine, prefix + _ids(model, 5 + 9 * i, seed=71 + i), 40 + 60 * i) for i in range(3)]
    done = _run(engine, requests, 3)
    for i, request in enumerate(requests):
        assert done[i].result is not None and done[i].result.usage.cached_tokens >= 700
        assert _tokens(done[i]) == generate(cold, request, lambda _t, _i: None).token_ids, i


def test_verify_steps_roll_back_past_the_window_and_give_plain_tokens(folder: Path, model: Model) -> None:
    """Prompt lookup drafts on every step it finds a match (a repetitive prompt): rows keep some drafts
    and roll the others back, on caches that have dropped columns."""
    policy = DraftPolicy(min_acceptance=0.0, only_likely=False)
    spec = _engine(folder, speculation="prompt_lookup", draft_policy=policy)
    plain = _engine(folder)
    pattern = _ids(model, 37, seed=20)
    requests = [
        _greedy(spec, (pattern * 20)[:n] + _ids(model, 5, seed=21 + n), t)
        for n, t in [(650, 80), (300, 330), (40, 600)]
    ]
    done = _run(spec, requests, 3)
    drafted = 0
    for i, request in enumerate(requests):
        assert done[i].result is not None
        drafted += done[i].result.usage.draft_tokens
        assert _tokens(done[i]) == generate(plain, request, lambda _t, _i: None).token_ids, i
    assert drafted > 0, "no verify step ran"


def test_a_prefix_longer_than_the_window_restores_and_continues_as_a_cold_run(model: Model) -> None:
    """A prefix cache stores what a windowed layer held (its last columns) and restores a prefix far
    longer than the window: the continuation's logits are a cold run's."""
    store = PrefixCache(1 << 30)
    windows = model.model.windows
    prompt = _ids(model, LONG, seed=30)
    cache = model.make_cache()
    prefill(model, prompt, cache, chunk=128)
    assert store.offer(prompt, cache) == LONG
    held = store.stats.bytes
    full = sum(2 * c.keys[..., :1, :].nbytes for c in cache) * LONG
    assert held < full, "windowed layers store their held columns, not every position"

    follow = _ids(model, 40, seed=31)
    restored, use = store.begin(prompt + follow, len(windows), windows=windows)
    assert use == LONG
    assert all(c.base > 0 for c in _windowed(restored, model))
    warm = model(mx.array([follow], dtype=mx.int32), cache=restored)[0]
    cold = model(mx.array([prompt + follow], dtype=mx.int32))[0, LONG:]
    assert rel_err(np.array(warm), np.array(cold)) < 1e-5

    # Another prompt leaving the stored one a few tokens before its end: the node splits there, and its
    # windowed layers still hold what that shorter prefix's window sees.
    other = prompt[:-5] + _ids(model, 30, seed=32)
    restored, use = store.begin(other, len(windows), windows=windows)
    assert use == LONG - 5
    warm = model(mx.array([other[use:]], dtype=mx.int32), cache=restored)[0]
    cold = model(mx.array([other], dtype=mx.int32))[0, use:]
    assert rel_err(np.array(warm), np.array(cold)) < 1e-5

    # Far before the end the windowed layers dropped what a window there sees: no partial restore.
    early = prompt[:300] + _ids(model, 30, seed=33)
    if any(w is not None for w in windows):
        assert store.peek(early) == 0
        assert store.begin(early, len(windows), windows=windows)[1] == 0


def test_a_split_keeping_the_long_prefix_s_arrays_restores_as_a_cold_run(model: Model) -> None:
    """A prompt offered after a stored one it leaves a few tokens before the end splits the stored node
    there, the long upper part keeping its (windowed layers': held) columns as they were: both prompts
    then restore and continue as cold runs do."""
    store = PrefixCache(1 << 30)
    windows = model.model.windows
    prompt = _ids(model, LONG, seed=34)
    other = prompt[:-5] + _ids(model, 12, seed=35)
    for tokens in (prompt, other):
        cache = model.make_cache()
        prefill(model, tokens, cache, chunk=128)
        store.offer(tokens, cache)
    assert store.stats.nodes == 3  # the split: the shared prefix, then each prompt's own tail
    for tokens in (prompt, other):
        follow = tokens + _ids(model, 20, seed=36)
        restored, use = store.begin(follow, len(windows), windows=windows)
        assert use == len(tokens)
        warm = model(mx.array([follow[use:]], dtype=mx.int32), cache=restored)[0]
        cold = model(mx.array([follow], dtype=mx.int32))[0, use:]
        assert rel_err(np.array(warm), np.array(cold)) < 1e-5


def test_the_prefix_cache_restores_past_the_window_in_generation(folder: Path, model: Model) -> None:
    warm = _engine(folder, prefix_cache_bytes=1 << 28)
    cold = _engine(folder)
    prompt = _ids(model, 800, seed=40)
    first = generate(warm, _greedy(warm, prompt, 20), lambda _t, _i: None)
    request = _greedy(warm, prompt + first.token_ids + _ids(model, 7, seed=41), 30)
    again = generate(warm, request, lambda _t, _i: None)
    assert again.usage.cached_tokens >= 800
    assert again.token_ids == generate(cold, request, lambda _t, _i: None).token_ids


def test_scoring_past_the_window_gives_a_cold_runs_logprobs(folder: Path, model: Model) -> None:
    """A long shared context, then branches far longer than a rollback keeps (the score tree goes back
    to the context after each: its caches are pinned there): every prompt token's logprob is the full
    sequence's own."""
    engine = _engine(folder)
    context = _ids(model, 640, seed=50)
    branches = [_ids(model, 600, seed=51), _ids(model, 40, seed=52)]
    prompts = [context + b for b in branches] + [context + branches[0][:150] + _ids(model, 90, seed=53)]
    rows = [{"prompt_ids": p, "prompt_logprobs": True} for p in prompts]
    result = engine.score(ScoreRequest.model_validate({"rows": rows}))
    for prompt, row in zip(prompts, result.rows, strict=True):
        assert row.prompt_logprobs is not None
        logits = model(mx.array([prompt], dtype=mx.int32))[0, :-1]
        want = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        want = want[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose(row.prompt_logprobs.token_logprobs, want, atol=1e-4)


def test_scoring_from_a_cached_context_past_the_window_gives_a_cold_runs_logits(model: Model) -> None:
    """Candidate rows need the last position only: the second time their long context comes from the
    prefix cache (windowed layers restored from their held columns)."""
    store = PrefixCache(1 << 28)
    context = _ids(model, 700, seed=60)
    prompts = [context + _ids(model, 300, seed=61), context + _ids(model, 20, seed=62)]
    for _ in range(2):
        head = CandidateHead(prompts)
        computed = PrefixScorer(model, prefix_cache=store, prefill_chunk=64).score([head])[0]
        for prompt, got in zip(prompts, head.logits, strict=True):
            assert got is not None
            want = model(mx.array([prompt], dtype=mx.int32))[0, -1]
            assert rel_err(np.array(got), np.array(want)) < 1e-5
    assert sum(computed) < sum(len(p) for p in prompts) - 600, "the context came from the prefix cache"


def _grown(window: int | None, columns: mx.array, chunk: int) -> KVCache:
    """A batch-1 cache fed `columns` (1, 1, T, 2) a chunk at a time (a windowed one drops as it goes)."""
    cache = KVCache(window)
    for a in range(0, columns.shape[2], chunk):
        cache.update_and_fetch(columns[:, :, a : a + chunk], -columns[:, :, a : a + chunk])
    return cache


def test_a_windowed_batch_holds_the_last_columns_of_every_row_through_every_membership_change() -> None:
    """A windowed `BatchKVCache` beside a global one fed the same columns: rows joining with dropped
    columns, decode and verify steps (rows keeping different drafts: holes), a row leaving (the holes
    squeezed out), a row taking a padding row's place. Every row's held columns are the last ones of
    its global twin, the held count never below what its window and a rollback need, and a ragged
    decode step's attention over them is the global one's."""
    window, rng = 5, np.random.default_rng(0)

    def fresh(n: int) -> mx.array:
        return mx.array(rng.standard_normal((1, 1, n, 2)).astype(np.float32))

    batches = {w: BatchKVCache(w) for w in (window, None)}
    prompts = [fresh(n) for n in (700, 330, 20)]
    for w, batch in batches.items():
        batch.add([_grown(w, p, 64) for p in prompts])

    def check() -> None:
        windowed, full = batches[window], batches[None]
        assert windowed.starts == full.starts and windowed.lengths == full.lengths
        assert windowed.keys is not None and windowed.keys.shape[2] <= held_columns(full.end, window)
        for i in range(full.batch):
            got, want = windowed.row(i), full.row(i)
            assert got.offset == want.offset
            assert got.offset - got.base >= min(got.offset, window - 1)
            np.testing.assert_array_equal(np.array(got.state[0]), np.array(want.state[0][:, :, got.base :]))
            np.testing.assert_array_equal(np.array(got.state[1]), np.array(want.state[1][:, :, got.base :]))
        if not full.has_holes:
            q = mx.array(rng.standard_normal((full.batch, 2, 1, 2)).astype(np.float32))
            rows = RaggedRows(full._starts, full.end, full.capacity).window(window)
            assert full.keys is not None and full.values is not None
            want_out = decode_attention(q, full.keys, full.values, rows, 2**-0.5)
            placed = rows.placed(windowed.base, windowed.capacity)
            assert windowed.values is not None
            got_out = decode_attention(q, windowed.keys, windowed.values, placed, 2**-0.5)
            np.testing.assert_allclose(np.array(got_out), np.array(want_out), rtol=1e-6, atol=1e-6)

    def step(kept: list[int] | None = None) -> None:
        width = 1 if kept is None else 4
        new = mx.array(rng.standard_normal((batches[None].batch, 1, width, 2)).astype(np.float32))
        for batch in batches.values():
            batch.write(new, -new)
            if kept is not None:
                batch.trim_rows(width, kept)

    check()
    for n in range(300):
        step([int(k) for k in rng.integers(0, 5, batches[None].batch)] if n % 9 == 0 else None)
    assert batches[window].base > 0 and batches[None].has_holes
    check()
    leaving = [b.row(1) for b in batches.values()]  # a row leaves: the others' holes are squeezed out
    for batch in batches.values():
        batch.keep([0, 2])
    check()
    short = fresh(30)
    for batch in batches.values():  # a short row takes a padding row: no copy of the buffers
        batch.add_padding(1)
        assert batch.put([2], [_grown(batch.window, short, 64)])
    check()
    for batch, row in zip(batches.values(), leaving, strict=True):
        # The row that left comes back: into a padding row where its held columns reach back to
        # `base`, else (most often) the buffers are copied for it.
        batch.add_padding(1)
        if not batch.put([3], [row]):
            batch.keep([0, 1, 2])
            batch.add([row])
    check()
    for _ in range(400):
        step()
    check()
    assert batches[window].keys is not None and batches[None].keys is not None
    assert batches[window].keys.shape[2] <= batches[None].keys.shape[2] // 2


def test_a_windowed_cache_rolls_back_what_a_rollback_may_take_and_refuses_more() -> None:
    cache = KVCache(5)
    for _ in range(900):
        cache.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    assert cache.base > 0 and cache.offset - cache.base < 5 + ROLLBACK + 2 * KVCache.step
    assert cache.trim(ROLLBACK) == ROLLBACK
    with pytest.raises(ValueError, match="cannot go back"):
        cache.trim(cache.offset - cache.base)
    pinned = KVCache(5)
    pinned.pinned = 100  # a score tree goes back to position 100 after each branch
    for _ in range(900):
        pinned.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    assert pinned.base == 0 and pinned.trim(800) == 800


def test_the_batch_kv_budget_counts_a_windowed_layer_at_most_its_window_and_slack(
    folder: Path, model: Model
) -> None:
    """Rows that may reach 3,000 positions: a budget of two such rows as the windowed caches hold them
    seats two, where counting every layer's every column (as before) would seat one."""
    engine = _engine(folder)
    columns = key_columns(20 + 3000 + BatchKVCache.step)  # what `PrefillPlan.fits` counts a row at
    row = engine.kv_bytes(columns)
    windows = model.model.windows
    assert row == sum(held_columns(columns, w) for w in windows) * engine.kv_bytes_per_token // len(windows)
    assert row < engine.kv_bytes_per_token * columns
    batch = GenerationBatch(engine, max_sequences=3, kv_budget_bytes=2 * row)
    for i in range(3):
        batch.admit(
            str(i), _greedy(engine, _ids(model, 20, seed=80 + i), 3000), lambda _t, _i: None, lambda: False
        )
    for _ in range(4):
        batch.step()
    assert len(batch.decoding) == 2 and len(batch.waiting) == 1
    batch.abort(RuntimeError("done"))
    batch.close()
