"""Token ids to text, one token at a time, never splitting a character.

Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) often spends several tokens on one emoji or CJK character.
Each delta holds back such incomplete bytes, so a stream reader never sees half a character, and all
deltas plus `flush()` add up to exactly `tokenizer.decode(ids)`.

Two strategies behind one class:
- byte-level tokenizers: each id stands for fixed bytes; an incremental UTF-8 decoder does the rest in
  O(token length) per token (Python's `replace` handling equals the Rust decoder's lossy one);
- any other decoder (SentencePiece-style Metaspace, byte fallback, Strip): decode a small window of recent
  tokens and emit what the window adds beyond its known prefix, as text-generation-inference does. The
  window starts where the last emission did, so a leading-space rule applies to both sides of the diff.
  This path assumes the decoder is local. One known case is not: ByteFallback decodes a run of byte
  tokens all-or-nothing, so a character already shown stays shown when a later byte of the same run turns
  out invalid, where `decode(ids)` would show U+FFFD for it too. Valid UTF-8 output is always exact.
"""

from __future__ import annotations

import codecs
from typing import Protocol

from mlxq.worker.engine.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class _Strategy(Protocol):
    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class _ByteLevel:
    """Fixed bytes per id through an incremental UTF-8 decoder that buffers an incomplete character."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        data = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        return str(self._utf8.decode(data))

    def flush(self) -> str:
        return str(self._utf8.decode(b"", final=True))


class _Window:
    """Decode `ids[prefix:]` and emit what it adds to the already emitted `ids[prefix:read]`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: where the previous emission began
        self._read = 0  # ids before this are emitted
        self._prefix_text = ""  # decode(ids[prefix:read]), cached until the next emission

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix :])
        # A trailing U+FFFD may be a character still missing bytes: wait for the next token.
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        delta = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return delta

    def flush(self) -> str:
        text = self._decode(self._ids[self._prefix :])
        delta = text[len(self._prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return delta


class IncrementalDetokenizer:
    """Turns generated token ids into UTF-8-safe text deltas.

    `add(id)` returns the text this token completes (possibly ""); `flush()` returns the held-back rest
    at the end (incomplete bytes as U+FFFD, as `decode` shows them). With `skip_special_tokens`, special
    tokens add no text, as `decode(ids, skip_special_tokens=True)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._strategy: _Strategy = (
            _ByteLevel(tokenizer.token_bytes) if tokenizer.byte_level else _Window(tokenizer)
        )
        self._parts: list[str] = []
        self.ids: list[int] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    def add(self, token_id: int) -> str:
        """Take the next token id; return the new text that is safe to show now."""
        self.ids.append(token_id)
        if token_id in self._skip:
            return ""
        delta = self._strategy.add(token_id)
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """Release what is held back, once, at the end of generation."""
        rest = self._strategy.flush()
        if rest:
            self._parts.append(rest)
        return rest
