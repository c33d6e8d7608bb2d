"""The token head: each token's log-probability after the tokens before it, for `PrefixScorer`.

Continuations, rolling windows and prompt logprobs all ask the same question of a token sequence: from
its token `first` on, each token's log-probability given the tokens before it (and whether it is the
argmax, and optionally the top-k alternatives and the log-probabilities of chosen ids). Position p's
hidden state predicts token p + 1, so a sequence's model input is `tokens[:-1]` and the positions that
count are `first - 1 ..`. The scorer computes those positions' logits (sharing prefixes with every other
row of the batch, candidates included) and hands them here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from mlxq.worker.engine.prefix_scorer import PrefixScorer
from mlxq.worker.engine.score_head import Pick

# One scorer serves every kind of row; this module's readers knew it by this name.
TokenScorer = PrefixScorer


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


class TokenHead:
    """`TokenSeq` rows (a `ScoreHead`): `scores` holds each sequence's `TokenScores` once scored."""

    def __init__(self, seqs: Sequence[TokenSeq]) -> None:
        for s in seqs:
            if not 1 <= s.first < len(s.tokens):
                raise ValueError(f"a scored sequence of {len(s.tokens)} tokens cannot start at {s.first}")
        self.seqs = seqs
        self.inputs = [s.inputs for s in seqs]
        self.scores = [_empty(len(s.tokens) - s.first) for s in seqs]

    def needed(self, row: int) -> range:
        s = self.seqs[row]
        return range(s.first - 1, len(s.tokens) - 1)

    def take(self, logits: mx.array, picks: Sequence[Pick]) -> None:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        where = mx.array([p.at for p in picks])
        targets = mx.array([self.seqs[p.row].tokens[p.position + 1] for p in picks])
        picked = logprobs[where, targets]
        greedy = mx.argmax(logprobs, axis=-1)[where] == targets
        top_ids, top_lp = _top(logprobs, max(self.seqs[p.row].top_k for p in picks))
        chosen_ids = sorted({t for p in picks for t in self.seqs[p.row].chosen})
        chosen = logprobs[:, mx.array(chosen_ids)] if chosen_ids else None
        mx.eval(picked, greedy, *(a for a in (top_ids, top_lp, chosen) if a is not None))
        lp = cast("list[float]", picked.tolist())
        gr = cast("list[bool]", greedy.tolist())
        ti = cast("list[list[int]]", top_ids.tolist()) if top_ids is not None else []
        tl = cast("list[list[float]]", top_lp.tolist()) if top_lp is not None else []
        ch = cast("list[list[float]]", chosen.tolist()) if chosen is not None else []
        col = {t: n for n, t in enumerate(chosen_ids)}
        for n, p in enumerate(picks):
            seq, out = self.seqs[p.row], self.scores[p.row]
            slot = p.position - (seq.first - 1)
            out.logprobs[slot] = lp[n]
            out.greedy[slot] = gr[n]
            if seq.top_k:
                out.top[slot] = list(zip(ti[p.at][: seq.top_k], tl[p.at][: seq.top_k], strict=True))
            if seq.chosen:
                out.chosen[slot] = [ch[p.at][col[t]] for t in seq.chosen]


def _top(logprobs: mx.array, k: int) -> tuple[mx.array | None, mx.array | None]:
    """The `k` most likely ids per row, most likely first, and their log-probabilities (None for 0)."""
    if not k:
        return None, None
    if k * 8 > logprobs.shape[-1]:
        ids = mx.argsort(-logprobs, axis=-1)[:, :k]
    else:  # a partial sort of the vocabulary, then a full one of the k kept
        part = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        order = mx.argsort(-mx.take_along_axis(logprobs, part, axis=-1), axis=-1)
        ids = mx.take_along_axis(part, order, axis=-1)
    return ids, mx.take_along_axis(logprobs, ids, axis=-1)


def _empty(n: int) -> TokenScores:
    return TokenScores([0.0] * n, [False] * n, [[] for _ in range(n)], [[] for _ in range(n)])
