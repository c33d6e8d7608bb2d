"""Scoring many positions of many sequences: each token's log-probability after what precedes it.

Continuations, rolling windows and prompt logprobs all ask the same question of a token sequence: from
its token `first` on, each token's log-probability given the tokens before it (and whether it is the
argmax, and optionally the top-k alternatives and the log-probabilities of chosen ids). Position p's
hidden state predicts token p + 1, so a sequence's model input is `tokens[:-1]` and the positions that
count are `first - 1 ..`.

As `PrefixScorer` does for next-token candidates, the inputs go into one radix tree (`scoring.build_tree`)
and each shared span is computed once: on a batch-1 KV cache for shared spans, as right-padded batches
for the suffixes under a node. Wherever a span is computed, the positions some sequence under it needs
are picked out of the hidden states and go through the LM head in chunks of `head_chunk` positions, so a
long prompt never holds a [T, vocab] float32 block, and a position several sequences need (a question's
last context token, before each of its continuations) goes through the head once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache, broadcast_batch, key_columns
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.scoring import _Node, build_tree, computed_per_row


@dataclass(frozen=True)
class TokenSeq:
    """A sequence whose tokens from `first` (>= 1) on are scored; `top_k` alternatives and the
    log-probabilities of `chosen` ids at each of those positions where asked."""

    tokens: list[int]
    first: int
    top_k: int = 0
    chosen: tuple[int, ...] = ()

    @property
    def inputs(self) -> list[int]:
        return self.tokens[:-1]


@dataclass
class TokenScores:
    """Per scored token, in order: its log-probability, whether it is the argmax, its alternatives
    (id, logprob; most likely first) and the log-probabilities of the chosen ids."""

    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    chosen: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class _Pick:
    seq: int
    slot: int  # index among the sequence's scored tokens
    at: int  # row of the flattened hidden states


class TokenScorer:
    """Scores `TokenSeq`s, each shared prefix computed once (see the module's docstring).

    With a `PrefixCache`, a top-level span starts from the longest cached prefix that ends before any
    position a sequence under it needs, and every span computed on the batch-1 path is offered back.
    A suffix batch holds a copy of its shared prefix's keys and values per row: with
    `max_batch_kv_bytes` (and the model's `kv_bytes_per_token`) it takes only as many rows as keep
    those copies within that many bytes, as `PrefixScorer`'s do.
    `interrupt` is called before every forward; whatever it raises ends the scoring there.
    """

    def __init__(
        self,
        model: Model,
        *,
        prefix_cache: PrefixCache | None = None,
        prefill_chunk: int = 2048,
        max_batch_rows: int = 32,
        max_batch_tokens: int = 8192,
        max_batch_kv_bytes: int = 0,
        kv_bytes_per_token: int = 0,
        min_shared: int = 32,
        head_chunk: int = 256,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.max_batch_rows = max_batch_rows
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_kv_bytes = max_batch_kv_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.min_shared = min_shared
        self.head_chunk = head_chunk
        self.interrupt = interrupt or (lambda: None)

    def score(self, seqs: Sequence[TokenSeq]) -> tuple[list[TokenScores], list[int]]:
        """Each sequence's scores, and the input tokens each computed itself (`computed_per_row`)."""
        for s in seqs:
            if not 1 <= s.first < len(s.tokens):
                raise ValueError(f"a scored sequence of {len(s.tokens)} tokens cannot start at {s.first}")
        self._seqs = seqs
        self._out = [_empty(len(s.tokens) - s.first) for s in seqs]
        root = build_tree([s.inputs for s in seqs], self.min_shared)
        self._below: dict[int, list[int]] = {}
        self._index_below(root)
        reused: dict[int, int] = {}
        leaves = []
        for child in root.below():
            limit = min(self._seqs[i].first - 1 for i in self._below[id(child)])
            head = child.span[:limit]
            hit = self.prefix_cache.peek(head) if self.prefix_cache is not None and head else 0
            if not (hit or child.below() or len(child.span) > self.prefill_chunk):
                leaves.append(child)
                continue
            if hit and self.prefix_cache is not None:
                cache, reused[id(child)] = self.prefix_cache.begin(head, len(self.model.layers))
            else:
                cache = self.model.make_cache()
            self._extend(child, cache, 0, reused.get(id(child), 0))
            self._visit(child, child.span, cache)
        self._run_leaves(leaves, self.model.make_cache(), 0)
        return self._out, computed_per_row(root, len(seqs), reused)

    def _index_below(self, node: _Node) -> list[int]:
        below = list(node.rows)
        for child in node.below():
            below += self._index_below(child)
        self._below[id(node)] = below
        return below

    def _visit(self, node: _Node, prefix: list[int], cache: list[KVCache]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.offer(prefix, cache)
        leaves = []
        for child in node.below():
            if child.below() or len(child.span) > self.prefill_chunk:
                self._extend(child, cache, len(prefix))
                self._visit(child, prefix + child.span, cache)
                for c in cache:
                    c.trim(len(child.span))
            else:
                leaves.append(child)
        self._run_leaves(leaves, cache, len(prefix))

    def _extend(self, node: _Node, cache: list[KVCache], depth: int, start: int = 0) -> None:
        """Append the node's span (from `start`) to the batch-1 cache, scoring the positions in it that
        sequences under the node need; `depth` is the cache's length before the span."""
        ids = mx.array(node.span, dtype=mx.int32)[None]
        while start < len(node.span):
            end = min(start + self.prefill_chunk, len(node.span))
            self.interrupt()
            hidden = self.model.hidden(ids[:, start:end], cache=cache)[0]  # (chunk, H)
            picks = [
                _Pick(i, p - (self._seqs[i].first - 1), p - depth - start)
                for i in self._below[id(node)]
                for p in self._needed(i, depth + start, depth + end)
            ]
            self._score(hidden, picks)
            mx.eval([c.state for c in cache])
            start = end

    def _needed(self, seq: int, lo: int, hi: int) -> range:
        """Positions in [lo, hi) whose hidden states sequence `seq` needs."""
        s = self._seqs[seq]
        return range(max(lo, s.first - 1), min(hi, len(s.tokens) - 1))

    def _run_leaves(self, leaves: list[_Node], cache: list[KVCache], depth: int) -> None:
        for group in self._batches(leaves, depth):
            self.interrupt()
            width = max(len(n.span) for n in group)
            ids = mx.array([n.span + [0] * (width - len(n.span)) for n in group], dtype=mx.int32)
            batch_cache = broadcast_batch(cache, len(group), width) if cache[0].offset else None
            hidden = self.model.hidden(ids, cache=batch_cache or self.model.make_cache())
            flat = hidden.reshape(-1, hidden.shape[-1])  # (B * width, H); right padding is never picked
            picks = [
                _Pick(i, p - (self._seqs[i].first - 1), b * width + p - depth)
                for b, n in enumerate(group)
                for i in self._below[id(n)]
                for p in self._needed(i, depth, depth + len(n.span))
            ]
            self._score(flat, picks)

    def _batches(self, leaves: list[_Node], prefix: int) -> list[list[_Node]]:
        """Leaf suffixes grouped (similar lengths together) under the row, token and KV budgets."""
        groups: list[list[_Node]] = []
        current: list[_Node] = []
        for n in sorted(leaves, key=lambda n: len(n.span)):
            rows, width = len(current) + 1, len(n.span)
            kv = rows * key_columns(prefix + width) * self.kv_bytes_per_token if prefix else 0
            if current and (
                rows > self.max_batch_rows
                or width * rows > self.max_batch_tokens
                or kv > self.max_batch_kv_bytes > 0
            ):
                groups.append(current)
                current = []
            current.append(n)
        if current:
            groups.append(current)
        return groups

    def _score(self, hidden: mx.array, picks: list[_Pick]) -> None:
        """Fill the picks' scores from `hidden` (N, H): each hidden row through the LM head once, at
        most `head_chunk` rows at a time."""
        by_row: dict[int, list[_Pick]] = defaultdict(list)
        for pick in picks:
            by_row[pick.at].append(pick)
        rows = sorted(by_row)
        for c in range(0, len(rows), self.head_chunk):
            chunk = rows[c : c + self.head_chunk]
            logits = self.model.logits(hidden[mx.array(chunk)]).astype(mx.float32)  # (m, vocab)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            mine = [(j, p) for j, r in enumerate(chunk) for p in by_row[r]]
            where = mx.array([j for j, _ in mine])
            targets = mx.array([self._seqs[p.seq].tokens[p.slot + self._seqs[p.seq].first] for _, p in mine])
            picked = logprobs[where, targets]
            greedy = mx.argmax(logprobs, axis=-1)[where] == targets
            k = max(self._seqs[p.seq].top_k for _, p in mine)
            top_ids = top_lp = None
            if k:
                top_ids = mx.argsort(-logprobs, axis=-1)[:, :k] if k * 8 > logprobs.shape[-1] else None
                if top_ids is None:
                    part = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
                    order = mx.argsort(-mx.take_along_axis(logprobs, part, axis=-1), axis=-1)
                    top_ids = mx.take_along_axis(part, order, axis=-1)
                top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
            chosen_ids = sorted({t for _, p in mine for t in self._seqs[p.seq].chosen})
            chosen = logprobs[:, mx.array(chosen_ids)] if chosen_ids else None
            mx.eval(picked, greedy, *(a for a in (top_ids, top_lp, chosen) if a is not None))
            lp = cast("list[float]", picked.tolist())
            gr = cast("list[bool]", greedy.tolist())
            ti = cast("list[list[int]]", top_ids.tolist()) if top_ids is not None else []
            tl = cast("list[list[float]]", top_lp.tolist()) if top_lp is not None else []
            ch = cast("list[list[float]]", chosen.tolist()) if chosen is not None else []
            col = {t: n for n, t in enumerate(chosen_ids)}
            for n, (j, p) in enumerate(mine):
                seq, out = self._seqs[p.seq], self._out[p.seq]
                out.logprobs[p.slot] = lp[n]
                out.greedy[p.slot] = gr[n]
                if seq.top_k:
                    out.top[p.slot] = list(zip(ti[j][: seq.top_k], tl[j][: seq.top_k], strict=True))
                if seq.chosen:
                    out.chosen[p.slot] = [ch[j][col[t]] for t in seq.chosen]


def _empty(n: int) -> TokenScores:
    return TokenScores([0.0] * n, [False] * n, [[] for _ in range(n)], [[] for _ in range(n)])
