"""Sampling's small pure functions on (B, vocab) logits, and their row-wise forms for a batch.

Filters mask the tokens they drop with -inf and leave the rest unchanged. Order, as in transformers:
logit bias, repetition penalty, presence/frequency penalties, then greedy `argmax` (temperature 0) or
temperature, top-k, top-p, min-p and a draw from the remaining distribution (`sampler.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import mlx.core as mx

_NEG_INF = float("-inf")


def apply_temperature(logits: mx.array, temperature: float) -> mx.array:
    """Divide logits by `temperature` (> 0; temperature 0 is greedy and never reaches here)."""
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0 to scale logits, got {temperature}")
    return logits if temperature == 1.0 else logits * (1.0 / temperature)


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """Keep the `k` largest logits per row (ties with the k-th are kept, as in transformers); 0 = off."""
    if k < 0:
        raise ValueError(f"top_k must be >= 0 (0 turns it off), got {k}")
    if k == 0 or k >= logits.shape[-1]:
        return logits
    return top_k_rows(logits, mx.array([[k]], dtype=mx.int32), k)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability reaches `p` (nucleus sampling)."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if p == 1.0:
        return logits
    return top_p_rows(logits, mx.array([[p]], dtype=mx.float32))


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """Drop tokens whose probability is below `min_p` times the most likely token's; 0 = off."""
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_p == 0.0:
        return logits
    return min_p_rows(logits, mx.array([[math.log(min_p)]], dtype=mx.float32))


# Row-wise forms of the filters: one parameter per row, (B, 1) (or (1, 1) for all rows), so a batch whose
# rows sample with different settings filters all of them in one graph. A row's "off" value leaves it as
# it is (see `sampler.RowParams`).


def top_k_rows(logits: mx.array, k: mx.array, k_max: int) -> mx.array:
    """Top-k with each row's k (0 keeps every logit); `k_max` is the largest, below the vocabulary size.

    Only the `k_max` largest logits of a row are sorted (a partition first): a full sort of a 49k
    vocabulary for 64 rows takes ~10x as long on the CPU."""
    largest = -mx.partition(-logits, k_max - 1, axis=-1)[..., :k_max]  # the k_max largest, any order
    ranked = mx.sort(largest, axis=-1)  # ascending: the k-th largest at k_max - k
    threshold = mx.take_along_axis(ranked, mx.maximum(k_max - k, 0), axis=-1)
    threshold = mx.where(k > 0, threshold, _NEG_INF)
    return mx.where(logits < threshold, _NEG_INF, logits)


def top_p_rows(logits: mx.array, p: mx.array) -> mx.array:
    """Top-p with each row's p (a p above 1 keeps every logit)."""
    order = mx.argsort(-logits, axis=-1)
    ranked = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(ranked, axis=-1)
    # A token stays when the probability of the tokens ranked above it is still short of p; the top stays.
    before = mx.cumsum(probs, axis=-1) - probs
    ranked = mx.where(before < p, ranked, _NEG_INF)
    return mx.put_along_axis(logits, order, ranked, axis=-1)


def min_p_rows(logits: mx.array, log_min_p: mx.array) -> mx.array:
    """Min-p with each row's log(min_p) (-inf keeps every logit)."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); no softmax needed.
    floor = mx.max(logits, axis=-1, keepdims=True) + log_min_p
    return mx.where(logits < floor, _NEG_INF, logits)


def penalize_tokens(logits: mx.array, mask: mx.array, penalty: float) -> mx.array:
    """Repetition penalty on the tokens where `mask` (vocab,) or (B, vocab) is true."""
    penalized = mx.where(logits > 0, logits / penalty, logits * penalty)
    return mx.where(mask, penalized, logits)


def apply_repetition_penalty(
    logits: mx.array, history_ids: Sequence[int] | mx.array, penalty: float
) -> mx.array:
    """transformers' repetition penalty: each token seen in `history_ids` has a positive logit divided by
    `penalty` and a negative one multiplied by it (once per token, however often it was seen)."""
    check_repetition_penalty(penalty)
    ids = history_ids if isinstance(history_ids, mx.array) else mx.array(list(history_ids), dtype=mx.int32)
    if penalty == 1.0 or ids.size == 0:
        return logits
    mask = mx.zeros((logits.shape[-1],), dtype=mx.int32).at[ids].add(1) > 0
    return penalize_tokens(logits, mask, penalty)


def apply_presence_frequency_penalty(
    logits: mx.array, counts: mx.array, presence: float, frequency: float
) -> mx.array:
    """OpenAI's penalties: subtract `presence` once for every token seen and `frequency` per occurrence.

    `counts` holds each token's occurrences so far, shape (vocab,) or (B, vocab).
    """
    check_finite("presence_penalty", presence)
    check_finite("frequency_penalty", frequency)
    if presence == 0.0 and frequency == 0.0:
        return logits
    counts = counts.astype(logits.dtype)
    return logits - presence * (counts > 0).astype(logits.dtype) - frequency * counts


def apply_logit_bias(logits: mx.array, bias: Mapping[int, float]) -> mx.array:
    """Add `bias[token]` to each listed token's logit (OpenAI's `logit_bias`)."""
    if not bias:
        return logits
    return logits + dense_bias(bias, logits.shape[-1]).astype(logits.dtype)


def dense_bias(bias: Mapping[int, float], vocab_size: int) -> mx.array:
    """`bias` as a dense (vocab,) float32 array; a token outside the vocabulary or a non-finite value
    raises `ValueError`."""
    _check_logit_bias(bias, vocab_size)
    ids = mx.array(list(bias.keys()), dtype=mx.int32)
    return (
        mx.zeros((vocab_size,), dtype=mx.float32).at[ids].add(mx.array(list(bias.values()), dtype=mx.float32))
    )


def check_finite(name: str, value: float) -> None:
    """Raise `ValueError` naming `name` unless `value` is finite."""
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def check_repetition_penalty(penalty: float) -> None:
    """Raise `ValueError` unless `penalty` is finite and > 0."""
    if not (penalty > 0 and math.isfinite(penalty)):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 turns it off), got {penalty}")


def _check_logit_bias(bias: Mapping[int, float], vocab_size: int) -> None:
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(
                f"logit_bias token {token!r} is not an id of this model's vocabulary (0..{vocab_size - 1})"
            )
        check_finite(f"logit_bias[{token}]", value)
