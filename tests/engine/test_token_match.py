"""`common_length`: the block-wise walk agrees with a token-by-token one."""

from __future__ import annotations

import random

from mlxq.worker.engine.cache.token_match import common_length


def _walk(span: list[int], tokens: list[int], start: int) -> int:
    k = 0
    while k < len(span) and start + k < len(tokens) and span[k] == tokens[start + k]:
        k += 1
    return k


def test_common_length_is_the_token_by_token_walk() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        span = [rng.randrange(3) for _ in range(rng.randrange(700))]
        start = rng.randrange(6)
        tokens = [rng.randrange(3) for _ in range(start)] + span[: rng.randrange(len(span) + 1)]
        tokens += [rng.randrange(3) for _ in range(rng.randrange(300))]
        assert common_length(span, tokens, start) == _walk(span, tokens, start)
    assert common_length([1, 2], [1, 2], 5) == 0  # a start past the end matches nothing
