"""Each token's own piece of text, for answers that list tokens (OpenAI's `logprobs` with `echo`).

A token's text is what it adds to the decoded text (`IncrementalDetokenizer`'s delta), so the pieces
of a sequence join into its decoded text exactly and their offsets index that text; a token that ends
inside a character adds "" and the token completing it carries the whole character. An alternative
token, seen alone, is its own decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxq.worker.engine.text.detokenizer import IncrementalDetokenizer
from mlxq.worker.engine.text.tokenizer import Tokenizer


def token_texts(tokenizer: Tokenizer, ids: Sequence[int]) -> tuple[list[str], list[int]]:
    """The text each of `ids` adds, and where it starts in their joined text."""
    detok = IncrementalDetokenizer(tokenizer)
    texts = [detok.add(t) for t in ids]
    rest = detok.flush()
    if texts and rest:
        texts[-1] += rest
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return texts, offsets


def piece(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text, alone."""
    return tokenizer.decode([token_id])
