"""Sliding-window masks (`window.py`) against the window's definition by positions.

A query at position p sees keys at positions j with p - j < window (transformers' overlay). The masks
the engine builds carry no positions, only visible columns; these tests give each column its position
explicitly (left padding, holes of a verify step) and check that the narrowed mask is the definition.
Models running the windows through the engine are held against transformers in `test_models.py`,
`test_token_scoring.py`, `test_moe.py` (batches, ragged decode, prefix cache) and `test_speculation.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.models import attention
from mlxq.worker.engine.models.loader import load_model
from mlxq.worker.engine.models.window import WindowMasks, keys_read, window_mask
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.ragged_attention import RaggedRows, decode_attention
from mlxq.worker.engine.sampler import Sampler


def _cache(lengths: list[int]) -> BatchKVCache:
    batch = BatchKVCache()
    rows = []
    for n in lengths:
        row = KVCache()
        row.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
        rows.append(row)
    batch.add(rows)
    return batch


def _by_positions(positions: list[list[int | None]], queries: list[list[int]], window: int) -> np.ndarray:
    """(B, 1, n, columns) mask from each column's position (None: not the row's) and each query's."""
    out = np.zeros((len(positions), 1, len(queries[0]), len(positions[0])), dtype=bool)
    for b, (cols, qs) in enumerate(zip(positions, queries, strict=True)):
        for i, p in enumerate(qs):
            for c, j in enumerate(cols):
                out[b, 0, i, c] = j is not None and j <= p and p - j < window
    return out


@pytest.mark.parametrize("window", [1, 3, 5, 40])
def test_a_causal_band_sees_exactly_the_last_window_positions(window: int) -> None:
    """The band covers only the columns some query sees (the last n + window - 1): attention reads
    only those keys."""
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, 9, 4)), mx.zeros((1, 1, 9, 4)))  # 9 cached, 4 new
    assert keys_read(cache, 4) == 13 and keys_read(cache, 1) == 10
    got = window_mask("causal", 4, keys_read(cache, 4), window)
    want = _by_positions([list(range(13))], [list(range(9, 13))], window)[0, 0]
    if window >= 13:
        assert got == "causal"  # nothing to narrow: plain causal attention stays the fast path
    else:
        assert isinstance(got, mx.array) and got.shape == (4, min(13, 4 + window - 1))
        assert not want[:, : 13 - got.shape[1]].any()  # the columns left out are seen by no query
        np.testing.assert_array_equal(np.array(got), want[:, 13 - got.shape[1] :])
    one = window_mask(None, 1, 10, window)  # one sequence's decode step: its last `window` keys
    if window < 10:
        assert isinstance(one, mx.array) and one.shape == (1, window) and np.array(one).all()


@pytest.mark.parametrize("window", [2, 4, 7])
def test_left_padding_and_verify_holes_are_not_counted_as_positions(window: int) -> None:
    """Rows of 3, 9 and 6 tokens, then a verify step of 3 columns of which rows keep 1, 3 and 0: the
    kept-less columns become holes, and the next step's 2 queries see through them."""
    cache = _cache([3, 9, 6])
    cache.write(mx.zeros((3, 1, 3, 4)), mx.zeros((3, 1, 3, 4)))
    cache.trim_rows(3, [1, 3, 0])
    assert cache.has_holes
    assert (cache.end, cache.starts) == (12, [6, 0, 3])
    n = 2
    mask = cache.mask(n)
    assert mask is not None
    x = None
    positions: list[list[int | None]] = [  # columns 0..11, then this step's two
        [x, x, x, x, x, x, 0, 1, 2, 3, x, x, 4, 5],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
        [x, x, x, 0, 1, 2, 3, 4, 5, x, x, x, 6, 7],
    ]
    queries = [[4, 5], [12, 13], [6, 7]]
    got = window_mask(mask, n, 0, window)
    assert isinstance(got, mx.array)
    np.testing.assert_array_equal(np.array(got), _by_positions(positions, queries, window))


def test_an_additive_mask_keeps_its_values_inside_the_window() -> None:
    visible = mx.array([[True, False, True, True, True]])
    additive = mx.where(visible, mx.array(0.0), mx.array(-mx.inf))
    got = np.array(window_mask(additive, 1, 0, 2))
    np.testing.assert_array_equal(got, [[-np.inf, -np.inf, -np.inf, 0.0, 0.0]])


def test_a_ragged_step_moves_each_rows_first_column_not_its_position() -> None:
    rows = RaggedRows(mx.array([0, 4, 9], dtype=mx.int32), end=12, capacity=256)
    narrowed = rows.window(5)
    assert narrowed.starts.tolist() == [7, 7, 9]
    assert narrowed.positions.tolist() == rows.positions.tolist() == [11, 7, 2]
    assert narrowed.end == rows.end


def test_each_window_is_made_once_per_forward_from_the_cache_as_it_was_before() -> None:
    """A global first layer writes this forward's keys before a windowed one asks for its mask: the
    key count is the one before the forward (a model mixing global and windowed layers)."""
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, 20, 4)), mx.zeros((1, 1, 20, 4)))
    masks = WindowMasks(None, 1, cache, [None, 4, 8])
    cache.update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))  # the first layer's write
    assert masks(None) is None
    assert masks(4) is masks(4)
    assert masks(4) is not masks(8)
    got = masks(4)
    assert isinstance(got, mx.array) and got.shape == (1, 4)  # the last 4 of 21 columns


def test_one_row_past_the_window_decodes_through_the_ragged_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows all as long need no mask for global attention, but a windowed layer past its window does:
    with the ragged kernel such a step goes through it (here MLX computes it), giving the mask's tokens."""
    from reference import make_hf_checkpoint, prompt_ids

    folder = make_hf_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=8)
    model, _ = load_model(folder, dtype="float32")
    calls: list[int] = []

    def counted(*a: Any, **k: Any) -> mx.array:
        calls.append(1)
        return decode_attention(*a, **k)

    monkeypatch.setattr(attention, "decode_attention", counted)
    ids = prompt_ids(folder)
    assert len(ids) > 8

    def run(kernel: bool) -> list[list[int]]:
        batch = DecodeBatch(model, ragged_kernel=kernel)
        cache = model.make_cache()
        logits = prefill(model, ids, cache, chunk=16)
        batch.add([cache], logits, [Sampler(model.args.vocab_size, temperature=0)])
        return [batch.step() for _ in range(6)]

    assert run(True) == run(False)
    assert len(calls) == 6 * len(model.layers)
