"""The MTP rows of one generation batch, drafting together.

An `MtpBatch` holds the entries of every row of a generation batch that drafts with the target's MTP
layer (`mtp.py`) in one batch cache of that layer (`BatchKVCache`: left-padded rows, holes, as the
target's decode batch keeps them, behind a `ShiftedCache`: entries sit at RoPE positions one later),
so a step's proposals for all rows cost one forward of the MTP layer and one read of their argmax,
where rows drafting alone cost a forward and a device sync each. It owns that cache and which of its
rows each row's drafter (`MtpDrafter`) is; the drafter owns its row's features: the target's final
hidden states handed to it and not entered yet (`held_features.py`), the prompt's prefix the prefix
cache gave (`unseen`, never run by the batch), whether it lost its row.

A proposal for the rows of a step:
- each drafting row forgets its features past its latest token (a verify step's rejected columns) and
  hands over the hidden states of its positions not entered yet (`MtpDrafter.to_enter`), the unseen
  prefix computed first by a forward of the target's own (its first proposal only);
- the batch's rows enter theirs in one forward: a right-padded block as wide as the longest count of a
  drafting row, each row keeping its own count (`trim_rows`: its padding columns become holes, as in a
  verify step whose rows propose different numbers of tokens). A row that drafts nothing this step
  enters what it holds that fits that width (`MtpDrafter.spare`), so it does not fall behind; a row
  not asked enters nothing;
- rows new to the batch (a prompt's worth of positions each) enter theirs together the same way, into
  a batch cache of their own (`BatchKVCache.of_empty_rows`): one forward a chunk for all of them, not
  one a chunk for each (with `pad_shapes` their number padded to a power of two by rows entering
  nothing); then they join the batch's cache after its forward (`BatchKVCache.add`);
- each drafting row's draft is the argmax of the target's head over the MTP output at its latest
  position. The proposal is one graph, evaluated once when the drafts are read.
A row that drafts nothing pays nothing of its own: its features wait (a row the draft gate keeps from
drafting is never asked). Entries are made of kept tokens only, so nothing is rolled back after a
verify step. Rows that leave (`leave`: finished, cancelled, failed) are cut out with one copy
(`BatchKVCache.keep`, squeezing holes out on the way), and so are holes once a row holds a step's
worth of them. A row whose drafter forgot entries it made (features handed again from an earlier
position: not expected) or stopped (`lost`) leaves before the batch's next forward; the former joins
again, its entries made afresh.

Where the engine pads shapes (`pad_shapes`: a GPU) the batch's forward of several columns, whose key
length would be new nearly every step (on MLX's CUDA build attention over several queries builds a
plan per key length, many times the step's cost), reads whole steps of the cache as the target's verify
step does (`whole_steps`: its mask as wide as the columns read) and its block is padded to a power of
two wide (the columns past every row's forgotten by `trim_rows`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol, cast

import mlx.core as mx

from mlxq.worker.engine.cache.batch_cache import BatchKVCache, whole_steps
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.masks import Mask
from mlxq.worker.engine.shapes import padded_size
from mlxq.worker.engine.speculation.drafter import DraftBatchSource, Drafter, RowToDraft
from mlxq.worker.engine.speculation.held_features import HeldFeatures

log = logging.getLogger(__name__)


class ShiftedCache:
    """The MTP layer's cache: a sequence's `KVCache` (by default) or a batch's `BatchKVCache`, whose
    entries sit one position later (RoPE's offset is one more: the first token has no predecessor)."""

    def __init__(self, inner: KVCache | BatchKVCache | None = None) -> None:
        self.inner = inner if inner is not None else KVCache()

    @property
    def offset(self) -> int | mx.array:
        return self.inner.offset + 1

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.inner.update_and_fetch(keys, values)


class MtpSource(DraftBatchSource, Protocol):
    """What the MTP rows read of their loaded layer (`mtp.MtpDraft`), shared by identity."""

    @property
    def target(self) -> Model: ...

    @property
    def prefill_chunk(self) -> int:
        """A prompt's entries are made chunk by chunk of that many positions."""
        ...

    def outputs(
        self, tokens: Sequence[int] | mx.array, hidden: mx.array, cache: ShiftedCache, mask: Mask = None
    ) -> mx.array:
        """The MTP layer's normed outputs for `tokens` and their predecessors' `hidden`, entered."""
        ...

    def features(self, tokens: Sequence[int]) -> mx.array:
        """The target's final hidden states of `tokens` from position 0 (a forward of its own)."""
        ...

    def draft_batch(self) -> MtpBatch: ...


class MtpDrafter:
    """A `BatchedDrafter` for one row of the target's MTP layer (`source`) that reads the target's
    final hidden states (`FeatureReader`): its row of the `MtpBatch` it drafts in (the generation
    batch's, `batch_drafts.py`, else one of its own) holds `entries` entries (positions 1..entries);
    `held` the hidden states of the positions after them, to be entered when a proposal needs them
    (`held_features.py`), their next token known by then. The prompt's come from the batch's prefill
    (`take_features` from position 0); where the prefix cache gave the prompt's first positions, never
    run by the batch, their hidden states (`unseen`) are computed by a forward of the target's own when
    a proposal first needs them: a row that never drafts costs no MTP work, and a feature handed over
    is never evaluated here."""

    def __init__(self, draft: MtpSource) -> None:
        self.draft = draft
        self.batch: MtpBatch | None = None  # the batch holding its row: set as it joins
        self.entries = 0  # its row's entries in that batch's cache
        self.held = HeldFeatures()
        self.unseen = 0
        self.lost = False

    @property
    def source(self) -> DraftBatchSource:
        return self.draft

    @property
    def _known(self) -> int:
        """Positions whose hidden states the drafter has (entered, to compute, or held)."""
        return self.entries + self.unseen + len(self.held)

    def take_features(self, position: int, features: mx.array, tokens: Sequence[int]) -> list[mx.array]:
        """The target's final hidden states (1, W, hidden) of the row's positions from `position` on;
        `tokens` the row's tokens so far. Held until a proposal enters them; returns what to compute
        with the forward (`HeldFeatures.add`)."""
        if self.lost:
            return []
        self._forget_from(position)
        if position > self._known and not self._catch_up(tokens, position):
            return []
        return self.held.add(features)

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """The draft after the row's latest token (`tokens[-1]`, not fed yet), for this row alone:
        through the batch holding its row, else a new batch of one."""
        batch = self.batch if self.batch is not None else self.draft.draft_batch()
        return batch.propose([RowToDraft(self, tokens, depth)])[0]

    def may_propose(self, tokens: Sequence[int]) -> bool:
        return not self.lost

    def accepted(self, proposed: int, kept: int) -> None:
        """Nothing to roll back: entries are made of kept tokens only, and hidden states of drafts not
        kept are replaced when the next forward feeds their positions."""

    def to_enter(self, tokens: Sequence[int]) -> mx.array | None:
        """Before a proposal after `tokens` (the latest not fed yet): the hidden states (1, n, hidden)
        of positions entries .. len(tokens) - 2, no longer held, for the entries of the tokens after
        them; features past them forgotten, the unseen prefix computed first. None when there is
        nothing to enter or the drafter lost its row."""
        if len(tokens) < 2 or self.lost:
            return None
        before = len(tokens) - 1  # hidden states of positions 0..before - 1 are needed
        self._forget_from(before)
        if self._known < before and not self._catch_up(tokens, before):
            return None
        if self.unseen:
            self.held.put_first(self.draft.features(tokens[: self.unseen]))
            self.unseen = 0
        return self.held.take(before - self.entries)

    def spare(self, tokens: Sequence[int], most: int) -> mx.array | None:
        """For a row of the batch drafting nothing this step: the hidden states of at most `most` of
        the positions after its entries whose next token is known, no longer held (None for none)."""
        if self.lost or self.unseen:
            return None
        return self.held.take(min(most, len(tokens) - 1 - self.entries))

    def _forget_from(self, position: int) -> None:
        """Forget the hidden states of positions from `position` on, and the entries made of them (all
        its entries then: the batch lets its row go, and they are made afresh from `unseen`)."""
        if position < self.entries:
            self.unseen, self.entries = position, 0
            self.held.clear()
        elif position < self.entries + self.unseen:
            self.unseen = position - self.entries
            self.held.clear()
        else:
            self.held.keep(position - self.entries - self.unseen)

    def _catch_up(self, tokens: Sequence[int], upto: int) -> bool:
        """Count positions 0..upto - 1 as unseen (their hidden states computed when a proposal needs
        them), from an empty drafter (a prompt's prefix the prefix cache gave, or a prompt not
        prefilled by the batch); False, and the drafter stops, on a gap (not expected)."""
        if self._known or upto > len(tokens):
            log.warning("an MTP drafter lost its row (%d held, %d wanted): it stops", self._known, upto)
            self.lost = True
            return False
        self.unseen = upto
        return True


class MtpBatch:
    """The MTP rows of one generation batch (`draft`'s); `pad_shapes`: the engine pads shapes (a GPU):
    its forwards of several columns read whole steps of the cache, their width a power of two. See the
    module docstring."""

    def __init__(self, draft: MtpSource, pad_shapes: bool = False) -> None:
        self.draft = draft
        self.pad_shapes = pad_shapes
        self.cache = BatchKVCache()
        self.rows: list[MtpDrafter] = []  # the drafter of each row of the buffers, in order

    def __len__(self) -> int:
        return len(self.rows)

    def propose(self, rows: Sequence[RowToDraft]) -> list[list[int]]:
        """Each drafting row's draft ([] for depth 0, or with nothing to enter), in the order of `rows`;
        see the module docstring."""
        drafters = [self._own(r.drafter) for r in rows]
        entering = [
            d.to_enter(r.tokens) if r.depth > 0 else None for r, d in zip(rows, drafters, strict=True)
        ]
        self._tidy()  # after `to_enter`: a row may have forgotten its entries there
        at = {id(d): i for i, d in enumerate(self.rows)}
        width = max(
            (h.shape[1] for h, d in zip(entering, drafters, strict=True) if h is not None and id(d) in at),
            default=0,
        )
        fed: list[tuple[mx.array, Sequence[int]] | None] = [None] * len(self.rows)
        joining: list[tuple[MtpDrafter, mx.array, Sequence[int]]] = []
        for r, d, h in zip(rows, drafters, entering, strict=True):
            if r.depth <= 0 and id(d) in at and width:
                h = d.spare(r.tokens, width)
            if h is not None:
                ids = r.tokens[d.entries + 1 : d.entries + 1 + h.shape[1]]
                if id(d) in at:
                    fed[at[id(d)]] = (h, ids)
                else:
                    joining.append((d, h, ids))
        outs = [self._feed(fed, self.cache, self.rows)] if width else []  # each row's latest, in order
        if joining:
            outs.append(self._join(joining))
        drafting = [
            k for k, (r, h) in enumerate(zip(rows, entering, strict=True)) if r.depth > 0 and h is not None
        ]
        if not drafting:
            return [[] for _ in rows]
        skip = 0 if width else len(at)  # without the batch's forward, only the joining rows have outputs
        index = mx.array([self.rows.index(drafters[k]) - skip for k in drafting], dtype=mx.int32)
        latest = mx.concatenate(outs)[index]
        # the one evaluation: `tolist` of a 1-D int32 array gives ints
        tokens = cast("list[int]", mx.argmax(self.draft.target.logits(latest), axis=-1).tolist())
        drafts: list[list[int]] = [[] for _ in rows]
        for k, token in zip(drafting, tokens, strict=True):
            drafts[k] = [token]
        return drafts

    def leave(self, drafters: Sequence[Drafter]) -> None:
        """These rows leave the batch, their columns cut out of its cache (one copy); a drafter that
        proposes again joins again, its entries made afresh (counted `unseen`)."""
        gone = [d for d in self.rows if any(d is g for g in drafters)]
        if not gone:
            return
        keep = [i for i, d in enumerate(self.rows) if all(d is not g for g in gone)]
        self.cache.keep(keep)
        self.rows = [self.rows[i] for i in keep]
        for d in gone:
            d.batch = None
            d.unseen, d.entries = d.unseen + d.entries, 0

    def _own(self, drafter: Drafter) -> MtpDrafter:
        """`drafter` as one of this batch's (an MTP row's), out of any other batch it drafted in."""
        if not isinstance(drafter, MtpDrafter):
            raise TypeError(f"an MTP batch drafts for MTP rows, got {type(drafter).__name__}")
        if drafter.batch is not None and drafter.batch is not self:
            drafter.batch.leave([drafter])
        return drafter

    def _tidy(self) -> None:
        """Rows whose drafter stopped or forgot entries it made leave; holes are squeezed out once a row
        holds a step's worth."""
        lengths = self.cache.lengths
        self.leave([d for d, n in zip(self.rows, lengths, strict=True) if d.lost or d.entries != n])
        if self.rows and self.cache.has_holes and max(self.cache.holes) >= BatchKVCache.step:
            self.cache.keep(list(range(len(self.rows))))

    def _feed(
        self,
        fed: Sequence[tuple[mx.array, Sequence[int]] | None],
        cache: BatchKVCache,
        drafters: Sequence[MtpDrafter],
    ) -> mx.array:
        """One forward of the MTP layer a chunk of columns entering row i of `cache` (`drafters[i]`'s;
        rows past them: padding rows) hidden states and tokens `fed[i]` (none for None), right-padded
        to the longest (the padding columns become the row's holes), and with `pad_shapes` (a GPU) to a
        power of two (the columns past every row's: forgotten) reading whole steps of the cache: the
        shapes a GPU meets change once per 256 columns and a few widths, not at every step (see
        `VerifyStep`); each row's output (rows, hidden) at its last position entered (any for a row fed
        none)."""
        counts = [0 if f is None else f[0].shape[1] for f in fed]
        width, done, chunk = max(counts), 0, self.draft.prefill_chunk
        like = next(f[0] for f in fed if f is not None)
        shifted = ShiftedCache(cache)
        last: mx.array | None = None
        while done < width:
            n = min(chunk, width - done)
            if self.pad_shapes and n > 1:  # a chunk as wide as `chunk` stays so: the last one is padded
                n = min(padded_size(n, smallest=1), chunk)
            parts = [min(max(c - done, 0), n) for c in counts]
            hidden = mx.concatenate(
                [
                    _padded(f[0][:, done : done + p] if f is not None and p else None, n, like)
                    for f, p in zip(fed, parts, strict=True)
                ]
            )
            ids = [
                [*(f[1][done : done + p] if f is not None else []), *([0] * (n - p))]
                for f, p in zip(fed, parts, strict=True)
            ]
            with whole_steps([cache], n, self.pad_shapes) as columns:
                ids_in = mx.array(ids, dtype=mx.int32)
                out = self.draft.outputs(ids_in, hidden, shifted, cache.mask(n, columns))
            cache.trim_rows(n, parts)
            ends = mx.array([max(p - 1, 0) for p in parts], dtype=mx.int32)
            here = mx.take_along_axis(out, ends[:, None, None], axis=1)[:, 0, :]
            # a row whose positions ended in an earlier chunk keeps that chunk's
            last = here if last is None else mx.where(mx.array([p > 0 for p in parts])[:, None], here, last)
            done += n
            if done < width:  # a long block goes chunk by chunk, as a prefill does
                mx.eval([a for a in (cache.keys, cache.values) if a is not None])
        for d, c in zip(drafters, counts[: len(drafters)], strict=True):
            d.entries += c
        assert last is not None
        return last

    def _join(self, joining: list[tuple[MtpDrafter, mx.array, Sequence[int]]]) -> mx.array:
        """New rows enter their hidden states and tokens together (`_feed`, into a batch cache of their
        own: one forward a chunk for all of them; with `pad_shapes` their number padded to a power of
        two by rows entering nothing, so a GPU meets a few shapes) and join the batch's cache (one copy,
        their holes squeezed out); their outputs (rows, hidden) at their last position, in the order
        they now hold in the batch."""
        drafters = [d for d, _, _ in joining]
        assert all(d.entries == 0 for d in drafters)  # a row out of any batch has no entries
        rows = padded_size(len(joining), smallest=1) if self.pad_shapes else len(joining)
        fed = [(hidden, ids) for _, hidden, ids in joining]
        joined = BatchKVCache.of_empty_rows(rows)
        outs = self._feed([*fed, *([None] * (rows - len(fed)))], joined, drafters)
        if joined.has_holes:  # (padding rows are all holes)
            joined.keep(list(range(len(joining))))
        self.cache.add([joined.row(i) for i in range(len(joining))])
        for d in drafters:
            d.batch = self
            self.rows.append(d)
        return outs[: len(joining)]


def _padded(features: mx.array | None, width: int, like: mx.array) -> mx.array:
    """`features` (1, n, hidden) right-padded with zeros to `width` positions (all zeros for None)."""
    if features is None:
        return mx.zeros((1, width, like.shape[-1]), dtype=like.dtype)
    if features.shape[1] == width:
        return features
    return mx.pad(features, [(0, 0), (0, width - features.shape[1]), (0, 0)])
