"""`SamplerRows`, a decode batch's samplers drawing for every row at once: a batch of 64 sampled rows
costs one small graph per step, not 64.

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
from collections.abc import Sequence

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
from mlxq.worker.engine.sampler import (
    RowArrays,
    Sampler,
    categorical,
    draw_rows,
    filter_rows,
    split_keys,
    stack_bias,
)
from mlxq.worker.engine.token_logprobs import StepLogprobs, step_logprobs

_NEG_INF = float("-inf")


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _bit_columns(width: int, ndim: int) -> tuple[mx.array, mx.array]:
    """Each token's int32 word in a bitmask row, shaped (1, ..., `width`) for `ndim` dimensions (as
    `take_along_axis` reads it), and its bit in that word (made once per width, from host data: no op
    of any thread's stream is kept)."""
    column = np.arange(width, dtype=np.uint32)
    return mx.array((column >> 5).reshape((1,) * (ndim - 1) + (width,))), mx.array(column & 31)


def _allowed(masks: np.ndarray, width: int) -> mx.array:
    """Bitmasks (..., words) int32 as (..., `width`) bool: True where a token is allowed."""
    return _allowed_bits(mx.array(masks.view(np.uint32)), width)


def _allowed_bits(masks: mx.array, width: int) -> mx.array:
    """Bitmasks (..., words) uint32 as (..., `width`) bool: True where a token is allowed."""
    word, bit = _bit_columns(width, masks.ndim)
    return _bit_set(mx.take_along_axis(masks, word, axis=-1), bit)


def _masked_logits(masks: mx.array, x: mx.array) -> mx.array:
    """(B, vocab) logits `x` at -inf where the (B, words) uint32 bitmasks `masks` disallow a token: each
    token's word gathered by one op (`take_along_axis`, where indexing makes six), then its bit read
    and the logits selected by one compiled op (a constrained draw's launch is on a GPU's critical
    path, its cost by its ops)."""
    word, bit = _bit_columns(x.shape[-1], masks.ndim)
    return _where_set(mx.take_along_axis(masks, word, axis=-1), bit, x)


@functools.partial(mx.compile, shapeless=True)
def _bit_set(words: mx.array, bit: mx.array) -> mx.array:
    return ((words >> bit) & 1).astype(mx.bool_)


@functools.partial(mx.compile, shapeless=True)
def _where_set(words: mx.array, bit: mx.array, x: mx.array) -> mx.array:
    return mx.where(((words >> bit) & 1).astype(mx.bool_), x, _NEG_INF)


def _leading(ok: mx.array) -> mx.array:
    """(B,) count of each row's leading True values of (B, n) `ok`."""
    if ok.shape[1] == 0:
        return mx.zeros((ok.shape[0],), dtype=mx.int32)
    return mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)


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
        self._arrays = None if all(greedy) else RowArrays([s.row for s in samplers])
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
            return _masked_logits(self._buffer().array, x)
        masks = np.full((x.shape[0], _words(self.vocab_size)), -1, dtype=np.int32)
        fill_mask_rows(masks, self._constrained_rows())
        return _masked_logits(mx.array(masks.view(np.uint32)), x)

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
        x = self._verify_logits(logits, allowed)
        live = mx.arange(x.shape[1] - 1, dtype=mx.int32)[None, :] < depth[:, None]
        if self._arrays is None:  # every row greedy
            target = mx.argmax(x, axis=-1)  # (B, W)
            kept = _leading((target[:, :-1] == drafts) & live)
            following = mx.take_along_axis(target, kept[:, None], axis=1)[:, 0]
        else:
            kept, following = self._verify_draws(x, drafts, depth, live, self._arrays)
        self._observe_penalized(following)
        self._note_logprobs(logits[:, 0, :], following)  # rows asking logprobs draft nothing
        return kept, following

    def _verify_logits(self, logits: mx.array, allowed: mx.array | None) -> mx.array:
        """A verify step's (B, W, vocab) logits with the rows' logit biases, the penalized rows' first
        position processed as `sample` processes it (they draft nothing), and `allowed` applied."""
        x = logits if self._bias is None else logits.astype(mx.float32) + self._bias[:, None, :]
        if self._penalized:
            first = x[:, 0, :].astype(mx.float32)
            own = [self.samplers[i].process_logits(logits[i : i + 1, 0, :]) for i in self._penalized]
            first[mx.array(self._penalized, dtype=mx.int32)] = mx.concatenate(own)
            x = mx.concatenate([first[:, None, :], x[:, 1:, :].astype(mx.float32)], axis=1)
        if allowed is not None:
            x = mx.where(allowed, x, _NEG_INF)
        return x

    def _verify_draws(
        self, x: mx.array, drafts: mx.array, depth: mx.array, live: mx.array, rows: RowArrays
    ) -> tuple[mx.array, mx.array]:
        """`verify`'s kept counts and following tokens where some row draws (`rows`, the rows' settings),
        from its processed logits `x`; greedy rows (`_greedy_mask`) keep and continue by their argmax."""
        assert self._keys is not None
        b, width, vocab = x.shape
        filtered = filter_rows(x.reshape(b * width, vocab), rows, width).reshape(b, width, vocab)
        pairs = split_keys(self._keys)
        self._keys = pairs[:, 0]
        # the next token drawn with the key `sample` would use; the acceptance tests with one split off it
        tests = split_keys(pairs[:, 1])[:, 0]
        uniform = mx.vmap(lambda key: mx.random.uniform(shape=(width - 1,), key=key))(tests)
        probs = mx.softmax(filtered[:, :-1, :], axis=-1)
        ok = (uniform < mx.take_along_axis(probs, drafts[..., None], axis=-1)[..., 0]) & live
        greedy = self._greedy_mask
        target = None if greedy is None else mx.argmax(x, axis=-1)  # (B, W)
        if greedy is not None and target is not None:
            ok = mx.where(greedy[:, None], (target[:, :-1] == drafts) & live, ok)
        kept = _leading(ok)
        at = mx.take_along_axis(filtered, kept[:, None, None], axis=1)[:, 0, :]  # (B, vocab)
        rejected = mx.take_along_axis(drafts, mx.minimum(kept, width - 2)[:, None], axis=1)
        drop = (mx.arange(vocab, dtype=mx.int32)[None, :] == rejected) & (kept < depth)[:, None]
        following = categorical(pairs[:, 1], mx.where(drop, _NEG_INF, at))
        if greedy is not None and target is not None:
            greedy_next = mx.take_along_axis(target, kept[:, None], axis=1)[:, 0]
            following = mx.where(greedy, greedy_next, following)
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
