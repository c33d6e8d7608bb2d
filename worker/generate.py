"""Token-level generation: chunked prefill, then decode with one step in flight.

Yields token ids only; text, stop strings, streaming and Redis live one layer up (`engine.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import mlx.core as mx

# Release MLX's buffer cache at intervals, not every token: freeing is cheap, reallocating is not.
_CLEAR_CACHE_EVERY = 256


class TokenSampler(Protocol):
    """Picks the next token from (1, vocab) logits; may keep state (penalty counts, PRNG key)."""

    def __call__(self, logits: mx.array) -> mx.array: ...

    def observe(self, token: mx.array) -> None: ...


def prefill(
    model: Any,
    tokens: Sequence[int],
    cache: list[Any],
    chunk: int,
    cancelled: Callable[[], bool] = lambda: False,
) -> mx.array:
    """Run `tokens` through the model into `cache` in chunks; return the last position's logits (1, V).

    The cache state is evaluated after every chunk so a long prompt never builds one huge graph.
    """
    if not tokens:
        raise ValueError("prefill needs at least one token")
    ids = mx.array(list(tokens), dtype=mx.int32)[None]
    n = ids.shape[1]
    start = 0
    while n - start > chunk:
        model(ids[:, start : start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
        start += chunk
        if cancelled():
            raise GenerationCancelled()
    hidden = model.hidden(ids[:, start:], cache=cache)
    return model.logits(hidden[:, -1:, :])[:, -1, :]


class GenerationCancelled(Exception):
    """Raised inside prefill when the job was cancelled between chunks."""


def decode(
    model: Any, first_logits: mx.array, cache: list[Any], sampler: TokenSampler, max_tokens: int
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled token ids, keeping the next step computing while one is consumed.

    The caller stops early by closing the generator (or just not asking for more).
    """

    def step(logits: mx.array) -> mx.array:
        token = sampler(logits)
        sampler.observe(token)
        return token

    token = step(first_logits)
    mx.async_eval(token)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]
            next_token = step(logits)
            mx.async_eval(next_token)
        yield int(token.item())
        if n + 1 < max_tokens:
            token = next_token
        if n % _CLEAR_CACHE_EVERY == _CLEAR_CACHE_EVERY - 1:
            mx.clear_cache()
