"""Sampling: small pure functions on (B, vocab) logits, a per-request `Sampler` that composes them, and
`SamplerRows`, a decode batch's samplers drawing for every row at once.

Filters mask the tokens they drop with -inf and leave the rest unchanged. Order, as in transformers:
logit bias, repetition penalty, presence/frequency penalties, then greedy `argmax` (temperature 0) or
temperature, top-k, top-p, min-p and a draw from the remaining distribution. Draws go through the
row-wise filters (`draw_rows`), alone (one row) or batched, so a seeded request gets the same tokens
either way; a batch of 64 sampled rows costs one small graph per step, not 64.

A sampler may carry a `Constraint` (structured output, `constraint.py`): its row's logits outside the
tokens the grammar allows are masked with -inf after the penalties, before greedy or a draw. The
masks are computed on the host once every constrained row took its token of the step before
(`SamplerRows.take`): as the draw is built (`SamplerRows.sample`), or, where the draw was built
before (`masks_later`, reading the rows' `MaskBuffer`), written into its memory before it is
launched (`SamplerRows.write_masks`, or on the mask thread: `SamplerRows.start_masks`). Rows without a
constraint are untouched.
A verify step masks each position of a constrained row with its grammar after the drafts before it
(`SamplerRows.cut` first drops the drafts the grammar does not allow).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from mlxq.worker.engine.constraint import (
    Constraint,
    MaskWork,
    fill_draft_masks,
    fill_mask_rows,
    start_mask_rows,
)
from mlxq.worker.engine.mask_buffer import MaskBuffer
from mlxq.worker.engine.token_logprobs import StepLogprobs, step_logprobs

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
# it is (see `_RowParams`).


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
        self.row = _RowParams.of(self, vocab_size)
        self._row_arrays: _RowArrays | None = None  # built at the first draw
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
            self._row_arrays = _RowArrays([self.row])
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
class _RowParams:
    """A sampler's settings as the row-wise filters take them (an "off" value keeps every logit)."""

    inv_temperature: float  # 1 / temperature; 1.0 for a greedy sampler (it never draws)
    top_k: int  # 0 when top-k is off (also for a k of the whole vocabulary)
    top_p: float  # 2.0 when top-p is off
    log_min_p: float  # -inf when min-p is off

    @classmethod
    def of(cls, s: Sampler, vocab_size: int) -> _RowParams:
        return cls(
            inv_temperature=1.0 / s.temperature if s.temperature > 0 else 1.0,
            top_k=s.top_k if s.top_k < vocab_size else 0,
            top_p=s.top_p if s.top_p < 1.0 else 2.0,
            log_min_p=math.log(s.min_p) if s.min_p > 0 else _NEG_INF,
        )


class _RowArrays:
    """The settings of a batch's rows as (B, 1) arrays, built once per change of the rows; a filter no
    row uses is None (and skipped)."""

    def __init__(self, rows: Sequence[_RowParams]) -> None:
        self.inv_temperature = _column([r.inv_temperature for r in rows], mx.float32)
        self.top_k_max = max(r.top_k for r in rows)
        self.top_k = _column([r.top_k for r in rows], mx.int32) if self.top_k_max else None
        use_top_p = any(r.top_p <= 1.0 for r in rows)
        self.top_p = _column([r.top_p for r in rows], mx.float32) if use_top_p else None
        use_min_p = any(r.log_min_p > _NEG_INF for r in rows)
        self.log_min_p = _column([r.log_min_p for r in rows], mx.float32) if use_min_p else None


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _bit_columns(width: int) -> tuple[mx.array, mx.array]:
    """Each token's int32 word in a bitmask row and its bit in that word (made once per width, from
    host data: no op of any thread's stream is kept)."""
    column = np.arange(width, dtype=np.uint32)
    return mx.array(column >> 5), mx.array(column & 31)


def _allowed(masks: np.ndarray, width: int) -> mx.array:
    """Bitmasks (..., words) int32 as (..., `width`) bool: True where a token is allowed."""
    return _allowed_bits(mx.array(masks.view(np.uint32)), width)


def _allowed_bits(masks: mx.array, width: int) -> mx.array:
    """Bitmasks (..., words) uint32 as (..., `width`) bool: True where a token is allowed."""
    word, bit = _bit_columns(width)
    return ((masks[..., word] >> bit) & 1).astype(mx.bool_)


def _column(values: Sequence[float], dtype: mx.Dtype) -> mx.array:
    return mx.array(list(values), dtype=dtype)[:, None]


def _split_keys(keys: mx.array) -> mx.array:
    return mx.vmap(mx.random.split)(keys)  # (B, 2) -> (B, 2, 2): each row's key split as it is alone


def _categorical(keys: mx.array, logits: mx.array) -> mx.array:
    return mx.vmap(lambda key, row: mx.random.categorical(row, key=key))(keys, logits)


def _leading(ok: mx.array) -> mx.array:
    """(B,) count of each row's leading True values of (B, n) `ok`."""
    if ok.shape[1] == 0:
        return mx.zeros((ok.shape[0],), dtype=mx.int32)
    return mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)


def draw_rows(logits: mx.array, rows: _RowArrays, keys: mx.array) -> tuple[mx.array, mx.array]:
    """One draw per row of (B, vocab) logits with its own settings (temperature, top-k, top-p, min-p, in
    that order) and PRNG key: the (B,) tokens and the (B, 2) keys of the next draw. Row i's token depends
    on its own logits, settings and key only, so a sampler draws the same alone (B = 1)."""
    pairs = _split_keys(keys)
    return _categorical(pairs[:, 1], filter_rows(logits, rows)), pairs[:, 0]


def filter_rows(logits: mx.array, rows: _RowArrays, repeat: int = 1) -> mx.array:
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


class SamplerRows:
    """The samplers of a decode batch's rows, picking every row's token in one graph per step.

    Row i gets the token `samplers[i]` would pick alone from the same logits: its logit bias (stacked),
    its penalties (the only per-row work: rows with penalties are processed one by one), argmax when
    greedy, else `draw_rows` with its settings and PRNG key. The keys live here, one (B, 2) array split
    for all rows at each draw; a sampler's own key is where its row started.
    """

    def __init__(self, samplers: Sequence[Sampler], vocab_size: int) -> None:
        self.samplers = list(samplers)
        self.vocab_size = vocab_size
        self._keys = mx.stack([s._key for s in self.samplers]) if self.samplers else None
        self._refresh()

    def __len__(self) -> int:
        return len(self.samplers)

    def _refresh(self) -> None:
        samplers = self.samplers
        self._bias = stack_bias(samplers, self.vocab_size) if samplers else None
        self._penalized = [i for i, s in enumerate(samplers) if s.penalized]
        self._penalized_set = frozenset(self._penalized)
        greedy = [s.greedy for s in samplers]
        self._any_greedy = any(greedy)
        self._arrays = None if all(greedy) else _RowArrays([s.row for s in samplers])
        mixed = self._any_greedy and self._arrays is not None
        self._greedy_mask = mx.array(greedy) if mixed else None
        self._constrained = [i for i, s in enumerate(samplers) if s.constraint is not None]
        self._logprob_rows = [i for i, s in enumerate(samplers) if s.logprobs is not None]
        self.logprobs: StepLogprobs | None = None  # the last draw's, for the rows that asked (lazy)
        self._mask_buffer: MaskBuffer | None = None  # these rows' masks, where drawn `masks_later`

    @property
    def constrained(self) -> bool:
        """Whether any row has a constraint: its next draw waits for its mask, which waits for its
        token of the step before (`take`)."""
        return bool(self._constrained)

    def take(self, tokens: Sequence[int]) -> None:
        """Each constrained row takes its token (one per row, in row order): its grammar moves on, and
        its next draw's mask is computed then (`sample`, on the host). A row whose token breaks its
        grammar keeps the error in its constraint (`Constraint.error`); the others go on."""
        for i in self._constrained:
            c = self.samplers[i].constraint
            assert c is not None
            c.take(tokens[i])

    def _masked(self, x: mx.array, later: bool) -> mx.array:
        """`x` with the constrained rows' disallowed tokens at -inf (a free row's mask allows
        everything: one `where` for the batch, no scatter of rows): the masks computed now, or,
        `later`, read from the rows' `MaskBuffer` when the draw is evaluated (`write_masks` first)."""
        if later:
            return mx.where(_allowed_bits(self._buffer().array, x.shape[-1]), x, _NEG_INF)
        masks = np.full((x.shape[0], _words(self.vocab_size)), -1, dtype=np.int32)
        fill_mask_rows(masks, self._constrained_rows())
        return mx.where(_allowed(masks, x.shape[-1]), x, _NEG_INF)

    def write_masks(self) -> None:
        """Write the constrained rows' masks (after they took their tokens: `take`) into the buffer a
        draw built with `masks_later` reads; call it before that draw is launched, once the draw
        before it was read back (`mask_buffer.py` says why)."""
        assert self._mask_buffer is not None, "no draw reads a mask buffer"
        fill_mask_rows(self._mask_buffer.host, self._constrained_rows())

    def start_masks(self) -> MaskWork:
        """`write_masks` on the mask thread (`constraint.start_mask_rows`): returns at once; until its
        `join`, nothing may touch these rows' grammars (`take`, `cut`, ...) nor the buffer, while a
        constraint's plain fields (`Constraint.error`, `complete_after`) may be read. The draw that
        reads the masks may be built meanwhile (`sample` with `masks_later`): building reads no data."""
        return start_mask_rows(self._buffer().host, self._constrained_rows())

    def _buffer(self) -> MaskBuffer:
        """These rows' `MaskBuffer`, made at its first use."""
        if self._mask_buffer is None:
            self._mask_buffer = MaskBuffer(len(self.samplers), _words(self.vocab_size))
        return self._mask_buffer

    def _constrained_rows(self) -> list[tuple[int, Constraint]]:
        return [(i, c) for i in self._constrained if (c := self.samplers[i].constraint) is not None]

    def cut(self, drafts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each row's draft tokens (one list per row), a constrained row's cut before the first its
        grammar does not allow (after its pending token, taken: `take`)."""
        out = [list(d) for d in drafts]
        for i in self._constrained:
            c = self.samplers[i].constraint
            assert c is not None
            out[i] = out[i][: c.valid_prefix(out[i])]
        return out

    def draft_masks(self, drafts: Sequence[Sequence[int]], width: int) -> mx.array | None:
        """(B, `width`, vocab) bool: the tokens each position of a verify step allows, a constrained
        row's position j its grammar after its first j `drafts` (cut by `cut`); None without
        constrained rows. Computed on the host now."""
        if not self._constrained:
            return None
        constraints = [s.constraint for s in self.samplers]
        masks = fill_draft_masks(constraints, drafts, width, _words(self.vocab_size))
        return _allowed(masks, self.vocab_size)

    def take_drafts(self, drafts: Sequence[Sequence[int]]) -> None:
        """After a verify step, constrained rows take the drafts they kept (one list per row)."""
        for i in self._constrained:
            c = self.samplers[i].constraint
            assert c is not None
            for token in drafts[i]:
                c.take(token)

    def select(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in that order."""
        self.samplers = [self.samplers[i] for i in rows]
        if not self.samplers or self._keys is None:
            self._keys = None
        else:
            self._keys = self._keys[mx.array(list(rows), dtype=mx.int32)]
        self._refresh()

    def extend(self, other: SamplerRows) -> None:
        """Append `other`'s rows, with the keys they reached."""
        if not other.samplers:
            return
        assert other._keys is not None
        self.samplers += other.samplers
        self._keys = other._keys if self._keys is None else mx.concatenate([self._keys, other._keys])
        self._refresh()

    def verify(
        self, logits: mx.array, drafts: mx.array, depth: mx.array, allowed: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """Speculative sampling over a verify step's (B, W, vocab) logits: row i fed its pending token and
        `depth[i]` (<= W - 1) draft tokens `drafts[i]` (B, W - 1). Returns the (B,) count of drafts each
        row keeps and the (B,) token that follows them (the next pending token); lazy.

        The drafts are point masses (prompt lookup, or a draft model's greedy guess): draft x at a
        position is kept with probability p(x), p the row's distribution there after its logit bias,
        temperature and filters, exactly as `sample` draws from; the first one rejected is replaced by a
        draw from p without x, renormalised (the residual max(0, p - q) of speculative sampling when q
        is a point mass); after all are kept the next token is a draw from p at the following position.
        So every token follows the distribution plain steps give. A greedy row keeps drafts equal to
        its argmax and continues with the argmax.

        A row that drafts nothing (depth 0) draws exactly as `sample` would from its first position's
        logits (the same key), so a seeded request's tokens do not depend on whether its batch-mates
        draft. A row with penalties must draft nothing (its later positions' penalties would depend on
        the drafts): its first position is processed as in `sample`.

        `allowed` (B, W, vocab) bool (`draft_masks`): the tokens each position's grammar allows,
        applied after the penalties as in `sample`, so a constrained row's drafts (which its grammar
        allows) are kept and replaced under the distribution its plain steps draw from."""
        b, width, vocab = logits.shape
        x = logits if self._bias is None else logits.astype(mx.float32) + self._bias[:, None, :]
        if self._penalized:  # their first position as `sample` processes it (they draft nothing)
            first = x[:, 0, :].astype(mx.float32)
            own = [self.samplers[i].process_logits(logits[i : i + 1, 0, :]) for i in self._penalized]
            first[mx.array(self._penalized, dtype=mx.int32)] = mx.concatenate(own)
            x = mx.concatenate([first[:, None, :], x[:, 1:, :].astype(mx.float32)], axis=1)
        if allowed is not None:
            x = mx.where(allowed, x, _NEG_INF)
        live = mx.arange(width - 1, dtype=mx.int32)[None, :] < depth[:, None]
        target = mx.argmax(x, axis=-1) if self._any_greedy else None  # (B, W)
        greedy_ok = None if target is None else (target[:, :-1] == drafts) & live
        if self._arrays is None:
            assert target is not None and greedy_ok is not None
            kept = _leading(greedy_ok)
            following = mx.take_along_axis(target, kept[:, None], axis=1)[:, 0]
            self._observe_penalized(following)
            self._note_logprobs(logits[:, 0, :], following)  # rows asking logprobs draft nothing
            return kept, following
        assert self._keys is not None
        filtered = filter_rows(x.reshape(b * width, vocab), self._arrays, width).reshape(b, width, vocab)
        pairs = _split_keys(self._keys)
        self._keys = pairs[:, 0]
        # the next token drawn with the key `sample` would use; the acceptance tests with one split off it
        tests = _split_keys(pairs[:, 1])[:, 0]
        uniform = mx.vmap(lambda key: mx.random.uniform(shape=(width - 1,), key=key))(tests)
        probs = mx.softmax(filtered[:, :-1, :], axis=-1)
        ok = (uniform < mx.take_along_axis(probs, drafts[..., None], axis=-1)[..., 0]) & live
        if greedy_ok is not None and self._greedy_mask is not None:
            ok = mx.where(self._greedy_mask[:, None], greedy_ok, ok)
        kept = _leading(ok)
        at = mx.take_along_axis(filtered, kept[:, None, None], axis=1)[:, 0, :]  # (B, vocab)
        rejected = mx.take_along_axis(drafts, mx.minimum(kept, width - 2)[:, None], axis=1)
        drop = (mx.arange(vocab, dtype=mx.int32)[None, :] == rejected) & (kept < depth)[:, None]
        following = _categorical(pairs[:, 1], mx.where(drop, _NEG_INF, at))
        if target is not None and self._greedy_mask is not None:
            greedy_next = mx.take_along_axis(target, kept[:, None], axis=1)[:, 0]
            following = mx.where(self._greedy_mask, greedy_next, following)
        self._observe_penalized(following)
        self._note_logprobs(logits[:, 0, :], following)  # rows asking logprobs draft nothing
        return kept, following

    def _observe_penalized(self, tokens: mx.array) -> None:
        """Rows with penalties count their token (lazily), as after `sample`."""
        for i in self._penalized:
            self.samplers[i].observe(tokens[i : i + 1])

    def sample(self, logits: mx.array, masks_later: bool = False) -> mx.array:
        """One token per row of (B, vocab) logits, shape (B,); lazy. Every sampler observes its token.

        `masks_later`: the constrained rows' masks are not computed now but read from these rows'
        `MaskBuffer` when the draw is evaluated: `write_masks` must write them before it is launched
        (so the draw can be built before the tokens its masks follow are known)."""
        if len(self.samplers) != logits.shape[0]:
            raise ValueError(f"{len(self.samplers)} samplers for {logits.shape[0]} rows of logits")
        x = logits if self._bias is None else logits.astype(mx.float32) + self._bias
        if self._penalized:
            index = mx.array(self._penalized, dtype=mx.int32)
            own = [self.samplers[i].process_logits(logits[i : i + 1]) for i in self._penalized]
            x = x.astype(mx.float32)  # exact; a penalized row's logits are float32 alone too
            x[index] = mx.concatenate(own)
        if self._constrained:
            x = self._masked(x, masks_later)
        greedy = mx.argmax(x, axis=-1) if self._any_greedy else None
        if self._arrays is None:
            assert greedy is not None
            tokens = greedy
        else:
            assert self._keys is not None
            drawn, self._keys = draw_rows(x, self._arrays, self._keys)
            if self._greedy_mask is None:
                tokens = drawn
            else:
                assert greedy is not None  # a mask is made only where some row is greedy
                tokens = mx.where(self._greedy_mask, greedy, drawn)
        for i, s in enumerate(self.samplers):
            s.observe(tokens[i : i + 1] if i in self._penalized_set else tokens)  # counts where penalized
        self._note_logprobs(logits, tokens)
        return tokens

    def _note_logprobs(self, logits: mx.array, tokens: mx.array) -> None:
        """The rows that asked for logprobs: their tokens' under the model's raw `logits` (lazy)."""
        rows = self._logprob_rows
        ks = [self.samplers[i].logprobs or 0 for i in rows]
        self.logprobs = step_logprobs(logits, tokens, rows, ks) if rows else None
