"""How far two token sequences agree: the walk every prefix tree here (the prefix cache, scoring's
radix tree, a generation batch's shared-prefix rule) makes on each lookup or insert."""

from __future__ import annotations

from collections.abc import Sequence

_BLOCK = 256


def common_length(span: Sequence[int], tokens: Sequence[int], start: int = 0) -> int:
    """How many of `span`'s first tokens equal those of `tokens` from `start` on.

    Whole blocks are compared as slices (in C), and only the block that differs token by token: a walk
    one token at a time in Python is paid by every prefix-cache hit before its first token, and by
    every row a score batch inserts into its tree (64 rows sharing 2,048 tokens: 131k steps)."""
    n = min(len(span), len(tokens) - start)
    for b in range(0, n, _BLOCK):
        e = min(b + _BLOCK, n)
        if span[b:e] != tokens[start + b : start + e]:
            return next(k for k in range(b, e) if span[k] != tokens[start + k])
    return max(n, 0)
