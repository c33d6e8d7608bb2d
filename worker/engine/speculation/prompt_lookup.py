"""Prompt lookup: draft tokens copied from earlier in the row's own text, no model.

Where a row's last few tokens occurred before (in its prompt or in what it generated), the tokens that
followed that occurrence are a guess at what follows now. Copy-heavy work (editing code, extracting
fields, quoting a passage) repeats long runs of its prompt, and such guesses are often right; open
prose rarely repeats, and then there is no match and no proposal (the row takes a plain step).
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """A `Drafter` matching the row's last `max_ngram` .. `min_ngram` tokens against its earlier tokens.

    The longest suffix that matches wins (a longer match is more specific); among its occurrences the
    latest (the text nearest the cursor is the likeliest to be continued), within the last `window`
    tokens. A lookup is a dictionary probe per n-gram length: each row's n-grams are indexed once, as
    its tokens arrive (the latest start of each n-gram that something followed), so a step costs the
    same host work however long the row is. One instance serves one row (its tokens only ever grow:
    rejected drafts never reach it)."""

    def __init__(self, min_ngram: int = 2, max_ngram: int = 8, window: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if window < max_ngram + 1:
            raise ValueError(f"prompt lookup's window must exceed max_ngram ({max_ngram}), got {window}")
        self.min_ngram, self.max_ngram, self.window = min_ngram, max_ngram, window
        self._tokens: list[int] = []
        self._starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if depth <= 0:
            return []
        self._index(tokens)
        seen, total = self._tokens, len(self._tokens)
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            start = self._starts[n].get(tuple(seen[total - n :]))
            if start is not None and start >= total - self.window:
                return seen[start + n : start + n + depth]
        return []

    def may_propose(self, tokens: Sequence[int]) -> bool:
        """Whether the row is copying now (its tokens so far end in a match), so that a proposal after
        its next token, not known yet, is likely: a batch otherwise takes a plain step, which keeps a
        step in flight, rather than a verify step that would draft nothing."""
        return bool(self.propose(tokens, 1))

    def accepted(self, proposed: int, kept: int) -> None:
        """Nothing to roll back: rejected drafts never reach the index."""

    def _index(self, tokens: Sequence[int]) -> None:
        """Take the tokens past those indexed; index every n-gram now followed by a token."""
        known = len(self._tokens)
        if len(tokens) < known or (known and tokens[known - 1] != self._tokens[-1]):
            self._tokens, known = [], 0  # not this row's continuation: start over
            for starts in self._starts.values():
                starts.clear()
        self._tokens.extend(tokens[known:])
        seen = self._tokens
        for n, starts in self._starts.items():
            # n-grams followed by a token: starts 0 .. len - n - 1; those from known - n on are new
            for start in range(max(0, known - n), len(seen) - n):
                starts[tuple(seen[start : start + n])] = start
