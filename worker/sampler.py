"""Sampling: small pure functions on (B, vocab) logits, and a per-request `Sampler` that composes them.

Filters mask the tokens they drop with -inf and leave the rest unchanged. Order, as in transformers:
logit bias, repetition penalty, presence/frequency penalties, then greedy `argmax` (temperature 0) or
temperature, top-k, top-p, min-p and a draw from the remaining distribution.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

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
    kth = -mx.partition(-logits, k - 1, axis=-1)[..., k - 1 : k]
    return mx.where(logits < kth, _NEG_INF, logits)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability reaches `p` (nucleus sampling)."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if p == 1.0:
        return logits
    order = mx.argsort(-logits, axis=-1)
    ranked = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(ranked, axis=-1)
    # A token stays when the probability of the tokens ranked above it is still short of p; the top stays.
    before = mx.cumsum(probs, axis=-1) - probs
    ranked = mx.where(before < p, ranked, _NEG_INF)
    return mx.put_along_axis(logits, order, ranked, axis=-1)


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """Drop tokens whose probability is below `min_p` times the most likely token's; 0 = off."""
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_p == 0.0:
        return logits
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); no softmax needed.
    floor = mx.max(logits, axis=-1, keepdims=True) + math.log(min_p)
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
    _check_repetition_penalty(penalty)
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
    _check_finite("presence_penalty", presence)
    _check_finite("frequency_penalty", frequency)
    if presence == 0.0 and frequency == 0.0:
        return logits
    counts = counts.astype(logits.dtype)
    return logits - presence * (counts > 0).astype(logits.dtype) - frequency * counts


def apply_logit_bias(logits: mx.array, bias: Mapping[int, float]) -> mx.array:
    """Add `bias[token]` to each listed token's logit (OpenAI's `logit_bias`)."""
    if not bias:
        return logits
    return logits + _dense_bias(bias, logits.shape[-1]).astype(logits.dtype)


def _dense_bias(bias: Mapping[int, float], vocab_size: int) -> mx.array:
    _check_logit_bias(bias, vocab_size)
    ids = mx.array(list(bias.keys()), dtype=mx.int32)
    return (
        mx.zeros((vocab_size,), dtype=mx.float32).at[ids].add(mx.array(list(bias.values()), dtype=mx.float32))
    )


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _check_repetition_penalty(penalty: float) -> None:
    if not (penalty > 0 and math.isfinite(penalty)):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 turns it off), got {penalty}")


def _check_logit_bias(bias: Mapping[int, float], vocab_size: int) -> None:
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(
                f"logit_bias token {token!r} is not an id of this model's vocabulary (0..{vocab_size - 1})"
            )
        _check_finite(f"logit_bias[{token}]", value)


class SamplingOptions(Protocol):
    """What `Sampler.from_request` reads: the sampling fields of a generation request."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    logit_bias: Mapping[int, float]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float


class Sampler:
    """Picks the next token of one request from its (1, vocab) logits.

    Holds what must persist between steps: a PRNG key derived from `seed` alone (split once per draw, so
    the same seed and request give the same tokens whatever else the process samples), and a running
    count of generated tokens for the penalties, updated one token at a time by `observe`.
    Repetition penalty also covers `prompt` ids (as transformers); presence/frequency penalties count
    generated tokens only (as OpenAI).
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        prompt: Sequence[int] = (),
    ) -> None:
        _validate(vocab_size, temperature, top_p, top_k, min_p)
        _check_repetition_penalty(repetition_penalty)
        _check_finite("presence_penalty", presence_penalty)
        _check_finite("frequency_penalty", frequency_penalty)
        self.temperature, self.top_p, self.top_k, self.min_p = temperature, top_p, top_k, min_p
        self.repetition_penalty = repetition_penalty
        self.presence_penalty, self.frequency_penalty = presence_penalty, frequency_penalty
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self._key = mx.random.key(self.seed % 2**64)
        self._bias = _dense_bias(logit_bias, vocab_size) if logit_bias else None
        penalized = repetition_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0
        self._counts = mx.zeros((vocab_size,), dtype=mx.float32) if penalized else None
        self._prompt_seen: mx.array | None = None
        if repetition_penalty != 1.0 and len(prompt):
            ids = mx.array(list(prompt), dtype=mx.int32)
            self._prompt_seen = mx.zeros((vocab_size,), dtype=mx.int32).at[ids].add(1) > 0
        self._observed = 0  # generated tokens counted so far

    @classmethod
    def from_request(cls, request: SamplingOptions, vocab_size: int, prompt: Sequence[int] = ()) -> Sampler:
        """A sampler for a generation request (any object with the sampling fields)."""
        return cls(
            vocab_size,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            seed=request.seed,
            logit_bias=request.logit_bias,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            prompt=prompt,
        )

    @property
    def greedy(self) -> bool:
        """Temperature 0: always the most likely token, no randomness."""
        return self.temperature == 0.0

    @property
    def batchable(self) -> bool:
        """Greedy without penalties: its token is an argmax of the logits plus a fixed bias, so a batch
        picks it together with its batch-mates' (`sample_rows`)."""
        return self.greedy and self._counts is None

    @property
    def bias(self) -> mx.array | None:
        """The dense (vocab,) float32 logit bias, or None."""
        return self._bias

    def __call__(self, logits: mx.array, history: Sequence[int] | None = None) -> mx.array:
        """The next token, shape (1,), from (1, vocab) logits; lazy, nothing is evaluated here.

        `history` (the generated ids so far) is an alternative to calling `observe`: only the ids not
        yet observed are counted, so passing the growing list each step stays O(1) per token.
        """
        if history is not None and len(history) > self._observed:
            for token in history[self._observed :]:
                self.observe(token)
        logits = self.process_logits(logits)
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        logits = apply_temperature(logits, self.temperature)
        logits = apply_top_k(logits, self.top_k)
        logits = apply_top_p(logits, self.top_p)
        logits = apply_min_p(logits, self.min_p)
        self._key, step_key = mx.random.split(self._key)
        return mx.random.categorical(logits, key=step_key)

    def observe(self, token: mx.array | int) -> None:
        """Count a generated token for the penalties (lazily: an mx.array token is not evaluated)."""
        self._observed += 1
        if self._counts is not None:
            index = token if isinstance(token, mx.array) else mx.array([token], dtype=mx.int32)
            self._counts = self._counts.at[index.reshape(-1)].add(1.0)

    def process_logits(self, logits: mx.array) -> mx.array:
        """`logits` with the logit bias and penalties applied (float32 when any applies)."""
        if self._bias is None and self._counts is None:
            return logits
        logits = logits.astype(mx.float32)
        if self._bias is not None:
            logits = logits + self._bias
        if self._counts is None:
            return logits
        if self.repetition_penalty != 1.0:
            seen = self._counts > 0
            if self._prompt_seen is not None:
                seen = seen | self._prompt_seen
            logits = penalize_tokens(logits, seen, self.repetition_penalty)
        return apply_presence_frequency_penalty(
            logits, self._counts, self.presence_penalty, self.frequency_penalty
        )


def _validate(vocab_size: int, temperature: float, top_p: float, top_k: int, min_p: float) -> None:
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), got {top_k!r}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def stack_bias(samplers: Sequence[Sampler], vocab_size: int) -> mx.array | None:
    """The rows' logit biases as one (B, vocab) float32 array (zeros where a row has none); None if no
    row has one."""
    if all(s.bias is None for s in samplers):
        return None
    zeros = mx.zeros((vocab_size,), dtype=mx.float32)
    return mx.stack([zeros if s.bias is None else s.bias for s in samplers])


def sample_rows(logits: mx.array, samplers: Sequence[Sampler], bias: mx.array | None = None) -> mx.array:
    """One token per row of (B, vocab) logits, shape (B,), row i picked as `samplers[i]` would alone.

    Batchable rows (greedy, no penalties) share one argmax over `logits + bias` (`bias` from
    `stack_bias`; adding a row of zeros, or casting to float32, never changes a row's argmax), so a
    batch of greedy rows costs one small graph per step instead of one per row. Other rows call their
    own sampler (penalty counts, PRNG key). Every sampler observes its token.
    """
    if len(samplers) != logits.shape[0]:
        raise ValueError(f"{len(samplers)} samplers for {logits.shape[0]} rows of logits")
    together = logits if bias is None else logits.astype(mx.float32) + bias
    picked = mx.argmax(together, axis=-1)
    if all(s.batchable for s in samplers):
        for s in samplers:
            s.observe(picked)  # counts nothing (no penalties): only the number of tokens
        return picked
    pieces: list[mx.array] = []
    run_start: int | None = None  # first row of the current run of batchable rows
    for i, s in enumerate(samplers):
        if s.batchable:
            s.observe(picked)
            run_start = i if run_start is None else run_start
            continue
        if run_start is not None:
            pieces.append(picked[run_start:i])
            run_start = None
        token = s(logits[i : i + 1]).reshape(1)
        s.observe(token)
        pieces.append(token)
    if run_start is not None:
        pieces.append(picked[run_start:])
    return mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]
