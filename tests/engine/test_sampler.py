"""Sampling filters against numpy references, the Sampler's determinism, distributions and validation."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxq.worker.engine.logit_filters import (
    apply_logit_bias,
    apply_min_p,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    min_p_rows,
    top_k_rows,
    top_p_rows,
)
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.sampler_rows import SamplerRows

V = 64


def _logits(seed: int = 0, rows: int = 3, scale: float = 3.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal((rows, V))).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# --- numpy references, written from transformers' logits warpers ---------------------------------------


def _ref_top_k(x: np.ndarray, k: int) -> np.ndarray:
    kth = np.sort(x, axis=-1)[:, -k][:, None]
    return np.where(x < kth, -np.inf, x)


def _ref_top_p(x: np.ndarray, p: float) -> np.ndarray:
    order = np.argsort(x, axis=-1)  # ascending, as transformers' TopPLogitsWarper
    probs = _softmax(np.take_along_axis(x, order, axis=-1))
    remove_sorted = np.cumsum(probs, axis=-1) <= 1 - p
    remove_sorted[:, -1] = False  # keep at least one
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, -np.inf, x)


def _ref_min_p(x: np.ndarray, min_p: float) -> np.ndarray:
    probs = _softmax(x)
    return np.where(probs < min_p * probs.max(axis=-1, keepdims=True), -np.inf, x)


def _ref_repetition(x: np.ndarray, history: list[int], penalty: float) -> np.ndarray:
    out = x.copy()
    ids = np.unique(history)
    picked = out[:, ids]
    out[:, ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def _close(a: mx.array, b: np.ndarray) -> None:
    got = np.array(a)
    assert np.array_equal(np.isinf(got), np.isinf(b))
    np.testing.assert_allclose(got[np.isfinite(got)], b[np.isfinite(b)], rtol=1e-5, atol=1e-5)


# --- filters ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0.3, 1.0, 2.5])
def test_temperature(t: float) -> None:
    x = _logits()
    _close(apply_temperature(mx.array(x), t), x / t)


@pytest.mark.parametrize("k", [0, 1, 5, V - 1, V, V + 10])
def test_top_k(k: int) -> None:
    x = _logits(1)
    want = x if k == 0 or k >= V else _ref_top_k(x, k)
    _close(apply_top_k(mx.array(x), k), want)


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.999, 1.0])
def test_top_p(p: float) -> None:
    for seed in range(5):
        x = _logits(seed)
        _close(apply_top_p(mx.array(x), p), _ref_top_p(x, p))


@pytest.mark.parametrize("m", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p(m: float) -> None:
    x = _logits(2)
    _close(apply_min_p(mx.array(x), m), _ref_min_p(x, m) if m else x)


def test_filters_keep_the_top_token() -> None:
    x = mx.array(_logits(3))
    top = np.argmax(np.array(x), axis=-1)
    for out in (apply_top_k(x, 1), apply_top_p(x, 1e-9), apply_min_p(x, 1.0)):
        assert np.array_equal(np.argmax(np.array(out), axis=-1), top)
        assert (np.isfinite(np.array(out)).sum(axis=-1) == 1).all()


def test_row_wise_filters_apply_each_rows_own_setting() -> None:
    x = _logits(13, rows=4)
    ks, ps, ms = [1, 0, 5, V - 1], [0.5, 2.0, 0.9, 1e-6], [0.1, 0.0, 0.5, 1.0]  # 0 / 2.0 / 0.0: off
    k = mx.array([[k] for k in ks], dtype=mx.int32)
    log_min_p = mx.array([[math.log(m) if m else -math.inf] for m in ms], dtype=mx.float32)
    got_k = top_k_rows(mx.array(x), k, max(ks))
    got_p = top_p_rows(mx.array(x), mx.array([[p] for p in ps], dtype=mx.float32))
    got_m = min_p_rows(mx.array(x), log_min_p)
    for i in range(4):
        row = x[i : i + 1]
        _close(got_k[i : i + 1], _ref_top_k(row, ks[i]) if ks[i] else row)
        _close(got_p[i : i + 1], _ref_top_p(row, ps[i]) if ps[i] <= 1 else row)
        _close(got_m[i : i + 1], _ref_min_p(row, ms[i]) if ms[i] else row)


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3])
def test_repetition_penalty(penalty: float) -> None:
    x = _logits(4)
    history = [3, 7, 7, 60, 0]
    _close(apply_repetition_penalty(mx.array(x), history, penalty), _ref_repetition(x, history, penalty))
    _close(apply_repetition_penalty(mx.array(x), [], penalty), x)


def test_presence_frequency_penalty() -> None:
    x = _logits(5)
    counts = np.zeros(V, dtype=np.float32)
    counts[[1, 2, 2, 9]] += 1
    counts[2] += 1
    got = apply_presence_frequency_penalty(mx.array(x), mx.array(counts), 0.7, 0.25)
    _close(got, x - 0.7 * (counts > 0) - 0.25 * counts)


def test_logit_bias() -> None:
    x = _logits(6)
    want = x.copy()
    want[:, 5] += 3.0
    want[:, 63] -= 100.0
    _close(apply_logit_bias(mx.array(x), {5: 3.0, 63: -100.0}), want)
    _close(apply_logit_bias(mx.array(x), {}), x)


# --- the Sampler ----------------------------------------------------------------------------------------


def _draw(sampler: Sampler, logits: mx.array, n: int) -> list[int]:
    tokens = []
    for _ in range(n):
        token = sampler(logits)
        sampler.observe(token)
        tokens.append(int(token.item()))
    return tokens


def test_greedy_is_argmax() -> None:
    x = mx.array(_logits(7, rows=1))
    sampler = Sampler(V, temperature=0.0)
    assert sampler.greedy
    assert int(sampler(x).item()) == int(np.argmax(np.array(x)))
    assert _draw(sampler, x, 5) == [int(np.argmax(np.array(x)))] * 5


def test_same_seed_same_tokens_whatever_else_happens() -> None:
    x = mx.array(_logits(8, rows=1, scale=1.0))
    first = _draw(Sampler(V, seed=1234), x, 50)
    mx.random.seed(99)  # global PRNG state and other samplers must not matter
    other = Sampler(V, seed=1234)
    noise = Sampler(V)
    again = []
    for _ in range(50):
        _draw(noise, x, 1)
        mx.random.uniform(shape=(3,))
        again += _draw(other, x, 1)
    assert again == first
    assert _draw(Sampler(V, seed=1235), x, 50) != first
    assert len(set(first)) > 5  # really sampling, not greedy


def test_seeds_outside_uint64_and_no_seed() -> None:
    x = mx.array(_logits(9, rows=1, scale=1.0))
    assert _draw(Sampler(V, seed=-1), x, 10) == _draw(Sampler(V, seed=2**64 - 1), x, 10)
    assert Sampler(V).seed != Sampler(V).seed


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = mx.array(_logits(10, rows=1, scale=1.0))
    greedy = int(np.argmax(np.array(x)))
    assert set(_draw(Sampler(V, top_k=1, seed=1), x, 30)) == {greedy}
    assert set(_draw(Sampler(V, top_p=1e-6, seed=2), x, 30)) == {greedy}
    assert set(_draw(Sampler(V, min_p=1.0, seed=3), x, 30)) == {greedy}


def _frequencies(sampler: Sampler, logits: np.ndarray, n: int = 2000) -> np.ndarray:
    counts = np.bincount(_draw(sampler, mx.array(logits[None]), n), minlength=logits.shape[-1])
    return counts / n


def test_sampled_frequencies_follow_softmax() -> None:
    x = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=np.float32))
    freq = _frequencies(Sampler(6, temperature=1.0, seed=5), x)
    np.testing.assert_allclose(freq, _softmax(x[None])[0], atol=0.04)


def test_sampled_frequencies_with_temperature_and_top_k() -> None:
    x = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=np.float32))
    freq = _frequencies(Sampler(6, temperature=2.0, top_k=4, seed=6), x)
    want = _softmax(x[None, :4] / 2.0)[0]
    np.testing.assert_allclose(freq[:4], want, atol=0.04)
    assert freq[4:].sum() == 0


def test_sampler_penalties_match_numpy_and_history_equals_observe() -> None:
    x = _logits(11, rows=1)
    prompt, generated = [4, 5], [7, 7, 9]
    kwargs = {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.2}
    observed = Sampler(V, temperature=0.0, prompt=prompt, logit_bias={1: 2.0}, **kwargs)
    for t in generated:
        observed.observe(mx.array([t]))
    by_history = Sampler(V, temperature=0.0, prompt=prompt, logit_bias={1: 2.0}, **kwargs)
    by_history(mx.array(x), history=generated[:1])
    by_history(mx.array(x), history=generated)  # only the unseen tail is counted
    want = x.copy()
    want[:, 1] += 2.0
    want = _ref_repetition(want, prompt + generated, 1.5)
    counts = np.bincount(generated, minlength=V)
    want = want - 0.5 * (counts > 0) - 0.2 * counts
    _close(observed.process_logits(mx.array(x)), want)
    _close(by_history.process_logits(mx.array(x)), want)


def test_repetition_penalty_steers_greedy_away() -> None:
    x = mx.array(np.array([[2.0, 1.9, 1.5, -1.0]], dtype=np.float32))
    assert _draw(Sampler(4, temperature=0.0, repetition_penalty=2.0), x, 3) == [0, 1, 2]
    assert _draw(Sampler(4, temperature=0.0, frequency_penalty=0.15), x, 4) == [0, 1, 0, 1]
    assert _draw(Sampler(4, temperature=0.0, logit_bias={3: 10.0}), x, 1) == [3]


_ROW_SETTINGS: list[dict[str, object]] = [
    {"temperature": 0.0},
    {"temperature": 0.0, "logit_bias": {3: 4.0}},
    {"temperature": 0.8, "seed": 1},
    {"temperature": 1.3, "top_k": 5, "seed": 2},
    {"temperature": 0.7, "top_p": 0.9, "seed": 3},
    {"temperature": 1.0, "min_p": 0.05, "logit_bias": {7: -3.0}, "seed": 4},
    {"temperature": 1.1, "top_k": 20, "top_p": 0.8, "min_p": 0.02, "seed": 5},
    {"temperature": 0.9, "repetition_penalty": 1.4, "frequency_penalty": 0.3, "seed": 6},
    {"temperature": 0.0, "presence_penalty": 0.8},
]


def _step_logits(step: int, rows: int) -> np.ndarray:
    return _logits(100 + step, rows=rows, scale=1.5)


def test_sampler_rows_pick_what_each_sampler_picks_alone() -> None:
    """Every setting in one batch, rows leaving and joining on the way: each row's tokens are the ones
    its sampler draws alone from the same logits (same seed, same key splits, same penalties)."""
    n = len(_ROW_SETTINGS)
    alone = [Sampler(V, prompt=[1, 2], **kw) for kw in _ROW_SETTINGS]  # type: ignore[arg-type]
    batched = [Sampler(V, prompt=[1, 2], **kw) for kw in _ROW_SETTINGS]  # type: ignore[arg-type]
    rows = SamplerRows(batched[:6], V)
    live = list(range(6))  # which setting each row holds
    want: dict[int, list[int]] = {i: [] for i in range(n)}
    got: dict[int, list[int]] = {i: [] for i in range(n)}
    for step in range(12):
        x = _step_logits(step, n)
        tokens = rows.sample(mx.array(x[live])).tolist()
        for row, i in enumerate(live):
            got[i].append(tokens[row])
            token = alone[i](mx.array(x[i : i + 1]))
            alone[i].observe(token)
            want[i].append(int(token.item()))
        if step == 3:  # rows 1 and 4 leave, the last three settings join
            live = [0, 2, 3, 5]
            rows.select([0, 2, 3, 5])
            rows.extend(SamplerRows(batched[6:], V))
            live += [6, 7, 8]
    assert got == want
    assert len(set(got[2])) > 3  # really sampling


def test_half_precision_logits_are_processed_in_float32() -> None:
    x = mx.array(_logits(12, rows=1)).astype(mx.bfloat16)
    out = Sampler(V, temperature=0.0, presence_penalty=0.1).process_logits(x)
    assert out.dtype == mx.float32


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -1),
        ("top_k", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", math.nan),
        ("frequency_penalty", -math.inf),
    ],
)
def test_bad_values_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field) as err:
        Sampler(V, **{field: value})
    assert str(value) in str(err.value)


@pytest.mark.parametrize("bias", [{V: 1.0}, {-1: 1.0}, {3: math.nan}, {3: math.inf}])
def test_bad_logit_bias(bias: dict[int, float]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        Sampler(V, logit_bias=bias)
    with pytest.raises(ValueError, match="logit_bias"):
        apply_logit_bias(mx.array(_logits()), bias)


def test_bad_values_in_the_pure_functions() -> None:
    x = mx.array(_logits())
    for call, name in [
        (lambda: apply_temperature(x, 0.0), "temperature"),
        (lambda: apply_top_k(x, -2), "top_k"),
        (lambda: apply_top_p(x, 0.0), "top_p"),
        (lambda: apply_min_p(x, 2.0), "min_p"),
        (lambda: apply_repetition_penalty(x, [1], 0.0), "repetition_penalty"),
        (lambda: apply_presence_frequency_penalty(x, mx.zeros((V,)), math.nan, 0.0), "presence_penalty"),
    ]:
        with pytest.raises(ValueError, match=name):
            call()


def test_from_request() -> None:
    from mlxq.jobs.schema import GenerateRequest

    request = GenerateRequest(prompt="hi", temperature=0.0, top_k=3, seed=7, logit_bias={2: 1.0})
    sampler = Sampler.from_request(request, vocab_size=V, prompt=[1, 2])
    assert sampler.greedy and sampler.top_k == 3 and sampler.seed == 7
