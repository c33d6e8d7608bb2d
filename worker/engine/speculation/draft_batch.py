"""A draft model's rows of one generation batch, drafting together.

A `DraftModelBatch` holds every row's tokens in one batch cache of the draft model (`BatchKVCache`, one
a layer: left-padded rows, holes, as the target's decode batch keeps them), so a verify step's drafts
cost a catch-up forward and a forward per drafted token for all rows at once, where rows drafting
alone cost those for each row. It owns that cache and which of its rows each row's drafter
(`DraftModelDrafter`) is. A proposal for the rows of a step:
- rows new to the batch are prefilled from their prompt (those that fit a chunk in one forward
  together, `prefill_rows`; a longer one alone, chunk by chunk; with `pad_shapes` rows and widths
  padded as the engine's own prefills are) and join the cache (`BatchKVCache.add`); their first drafts
  come from that prefill's logits;
- the other rows are fed the tokens their cache lacks (what the target took since their last
  proposal: the drafts it kept and its pending token, more after steps they did not draft) in one
  forward: a right-padded block as wide as the longest lag of a drafting row, each row keeping its own
  count (`trim_rows`: its padding columns become holes, as in a verify step whose rows propose
  different numbers of tokens). A row that drafts nothing this step takes what fits that width, so it
  does not fall behind; a row of the batch not asked at all takes nothing;
- then depth - 1 one-token greedy forwards (the deepest row's depth) feed every row its latest draft.
  A row that drafts fewer tokens drafts as many as the deepest: its answer is cut to its depth, and
  its extra columns are rolled back with the drafts the target did not keep.
The proposal is one graph, evaluated once when its drafts are read.

Where the engine pads shapes (`pad_shapes`: a GPU) the catch-up forward, whose key length would be new
nearly every step (on MLX's CUDA build attention over several queries builds a plan per key length,
many times the step's cost), reads whole steps of the cache as the target's verify step does
(`whole_steps`: its mask as wide as the columns read) and its block is padded to a power of two wide
(the columns past every row's tokens forgotten by `trim_rows`); a draft model with windowed layers
reads exactly, its block unpadded. The one-token forwards read exactly: one query meets no such plan.

After the verify step each row's drafter tells the batch what the target kept (`accepted`); the
columns of every row's drafts are cut back at once (`trim_rows` over the last proposal's draft
columns, the ones not kept becoming holes) before the batch's next forward or membership change; a
row not told keeps none. Rows that leave (`leave`: finished, cancelled, failed) are cut out with one
copy (`BatchKVCache.keep`, squeezing holes out on the way), and so are holes once a row holds a step's
worth of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx

from mlxq.worker.engine.cache.batch_cache import BatchKVCache, one_offset, whole_steps
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.prefill import prefill, prefill_rows
from mlxq.worker.engine.shapes import padded_size
from mlxq.worker.engine.speculation.drafter import DraftBatchSource, Drafter, RowToDraft


class DraftModelDrafter:
    """A `BatchedDrafter` for one row of a draft model (`source`): its row of the `DraftModelBatch`
    it drafts in, the generation batch's (`batch_drafts.py`), else one of its own."""

    def __init__(self, source: DraftBatchSource) -> None:
        self._source = source
        self.batch: DraftModelBatch | None = None  # the batch holding its row: set as it joins

    @property
    def source(self) -> DraftBatchSource:
        return self._source

    @property
    def cached(self) -> int:
        """Tokens of the row in the draft's cache (the drafts the target did not keep left out)."""
        return self.batch.cached(self) if self.batch is not None else 0

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """Drafts for this row alone: through the batch holding its row, else a new batch of one."""
        batch = self.batch if self.batch is not None else self._source.draft_batch()
        return batch.propose([RowToDraft(self, tokens, depth)])[0]

    def may_propose(self, tokens: Sequence[int]) -> bool:
        """A draft model always has a guess."""
        return True

    def accepted(self, proposed: int, kept: int) -> None:
        """Passed on to its batch, which rolls its row back with the others' before its next forward."""
        if self.batch is not None:
            self.batch.accepted(self, proposed, kept)


class DraftModelBatch:
    """The rows drafting with draft model `model` in one generation batch; `chunk`: a new row's prompt
    is prefilled in chunks of that many tokens (prompts that fit one, together); `pad_shapes`: the
    engine pads shapes (a GPU): its prefills of joining rows are padded as the engine's are, its catch-up
    forwards read whole steps of the cache, their width a power of two, unless a layer of the model
    slides a window. See the module docstring."""

    def __init__(self, model: Model, chunk: int = 2048, pad_shapes: bool = False) -> None:
        self.model = model
        self.chunk = chunk
        self.cache = [BatchKVCache(window) for window in model.model.windows]
        self.pad_shapes = pad_shapes
        # catch-up forwards reading whole steps: not where a layer's reads follow its window
        self._whole_steps = pad_shapes and all(w is None for w in model.model.windows)
        self.rows: list[DraftModelDrafter] = []  # the drafter of each row of the buffers, in order
        self._drafted = 0  # draft columns of the last proposal each row holds, not cut back yet
        self._kept: list[int] = []  # of those, per row: how many it keeps (`accepted`; 0 until told)

    def __len__(self) -> int:
        return len(self.rows)

    def cached(self, drafter: DraftModelDrafter) -> int:
        """Tokens of `drafter`'s row in the cache, the draft columns it will not keep left out."""
        i = self.rows.index(drafter)
        return self.cache[0].lengths[i] - (self._drafted - self._kept[i])

    def propose(self, rows: Sequence[RowToDraft]) -> list[list[int]]:
        """Each row's drafts (its depth's worth, [] for depth 0), in the order of `rows`; see the module
        docstring."""
        asked = [r if r.tokens else RowToDraft(r.drafter, r.tokens, 0) for r in rows]
        depth = max((r.depth for r in asked), default=0)
        if depth <= 0:
            return [[] for _ in asked]
        drafters = [self._own(r.drafter) for r in asked]
        self._roll_back()
        stale = [d for d, r in zip(drafters, asked, strict=True) if r.depth > 0 and self._ahead(d, r)]
        self.leave(stale)  # not expected: the cache holds all its tokens; it joins again, from its prompt
        first = self._catch_up(asked, drafters)
        joining = [r for r, d in zip(asked, drafters, strict=True) if r.depth > 0 and d.batch is not self]
        if joining:
            joined = self._join(joining)
            first = joined if first is None else mx.concatenate([first, joined])
        assert first is not None  # some row drafts: it is either in the batch or joins it
        token = mx.argmax(first, axis=-1).astype(mx.int32)
        drafts = [token]
        for _ in range(depth - 1):
            with one_offset(self.cache):
                mask = self.cache[0].mask(1)
                logits = self.model(token[:, None], cache=self.cache, mask=mask)[:, -1, :]
            token = mx.argmax(logits, axis=-1).astype(mx.int32)
            drafts.append(token)
        self._drafted, self._kept = depth - 1, [0] * len(self.rows)
        # (rows, depth): the one evaluation; `tolist` of a 2-D int32 array gives lists of ints
        table = cast("list[list[int]]", mx.stack(drafts, axis=1).tolist())
        return [
            table[self.rows.index(d)][: r.depth] if r.depth > 0 else []
            for r, d in zip(asked, drafters, strict=True)
        ]

    def accepted(self, drafter: DraftModelDrafter, proposed: int, kept: int) -> None:
        """Of `drafter`'s `proposed` tokens the target kept `kept`: its row keeps the first `kept` of
        its draft columns (it holds its proposal's all but last, and the extra ones of a row drafting
        fewer than the deepest), cut back before the next forward."""
        if self._drafted and proposed > 0 and drafter in self.rows:
            self._kept[self.rows.index(drafter)] = min(kept, proposed - 1, self._drafted)

    def leave(self, drafters: Sequence[Drafter]) -> None:
        """These rows leave the batch, their columns cut out of its cache (one copy)."""
        gone = [d for d in self.rows if any(d is g for g in drafters)]
        if not gone:
            return
        self._roll_back()
        keep = [i for i, d in enumerate(self.rows) if d not in gone]
        self._keep(keep)
        self.rows = [self.rows[i] for i in keep]
        self._kept = [0] * len(self.rows)
        for d in gone:
            d.batch = None

    def _own(self, drafter: Drafter) -> DraftModelDrafter:
        """`drafter` as one of this batch's (a draft model's), out of any other batch it drafted in."""
        if not isinstance(drafter, DraftModelDrafter):
            raise TypeError(
                f"a draft model's batch drafts for draft model rows, got {type(drafter).__name__}"
            )
        if drafter.batch is not None and drafter.batch is not self:
            drafter.batch.leave([drafter])
        return drafter

    def _ahead(self, drafter: DraftModelDrafter, row: RowToDraft) -> bool:
        """Whether `drafter`'s row is in the batch with all of `row.tokens` cached (nothing to feed)."""
        return drafter.batch is self and self.cache[0].lengths[self.rows.index(drafter)] >= len(row.tokens)

    def _catch_up(self, asked: Sequence[RowToDraft], drafters: list[DraftModelDrafter]) -> mx.array | None:
        """Feed the batch's rows the tokens their cache lacks, as wide as the longest lag of a drafting
        row (a row not drafting takes what fits, one not asked none); the logits (rows, vocab) of each
        row's last token fed (any for a row fed none). None when no drafting row is in the batch."""
        if not self.rows:
            return None
        lengths = self.cache[0].lengths
        at = {id(d): i for i, d in enumerate(self.rows)}
        width = max(
            (
                len(r.tokens) - lengths[at[id(d)]]
                for r, d in zip(asked, drafters, strict=True)
                if r.depth > 0 and id(d) in at
            ),
            default=0,
        )
        if width <= 0:
            return mx.zeros((len(self.rows), self.model.args.vocab_size))  # their drafts are never kept
        fed: list[list[int]] = [[] for _ in self.rows]
        for r, d in zip(asked, drafters, strict=True):
            if id(d) in at:
                i = at[id(d)]
                fed[i] = list(r.tokens[lengths[i] : lengths[i] + width])
        return self._feed(fed)

    def _feed(self, fed: list[list[int]]) -> mx.array:
        """One forward a chunk of columns feeding row i the tokens `fed[i]`, right-padded to the longest
        (the padding columns become the row's holes), and with `pad_shapes` (a GPU; no windowed layer)
        to a power of two (the columns past every row's tokens: forgotten) reading whole steps of the
        cache: the shapes a GPU meets change once per 256 columns and a few widths, not at every step
        (see `VerifyStep`); the logits of each row's last token fed."""
        width, done = max(len(f) for f in fed), 0
        last: mx.array | None = None  # (rows, hidden): each row's last fed token's, as far as fed
        while done < width:
            n = min(self.chunk, width - done)
            if self._whole_steps and n > 1:  # a chunk as wide as `chunk` stays so: the last one is padded
                n = min(padded_size(n, smallest=1), self.chunk)
            parts = [f[done : done + n] for f in fed]
            block = mx.array([p + [0] * (n - len(p)) for p in parts], dtype=mx.int32)
            with one_offset(self.cache), whole_steps(self.cache, n, self._whole_steps) as columns:
                mask = self.cache[0].mask(n, columns)
                hidden = self.model.hidden(block, cache=self.cache, mask=mask)
            for layer in self.cache:
                layer.trim_rows(n, [len(p) for p in parts])
            ends = mx.array([max(len(p) - 1, 0) for p in parts], dtype=mx.int32)
            here = mx.take_along_axis(hidden, ends[:, None, None], axis=1)[:, 0, :]
            if last is None:
                last = here
            else:  # a row whose tokens ended in an earlier chunk keeps that chunk's
                ended = mx.array([bool(p) for p in parts])
                last = mx.where(ended[:, None], here, last)
            done += n
            if done < width:  # a long block goes chunk by chunk, as a prefill does
                mx.eval([c for layer in self.cache for c in (layer.keys, layer.values) if c is not None])
        assert last is not None
        return self.model.logits(last)

    def _join(self, rows: list[RowToDraft]) -> mx.array:
        """New rows prefilled from their tokens (those that fit a chunk in one forward; with `pad_shapes`
        its rows and width padded, so a GPU meets a few shapes, not one a prompt length) and added to
        the cache; their last tokens' logits (rows, vocab), in the order they now hold in the batch."""
        short = [r for r in rows if len(r.tokens) <= self.chunk]
        long = [r for r in rows if len(r.tokens) > self.chunk]
        caches: list[list[KVCache]] = []
        logits: list[mx.array] = []
        if short:
            made, first = prefill_rows(
                self.model, [(r.tokens, self.model.make_cache()) for r in short], self.pad_shapes
            )
            caches.extend(made)
            logits.append(first)
        for r in long:
            cache = self.model.make_cache()
            logits.append(prefill(self.model, r.tokens, cache, self.chunk, self.pad_shapes))
            caches.append(cache)
        for n, layer in enumerate(self.cache):
            layer.add([cache[n] for cache in caches])
        for r in [*short, *long]:
            drafter = self._own(r.drafter)
            drafter.batch = self
            self.rows.append(drafter)
        self._kept = [0] * len(self.rows)
        return mx.concatenate(logits)

    def _roll_back(self) -> None:
        """Cut every row back to the drafts it keeps of the last proposal; squeeze holes out once a row
        holds a step's worth."""
        if self._drafted and self.rows:
            for layer in self.cache:
                layer.trim_rows(self._drafted, self._kept)
        self._drafted, self._kept = 0, [0] * len(self.rows)
        first = self.cache[0]
        if self.rows and first.has_holes and max(first.holes) >= BatchKVCache.step:
            self._keep(list(range(len(self.rows))))

    def _keep(self, rows: list[int]) -> None:
        """Keep only the buffer rows `rows` (one copy, holes squeezed out)."""
        first = self.cache[0]
        for n, layer in enumerate(self.cache):
            layer.keep(rows, like=first if n else None)
