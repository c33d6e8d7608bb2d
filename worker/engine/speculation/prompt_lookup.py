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
    latest (the text nearest the cursor is the likeliest to be continued). The search runs over the
    last `window` tokens only, so a step costs at most that much host work however long the row grows.
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, window: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if window < max_ngram + 1:
            raise ValueError(f"prompt lookup's window must exceed max_ngram ({max_ngram}), got {window}")
        self.min_ngram, self.max_ngram, self.window = min_ngram, max_ngram, window

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if depth <= 0:
            return []
        seen = list(tokens[-self.window :])
        n_all = len(seen)
        for n in range(min(self.max_ngram, n_all - 1), self.min_ngram - 1, -1):
            suffix = seen[n_all - n :]
            # latest occurrence first, the suffix itself excluded (it must be followed by something)
            for start in range(n_all - n - 1, -1, -1):
                if seen[start : start + n] == suffix:
                    follow = seen[start + n : start + n + depth]
                    if follow:
                        return follow
        return []

    def accepted(self, proposed: int, kept: int) -> None:
        """Nothing to roll back: the lookup keeps no state of its own."""
