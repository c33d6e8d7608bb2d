"""The candidates head: a prompt's next-token logits kept (`CandidateHead`), then each candidate's raw
logit and full-vocabulary log-probability gathered from them (`candidate_scores`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx

from mlxq.worker.engine.score_head import Pick


class CandidateHead:
    """Candidate rows: the logits (vocab,) after each prompt's last token, kept for `candidate_scores`.

    Kept as the blocks `take` gathered (a forward's picked rows each) with each row's place in them:
    the table of all rows is then one gather, not a slice a row and a stack of them all."""

    def __init__(self, prompts: Sequence[list[int]]) -> None:
        self.inputs = prompts
        self._blocks: list[mx.array] = []
        self._places: list[int | None] = [None] * len(prompts)  # a row's row in `_blocks` laid end to end
        self._rows_kept = 0

    def needed(self, row: int) -> range:
        n = len(self.inputs[row])
        return range(n - 1, n)

    def take(self, logits: mx.array, picks: Sequence[Pick]) -> None:
        mine = logits[mx.array([p.at for p in picks])]  # a copy: a kept row holds no other row's block
        mx.eval(mine)
        self._blocks.append(mine)
        for i, p in enumerate(picks):
            self._places[p.row] = self._rows_kept + i
        self._rows_kept += len(picks)

    def table(self) -> mx.array:
        """The kept logits (rows, vocab) of the rows taken, in row order."""
        places = [at for at in self._places if at is not None]
        whole = self._whole()
        if places == list(range(whole.shape[0])):
            return whole
        return whole[mx.array(places)]

    @property
    def logits(self) -> list[mx.array | None]:
        """Each row's kept logits (vocab,); None for a row not taken."""
        whole = self._whole() if self._blocks else None
        return [None if at is None or whole is None else whole[at] for at in self._places]

    def _whole(self) -> mx.array:
        return self._blocks[0] if len(self._blocks) == 1 else mx.concatenate(self._blocks)


def candidate_scores(
    table: mx.array, candidate_ids: list[list[int]]
) -> list[tuple[list[float], list[float]]]:
    """Per row of `table` (rows, vocab): the candidates' raw logits and full-vocabulary
    log-probabilities (one device sync)."""
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
