"""Prompts of an exact token length, and score candidates that each add exactly one token.

Byte-level BPE tokenizers split text before every ` word` (a space followed by letters), so a text made
of ` word` pieces tokenizes piece by piece: its length is the sum of the pieces' lengths. That makes
exact lengths easy to build for any such tokenizer (the tiny test one, SmolLM2's, Llama 3's).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_COMMON = [
    "the",
    "and",
    "of",
    "is",
    "an",
    "to",
    "in",
    "it",
    "on",
    "a",
    "capital",
    "jobs",
    "re",
    "ca",
    "be",
    "as",
    "at",
    "by",
    "or",
    "for",
    "with",
    "that",
    "this",
    "from",
    "was",
    "are",
    "not",
    "but",
]


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class PromptMaker:
    """Builds texts of exact token counts from random ` word` pieces (seeded, so runs repeat)."""

    tokenizer: TextTokenizer
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._len: dict[str, int] = {}
        self.special = len(self.tokenizer.encode(" a", add_special_tokens=True)) - len(
            self.tokenizer.encode(" a", add_special_tokens=False)
        )
        self.ones = [w for w in (" " + c for c in _COMMON) if self.piece_len(w) == 1]
        if not self.ones:
            raise RuntimeError("this tokenizer has no one-token ` word` pieces to pad prompts with")

    def piece_len(self, piece: str) -> int:
        n = self._len.get(piece)
        if n is None:
            n = self._len[piece] = len(self.tokenizer.encode(piece, add_special_tokens=False))
        return n

    def _word(self) -> str:
        return " " + "".join(self.rng.choice(_LETTERS) for _ in range(self.rng.randint(2, 7)))

    def pieces(self, n: int) -> str:
        """Text of exactly `n` tokens (no special tokens counted) made of ` word` pieces."""
        parts: list[str] = []
        left = n
        while left > 8:
            w = self._word()
            k = self.piece_len(w)
            if k <= left:
                parts.append(w)
                left -= k
        parts.extend(self.rng.choice(self.ones) for _ in range(left))
        return "".join(parts)

    def prompt(self, n: int) -> str:
        """A prompt that encodes (with special tokens, as a request does by default) to `n` tokens."""
        text = self.pieces(n - self.special)
        got = len(self.tokenizer.encode(text))
        if got != n:
            raise RuntimeError(f"built a prompt of {got} tokens instead of {n}")
        return text

    def candidates(self, prompt: str, k: int) -> list[str]:
        """`k` candidates that each add exactly one ordinary token to `prompt`."""
        base = self.tokenizer.encode(prompt)
        out = []
        for w in self.ones:
            ids = self.tokenizer.encode(prompt + w)
            if len(ids) == len(base) + 1 and ids[: len(base)] == base:
                out.append(w)
            if len(out) == k:
                return out
        raise RuntimeError(f"only {len(out)} one-token candidates found for this tokenizer, wanted {k}")
