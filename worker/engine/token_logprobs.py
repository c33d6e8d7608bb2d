"""Log-probabilities of generated tokens, computed on the device in the step that samples them.

Owns one thing: given a decode step's (B, vocab) logits and the (B,) tokens drawn from them, the chosen
token's log-probability and each row's `k` likeliest alternatives, as lazy arrays that the decode loop
reads back together with the tokens (no sync of their own). The logits are the model's raw ones: the
log-softmax is of the model's distribution, before logit bias, penalties, temperature, filters and
grammar masks, as OpenAI reports `logprobs` (a token the sampler could only draw because of a bias still
reports the model's own, possibly very low, log-probability). Rows that asked for no logprobs are not
part of the graph: the caller passes only the rows that asked, and `top` is sized for the largest `k`
among them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from mlxq.jobs.schema import GeneratedLogprob, TopLogprob


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model and its `top` alternatives (id,
    log-probability), most likely first."""

    id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class StepLogprobs:
    """A step's logprobs for some rows (`rows`, indices into the step's batch), lazy until `read`."""

    rows: list[int]
    ks: list[int]
    chosen: mx.array  # (R,) float32
    top_ids: mx.array  # (R, K) int32, K = max(ks)
    top_logprobs: mx.array  # (R, K) float32

    def arrays(self) -> list[mx.array]:
        """What to evaluate together with the step's tokens."""
        return [self.chosen, self.top_ids, self.top_logprobs]

    def read(self, tokens: Mapping[int, int]) -> dict[int, TokenLogprob]:
        """Row index -> its token's logprob, from evaluated arrays, for the rows in `tokens` (row -> the
        row's token)."""
        chosen = cast("list[float]", self.chosen.tolist())
        ids = cast("list[list[int]]", self.top_ids.tolist())
        lps = cast("list[list[float]]", self.top_logprobs.tolist())
        out: dict[int, TokenLogprob] = {}
        for j, (row, k) in enumerate(zip(self.rows, self.ks, strict=True)):
            if row in tokens:
                top = [(int(i), float(p)) for i, p in zip(ids[j][:k], lps[j][:k], strict=True)]
                out[row] = TokenLogprob(int(tokens[row]), float(chosen[j]), top)
        return out


def as_generated(lp: TokenLogprob, text_of: Callable[[int], str]) -> GeneratedLogprob:
    """A token's logprob as a result and a stream event carry it, with the texts `text_of` gives."""
    top = [TopLogprob(id=i, logprob=p, text=text_of(i)) for i, p in lp.top]
    return GeneratedLogprob(id=lp.id, logprob=lp.logprob, text=text_of(lp.id), top=top)


def log_softmax(logits: mx.array) -> mx.array:
    """Row-wise log-softmax in float32 (a bf16 model's logits are widened first)."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def step_logprobs(logits: mx.array, tokens: mx.array, rows: Sequence[int], ks: Sequence[int]) -> StepLogprobs:
    """Logprobs of `tokens` (B,) under `logits` (B, vocab) for `rows`, each with its own `ks[i]` (0..20)
    alternatives; lazy. `rows` must not be empty."""
    if not rows or len(rows) != len(ks):
        raise ValueError(f"rows {list(rows)} and ks {list(ks)} must be non-empty and of equal length")
    index = mx.array(list(rows), dtype=mx.int32)
    picked = (
        logits if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))) else logits[index]
    )
    lp = log_softmax(picked)
    chosen = mx.take_along_axis(lp, tokens[index][:, None].astype(mx.int32), axis=-1)[:, 0]
    k = max(ks)
    if k == 0:
        empty_i = mx.zeros((len(rows), 0), dtype=mx.int32)
        return StepLogprobs(list(rows), list(ks), chosen, empty_i, mx.zeros((len(rows), 0), dtype=mx.float32))
    k = min(k, lp.shape[-1])
    # the k largest in any order (a partition, not a sort of the whole vocabulary), then ranked
    candidates = mx.argpartition(-lp, k - 1, axis=-1)[:, :k].astype(mx.int32)
    values = mx.take_along_axis(lp, candidates, axis=-1)
    rank = mx.argsort(-values, axis=-1)
    return StepLogprobs(
        list(rows),
        list(ks),
        chosen,
        mx.take_along_axis(candidates, rank, axis=-1),
        mx.take_along_axis(values, rank, axis=-1),
    )


@dataclass
class PendingLogprobs:
    """The logprobs of a decode batch's pending tokens, by row, as rows join and leave between draws.

    The pending tokens come from one draw (`reset`), followed by the draws of rows that joined since
    (`extend`), less the rows that left (`select`). `origin[i]` is the live row i's place among the rows
    of those draws in order; `parts` the draws that had rows asking logprobs, each at its first row."""

    parts: list[tuple[int, StepLogprobs]] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    total: int = 0

    def reset(self, step: StepLogprobs | None, rows: int) -> None:
        self.parts, self.origin, self.total = [], [], 0
        self.extend(step, rows)

    def extend(self, step: StepLogprobs | None, rows: int) -> None:
        if step is not None:
            self.parts.append((self.total, step))
        self.origin += range(self.total, self.total + rows)
        self.total += rows

    def select(self, rows: Sequence[int]) -> None:
        self.origin = [self.origin[i] for i in rows]

    def arrays(self) -> list[mx.array]:
        """What to evaluate with the pending tokens (none where no row asked)."""
        return [a for _, step in self.parts for a in step.arrays()]

    def read(self, tokens: Sequence[int]) -> dict[int, TokenLogprob]:
        """Live row -> its pending token's logprob (rows that asked only); `tokens`: the pending tokens,
        read back (evaluated with `arrays`, so this waits for nothing)."""
        if not self.parts:
            return {}
        live = {o: i for i, o in enumerate(self.origin)}
        out: dict[int, TokenLogprob] = {}
        for offset, step in self.parts:
            mine = {r: live[offset + r] for r in step.rows if offset + r in live}
            if not mine:
                continue
            read = step.read({r: tokens[i] for r, i in mine.items()})
            out.update((mine[r], lp) for r, lp in read.items())
        return out
