"""Score rows that read their shared prefix's keys and values in place (`cache/shared_prefix.py`): the
same log-probabilities as one plain forward per row, for Llama, Qwen3 and Gemma 3's windowed layers,
rows of different lengths and several groups, both heads, cold and warm prefix cache; and no copy of
the prefix per row."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from reference import make_hf_checkpoint

from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.cache import shared_prefix
from mlxq.worker.engine.cache.shared_prefix import RowPacks, rows_per_pack
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.scoring import CandidateHead, PrefixScorer
from mlxq.worker.engine.token_scoring import TokenHead, TokenSeq

# Gemma 3's windowed layer with a window far shorter than the prefix, and a prefix long enough that
# its batch-1 cache drops columns (`kv_cache.py`: more than window - 1 + ROLLBACK + a step behind).
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "llama": ("LlamaForCausalLM", {}, 70),
    "qwen3": ("Qwen3ForCausalLM", {}, 70),
    "gemma3-window": (
        "Gemma3ForCausalLM",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 32},
        700,
    ),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    arch, overrides, prefix = CHECKPOINTS[request.param]
    folder = make_hf_checkpoint(
        tmp_path_factory.mktemp("hf"), arch, max_position_embeddings=1024, **overrides
    )
    return folder, prefix


@pytest.fixture(params=["packed", "cascade"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of attending in place, whatever this machine's device would pick (`fused_attention`):
    on the CPU the packed way runs MLX's unfused attention with the packs' mask, the same arithmetic."""
    monkeypatch.setattr(shared_prefix, "fused_attention", lambda: request.param == "packed")
    return str(request.param)


@pytest.fixture
def attends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(rows, packs, the first prefix position the layer's cache holds) of every layer's in-place
    attention from now on."""
    seen: list[tuple[int, int, int]] = []
    original = shared_prefix.SharedPrefixRows.attend

    def recorded(self: shared_prefix.SharedPrefixRows, *args: Any) -> mx.array:
        seen.append((self.packs.rows, self.packs.packs, self.prefix.base))
        return original(self, *args)

    monkeypatch.setattr(shared_prefix.SharedPrefixRows, "attend", recorded)
    return seen


def _logprobs(model: Model, ids: list[int]) -> mx.array:
    """Every position's log-softmax from one plain forward (float32)."""
    logits = model(mx.array(ids)[None], cache=model.make_cache())[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _groups(vocab: int, prefix: int, seed: int = 0) -> list[list[int]]:
    """Rows of 1-12 own tokens on one long prefix, and a second group on a prefix of its own."""
    rng = random.Random(seed)
    shared = [rng.randrange(5, vocab) for _ in range(prefix)]
    rows = [shared + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 13))] for _ in range(9)]
    other = [rng.randrange(5, vocab) for _ in range(40)]
    rows += [other + [rng.randrange(5, vocab) for _ in range(n)] for n in (1, 5, 9)]
    return rows


@pytest.mark.parametrize("pad_shapes", [False, True], ids=["exact-shapes", "padded-shapes"])
def test_rows_on_a_shared_prefix_score_as_one_plain_forward_each(
    checkpoint: tuple[Path, int], pad_shapes: bool, way: str, attends: list[tuple[int, int, int]]
) -> None:
    """Candidate rows and token rows (each token's log-probability) of two groups in one tree; with
    padded shapes (a GPU's default) the rows, widths and key columns are padded too. The prefix goes
    in chunks, so a windowed layer's cache has dropped its oldest columns when the rows read it."""
    folder, prefix = checkpoint
    engine = Engine.load(str(folder), EngineOptions(prefix_cache_bytes=0, pad_shapes=pad_shapes))
    model = engine.model
    model.bucket_keys = pad_shapes
    rows = _groups(model.args.vocab_size, prefix)
    candidates = CandidateHead(rows[::2])
    tokens = TokenHead([TokenSeq(r, first=len(r) - 3) for r in rows[1::2]])
    PrefixScorer(model, min_shared=8, prefill_chunk=128, pad_shapes=pad_shapes).score([candidates, tokens])
    assert attends and all(n >= 1 for _, n, _ in attends)
    assert any(base > 0 for _, _, base in attends) == any(w is not None for w in model.model.windows)
    for ids, got in zip(rows[::2], candidates.logits, strict=True):
        assert got is not None
        want = _logprobs(model, ids)[-1]
        assert mx.abs(want - (got - mx.logsumexp(got))).max().item() < 1e-4
    for ids, score in zip(rows[1::2], tokens.scores, strict=True):
        want = _logprobs(model, ids)[mx.arange(len(ids) - 4, len(ids) - 1), mx.array(ids[-3:])]
        assert score.logprobs == pytest.approx(want.tolist(), abs=1e-4)


def test_a_warm_prefix_is_read_from_the_prefix_cache_and_scores_the_same(
    checkpoint: tuple[Path, int], way: str, attends: list[tuple[int, int, int]]
) -> None:
    folder, prefix = checkpoint
    engine = Engine.load(str(folder))
    rng = random.Random(3)
    vocab = engine.model.args.vocab_size
    shared = [rng.randrange(5, vocab) for _ in range(prefix)]
    cands = [10, 11, 12]

    def job() -> list[tuple[list[int], list[int]]]:
        return [
            (shared + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 9))], cands) for _ in range(6)
        ]

    cold_rows, warm_rows = job(), job()
    (cold,) = engine.score_many([cold_rows])
    attends.clear()
    (warm,) = engine.score_many([warm_rows])
    assert attends  # the warm batch's rows read the cached prefix in place too
    assert cold.cached_tokens < warm.cached_tokens
    assert warm.cached_tokens >= 6 * (prefix - 1)  # the cache gives all of the prefix but its last token
    for (ids, _), row in [*zip(cold_rows, cold.rows, strict=True), *zip(warm_rows, warm.rows, strict=True)]:
        want = _logprobs(engine.model, ids)[-1][mx.array(cands)]
        assert row.logprobs == pytest.approx(want.tolist(), abs=1e-4)


def _peak_over_active(scorer: PrefixScorer, rows: list[list[int]]) -> int:
    """MLX memory at its peak while `scorer` scores `rows`, over what was in use before."""
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    head = CandidateHead(rows)
    scorer.score([head])
    mx.eval([x for x in head.logits if x is not None])
    return int(mx.get_peak_memory() - before)


def test_a_suffix_batch_holds_no_copy_of_the_prefix_per_row(
    model_dir: Path, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What scoring 64 rows on a 1,024-token prefix adds to memory at its peak stays under half of what
    copying the prefix into every row took for its keys and values alone (`broadcast_batch`, the way a
    model whose attention cannot read the prefix in place still goes), and under half of that way's
    peak, the way packed or cascaded. (On the CPU, MLX's attention materialises its scores, the rest of
    the peak: the prefix goes in 256-token chunks and the rows are short, so those stay small.)"""
    engine = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0))
    model = engine.model
    rng = random.Random(5)
    shared = [rng.randrange(5, model.args.vocab_size) for _ in range(1024)]
    rows = [shared + [rng.randrange(5, model.args.vocab_size) for _ in range(4)] for _ in range(64)]
    scorer = PrefixScorer(model, prefill_chunk=256, max_batch_rows=64)
    scorer.score([CandidateHead(rows[:2])])  # the shapes' first run out of the way
    in_place = _peak_over_active(scorer, rows)
    monkeypatch.setattr(type(model), "reads_shared_prefix", property(lambda self: False))
    copied = _peak_over_active(scorer, rows)
    copies = len(rows) * len(shared) * engine.kv_bytes_per_token
    assert in_place < copies // 2
    assert copied > 2 * in_place


def test_packs_keep_their_own_columns_within_the_prefix() -> None:
    assert rows_per_pack(64, 64, 2048) == 32 and rows_per_pack(64, 64, 512) == 8
    assert rows_per_pack(64, 64, 32) == 1 and rows_per_pack(3, 64, 4096) == 3
    assert rows_per_pack(64, 64, 1536, bucket=True) == 16  # 24 rows' columns, a power of two of rows
    packs = RowPacks(rows=5, width=3, prefix=6)
    assert (packs.per_pack, packs.packs) == (2, 3)


def test_a_pack_mask_shows_the_prefix_and_each_rows_own_earlier_tokens() -> None:
    packs = RowPacks(rows=2, width=2, prefix=4)  # one pack: row 0's two tokens, then row 1's
    mask = packs.mask(None, 0, mx.float32)[0, 0] == 0
    assert mask.tolist() == [
        [True, True, True, True, True, False, False, False],
        [True, True, True, True, True, True, False, False],
        [True, True, True, True, False, False, True, False],
        [True, True, True, True, False, False, True, True],
    ]
    # A window of 3: position 4 (a row's first token) sees positions 2..4; a cache holding positions
    # 1..3 only (base 1) has one prefix column fewer.
    windowed = packs.mask(3, 1, mx.float32)[0, 0] == 0
    assert windowed.tolist() == [
        [False, True, True, True, False, False, False],
        [False, False, True, True, True, False, False],
        [False, True, True, False, False, True, False],
        [False, False, True, False, False, True, True],
    ]
    bucketed = RowPacks(rows=2, width=2, prefix=4, bucket=True).mask(None, 0, mx.float32)
    assert bucketed.shape == (1, 1, 4, 256) and not (bucketed[..., 8:] == 0).any().item()
