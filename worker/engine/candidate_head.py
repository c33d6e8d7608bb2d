"""The candidates head: a prompt's next-token logits kept (`CandidateHead`), then each candidate's raw
logit and full-vocabulary log-probability gathered from them (`candidate_scores`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx

from mlxq.worker.engine.score_head import Pick


class CandidateHead:
    """Candidate rows: the logits (vocab,) after each prompt's last token, kept for `candidate_scores`."""

    def __init__(self, prompts: Sequence[list[int]]) -> None:
        self.inputs = prompts
        self.logits: list[mx.array | None] = [None] * len(prompts)

    def needed(self, row: int) -> range:
        n = len(self.inputs[row])
        return range(n - 1, n)

    def take(self, logits: mx.array, picks: Sequence[Pick]) -> None:
        mine = logits[mx.array([p.at for p in picks])]  # a copy: a kept row holds no other row's block
        mx.eval(mine)
        for i, p in enumerate(picks):
            self.logits[p.row] = mine[i]


def candidate_scores(
    logits: list[mx.array], candidate_ids: list[list[int]]
) -> list[tuple[list[float], list[float]]]:
    """Per row: the candidates' raw logits and full-vocabulary log-probabilities (one device sync)."""
    table = mx.stack(logits)  # (rows, vocab)
    rows = mx.array([r for r, cands in enumerate(candidate_ids) for _ in cands])
    cols = mx.array([c for cands in candidate_ids for c in cands])
    picked = table[rows, cols]
    lse = mx.logsumexp(table, axis=-1)[rows]
    # 1-D float arrays: lists of floats (MLX types `tolist` as any nesting)
    raw, logprobs = cast("list[float]", picked.tolist()), cast("list[float]", (picked - lse).tolist())
    out, start = [], 0
    for cands in candidate_ids:
        end = start + len(cands)
        out.append((raw[start:end], logprobs[start:end]))
        start = end
    return out
