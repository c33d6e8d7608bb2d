"""A per-request `Sampler` that composes the filters (`logit_filters.py`), and the row-wise draw it shares
with a decode batch's `SamplerRows` (`sampler_rows.py`).

Draws go through the row-wise filters (`draw_rows`), alone (one row) or batched, so a seeded request
gets the same tokens either way.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlxq.worker.engine.constraint import Constraint
from mlxq.worker.engine.logit_filters import (
    apply_presence_frequency_penalty,
    check_finite,
    check_repetition_penalty,
    dense_bias,
    min_p_rows,
    penalize_tokens,
    top_k_rows,
    top_p_rows,
)

_NEG_INF = float("-inf")


class SamplingOptions(Protocol):
    """What `Sampler.from_request` reads: the sampling fields of a generation request."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float

    @property  # read-only, so a request's `dict` fits
    def logit_bias(self) -> Mapping[int, float]: ...


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
        constraint: Constraint | None = None,
    ) -> None:
        _validate(vocab_size, temperature, top_p, top_k, min_p)
        check_repetition_penalty(repetition_penalty)
        check_finite("presence_penalty", presence_penalty)
        check_finite("frequency_penalty", frequency_penalty)
        self.temperature, self.top_p, self.top_k, self.min_p = temperature, top_p, top_k, min_p
        self.repetition_penalty = repetition_penalty
        self.presence_penalty, self.frequency_penalty = presence_penalty, frequency_penalty
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self._key = mx.random.key(self.seed % 2**64)
        self._bias = dense_bias(logit_bias, vocab_size) if logit_bias else None
        penalized = repetition_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0
        self._counts = mx.zeros((vocab_size,), dtype=mx.float32) if penalized else None
        self._prompt_seen: mx.array | None = None
        if repetition_penalty != 1.0 and len(prompt):
            ids = mx.array(list(prompt), dtype=mx.int32)
            self._prompt_seen = mx.zeros((vocab_size,), dtype=mx.int32).at[ids].add(1) > 0
        self._observed = 0  # generated tokens counted so far
        self.row = RowParams.of(self, vocab_size)
        self._row_arrays: RowArrays | None = None  # built at the first draw
        self.constraint = constraint  # structured output: the tokens its grammar allows
        self.logprobs: int | None = None  # alternatives its tokens' logprobs carry; None: none asked

    @classmethod
    def from_request(
        cls,
        request: SamplingOptions,
        vocab_size: int,
        prompt: Sequence[int] = (),
        constraint: Constraint | None = None,
    ) -> Sampler:
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
            constraint=constraint,
        )

    @property
    def greedy(self) -> bool:
        """Temperature 0: always the most likely token, no randomness."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether penalties apply: its logits depend on its own history (`process_logits`)."""
        return self._counts is not None

    @property
    def bias(self) -> mx.array | None:
        """The dense (vocab,) float32 logit bias, or None."""
        return self._bias

    def __call__(self, logits: mx.array, history: Sequence[int] | None = None) -> mx.array:
        """The next token, shape (1,), from (1, vocab) logits; lazy, nothing is evaluated here.

        `history` (the generated ids so far) is an alternative to calling `observe`: only the ids not
        yet observed are counted, so passing the growing list each step stays O(1) per token.
        A constrained sampler draws through `SamplerRows`, which advances its constraint.
        """
        if self.constraint is not None:
            raise ValueError("a constrained sampler draws in a SamplerRows (it advances the constraint)")
        if history is not None and len(history) > self._observed:
            for token in history[self._observed :]:
                self.observe(token)
        logits = self.process_logits(logits)
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        if self._row_arrays is None:
            self._row_arrays = RowArrays([self.row])
        tokens, keys = draw_rows(logits, self._row_arrays, self._key[None])
        self._key = keys[0]
        return tokens

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


@dataclass(frozen=True)
class RowParams:
    """A sampler's settings as the row-wise filters take them (an "off" value keeps every logit)."""

    inv_temperature: float  # 1 / temperature; 1.0 for a greedy sampler (it never draws)
    top_k: int  # 0 when top-k is off (also for a k of the whole vocabulary)
    top_p: float  # 2.0 when top-p is off
    log_min_p: float  # -inf when min-p is off

    @classmethod
    def of(cls, s: Sampler, vocab_size: int) -> RowParams:
        return cls(
            inv_temperature=1.0 / s.temperature if s.temperature > 0 else 1.0,
            top_k=s.top_k if s.top_k < vocab_size else 0,
            top_p=s.top_p if s.top_p < 1.0 else 2.0,
            log_min_p=math.log(s.min_p) if s.min_p > 0 else _NEG_INF,
        )


class RowArrays:
    """The settings of a batch's rows as (B, 1) arrays, built once per change of the rows; a filter no
    row uses is None (and skipped)."""

    def __init__(self, rows: Sequence[RowParams]) -> None:
        self.inv_temperature = _column([r.inv_temperature for r in rows], mx.float32)
        self.top_k_max = max(r.top_k for r in rows)
        self.top_k = _column([r.top_k for r in rows], mx.int32) if self.top_k_max else None
        use_top_p = any(r.top_p <= 1.0 for r in rows)
        self.top_p = _column([r.top_p for r in rows], mx.float32) if use_top_p else None
        use_min_p = any(r.log_min_p > _NEG_INF for r in rows)
        self.log_min_p = _column([r.log_min_p for r in rows], mx.float32) if use_min_p else None


def _column(values: Sequence[float], dtype: mx.Dtype) -> mx.array:
    return mx.array(list(values), dtype=dtype)[:, None]


def split_keys(keys: mx.array) -> mx.array:
    """(B, 2) PRNG keys split in two, (B, 2, 2): each row's key split as it is alone."""
    return mx.vmap(mx.random.split)(keys)


def categorical(keys: mx.array, logits: mx.array) -> mx.array:
    """One draw per row of (B, vocab) `logits`, each with its row's key of (B, 2) `keys`: (B,) tokens."""
    return mx.vmap(lambda key, row: mx.random.categorical(row, key=key))(keys, logits)


def draw_rows(logits: mx.array, rows: RowArrays, keys: mx.array) -> tuple[mx.array, mx.array]:
    """One draw per row of (B, vocab) logits with its own settings (temperature, top-k, top-p, min-p, in
    that order) and PRNG key: the (B,) tokens and the (B, 2) keys of the next draw. Row i's token depends
    on its own logits, settings and key only, so a sampler draws the same alone (B = 1)."""
    pairs = split_keys(keys)
    return categorical(pairs[:, 1], filter_rows(logits, rows)), pairs[:, 0]


def filter_rows(logits: mx.array, rows: RowArrays, repeat: int = 1) -> mx.array:
    """(B * repeat, vocab) logits scaled and filtered by each row's settings (temperature, top-k, top-p,
    min-p): the logits a row draws from. With `repeat`, rows come in runs of `repeat` (a verify step's
    positions of one row), each run with its row's settings."""

    def column(a: mx.array) -> mx.array:
        return a if repeat == 1 else mx.repeat(a, repeat, axis=0)

    x = logits * column(rows.inv_temperature)
    if rows.top_k is not None:
        x = top_k_rows(x, column(rows.top_k), rows.top_k_max)
    if rows.top_p is not None:
        x = top_p_rows(x, column(rows.top_p))
    if rows.log_min_p is not None:
        x = min_p_rows(x, column(rows.log_min_p))
    return x
