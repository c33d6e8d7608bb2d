"""Encoding a long text that starts like one encoded a moment ago, from where the two part.

Bulk scoring sends many rows whose prompts share a long text (a document, few-shot examples) and
differ at the end; encoding each whole prompt dominated the time of a score batch on a GPU host (124 of
198 ms for 64 rows of 2,112 tokens). `SharedPrefixEncoder` keeps the last few long encodings. For a
new text sharing at least `min_shared_chars` characters with one of them, it takes that encoding's
tokens up to a cut and encodes only the rest of the new text.

Why the result is the text's own encoding. Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM)
first split text into pre-tokens ("words", with regexes that look ahead at most a few characters, never
behind) and merge bytes only inside a word. The cut is at the start of a word that lies wholly inside
the shared text, with another whole word after it: the splits before the cut see only shared text, so
they are the same in both texts, and splitting restarts at the cut exactly as it does at the start of
a text. Tokenizers this does not hold for (a normalizer other than NFC, no pre-tokenizer, a prefix
space or Metaspace) never take this path. And each result is checked: the re-encoded rest must start
with the cached tokens of the shared words after the cut, or the text is encoded whole.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers


def _kinds(spec: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The component and, for a Sequence, its parts (`key` names the parts' list)."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [p for p in spec.get(key, []) if isinstance(p, dict)]
    return [spec]


def reusable(backend: tokenizers.Tokenizer) -> bool:
    """Whether `backend` splits text into words the way the module docstring needs."""
    spec = json.loads(backend.to_str())
    normalizers = _kinds(spec.get("normalizer"), "normalizers")
    if any(n.get("type") != "NFC" for n in normalizers):
        return False
    pre = _kinds(spec.get("pre_tokenizer"), "pretokenizers")
    if not pre or any(p.get("type") not in ("ByteLevel", "Split", "Digits", "Punctuation") for p in pre):
        return False
    if any(p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in pre):
        return False
    # Something must split text into words: a Split, or ByteLevel's own regex.
    return any(
        p.get("type") == "Split" or (p.get("type") == "ByteLevel" and p.get("use_regex", True)) for p in pre
    )


def _trailer(backend: tokenizers.Tokenizer) -> list[int] | None:
    """The special tokens the post-processor appends after a text (an EOS), or None if it does more
    than put tokens before and after it."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[start + len(plain) :])
    return None


def _shared_chars(a: str, b: str) -> int:
    """Length of the common prefix of `a` and `b` (string slices compare in C: a binary search)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Encoded:
    """A remembered encoding, as lists (reading them off a `tokenizers.Encoding` copies every time)."""

    def __init__(self, text: str, add_special_tokens: bool, encoding: tokenizers.Encoding) -> None:
        self.text = text
        self.add_special_tokens = add_special_tokens
        self.ids: list[int] = list(encoding.ids)
        self.offsets: list[tuple[int, int]] = list(encoding.offsets)
        self.words: list[int | None] = list(encoding.word_ids)


class SharedPrefixEncoder:
    """Remembers recent long encodings; encodes a text sharing a long start with one of them in part."""

    def __init__(self, backend: tokenizers.Tokenizer, min_shared_chars: int = 1024, keep: int = 4) -> None:
        self.backend = backend
        self.trailer = _trailer(backend)
        self.enabled = self.trailer is not None and reusable(backend)
        self.min_shared_chars = min_shared_chars
        self.keep = keep
        self._recent: deque[_Encoded] = deque(maxlen=keep)
        self.reused = 0  # texts encoded in part (for tests and diagnostics)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`backend.encode(text, add_special_tokens).ids`, in part when a recent text allows it."""
        return self.encode_many([text], [add_special_tokens])[0]

    def encode_many(self, texts: Sequence[str], add_special_tokens: Sequence[bool]) -> list[list[int]]:
        """`encode` of each text (in order: a text encoded whole is remembered for those after it);
        the parts encoded after a cut go to the tokenizer in one batch call."""
        out: list[list[int]] = [[] for _ in texts]
        cuts: list[tuple[int, _Encoded, _Cut]] = []
        # Texts too short to be cut or remembered do not depend on each other's order: one batch call
        # per `add_special_tokens` value, not one crossing into the tokenizer each (a score batch of
        # short rows is mostly such texts).
        short = [k for k, text in enumerate(texts) if not self.enabled or len(text) < self.min_shared_chars]
        for special in (False, True):
            mine = [k for k in short if add_special_tokens[k] == special]
            encoded = encode_plain(self.backend, [texts[k] for k in mine], special)
            for k, plain in zip(mine, encoded, strict=True):
                out[k] = list(plain)
        done = set(short)
        for k, (text, special) in enumerate(zip(texts, add_special_tokens, strict=True)):
            if k in done:
                continue
            found = self._cut_for(text, special)
            if found is None:
                out[k] = self._whole(text, special)
            else:
                cuts.append((k, *found))
        rests = encode_plain(self.backend, [texts[k][cut.at :] for k, _, cut in cuts])
        for (k, prev, cut), rest in zip(cuts, rests, strict=True):
            ids = self._join(prev, cut, rest)
            if ids is None:  # the check failed: encoded whole after all
                out[k] = self._whole(texts[k], add_special_tokens[k])
            else:
                self.reused += 1
                out[k] = ids
        return out

    def _whole(self, text: str, add_special_tokens: bool) -> list[int]:
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        if self.enabled and len(text) >= self.min_shared_chars:
            self._recent.appendleft(_Encoded(text, add_special_tokens, encoding))
        return list(encoding.ids)

    def _cut_for(self, text: str, add_special_tokens: bool) -> tuple[_Encoded, _Cut] | None:
        """A recent encoding `text` may be cut from, and where; None: encode it whole."""
        if not self.enabled or len(text) < self.min_shared_chars:
            return None
        for prev in self._recent:
            if prev.add_special_tokens != add_special_tokens:
                continue
            shared = _shared_chars(prev.text, text)
            if shared < self.min_shared_chars:
                continue
            cut = _cut(prev, shared)
            if cut is not None:
                return prev, cut
        return None

    def _join(self, prev: _Encoded, cut: _Cut, rest: Sequence[int]) -> list[int] | None:
        """The text's ids: `prev`'s before the cut, then `rest` (the text after it, encoded), checked to
        start with `prev`'s tokens of the shared word after the cut; None when it does not."""
        if list(rest[: cut.until - cut.first]) != prev.ids[cut.first : cut.until]:
            return None
        trailer = self.trailer if prev.add_special_tokens else []
        return [*prev.ids[: cut.first], *rest, *(trailer or [])]


@dataclass(frozen=True)
class _Cut:
    """Where a text sharing its first characters with a remembered encoding is cut: before token
    `first` (at character `at`), the first token of a word wholly inside the shared text; `until` is
    the first token of the word after it."""

    first: int
    until: int
    at: int


def _cut(prev: _Encoded, shared: int) -> _Cut | None:
    """Where to cut a text that shares its first `shared` characters with `prev`, or None when no safe
    cut exists."""
    offsets, words = prev.offsets, prev.words
    # The last token lying wholly in the shared text starts (or continues) word `after`, which may run
    # past the shared text; the word before it is the cut word, wholly inside.
    last = len(prev.ids) - 1
    while last >= 0 and (words[last] is None or offsets[last][1] > shared):
        last -= 1
    if last < 0:
        return None
    after = words[last]
    assert after is not None
    until = last  # first token of word `after`
    while until > 0 and words[until - 1] == after:
        until -= 1
    first = until  # first token of the cut word
    while first > 0 and words[first - 1] == after - 1:
        first -= 1
    if first == 0 or first == until or words[first] != after - 1:
        return None
    at = offsets[first][0]
    if offsets[first - 1][1] != at:  # a gap (trimmed offsets): no clean place to cut
        return None
    return _Cut(first, until, at)


_BATCH_FROM = 8  # `encode_plain`: fewer texts than this are encoded one call each


def encode_plain(
    backend: tokenizers.Tokenizer, texts: Sequence[str], add_special_tokens: bool = False
) -> list[tuple[int, ...]]:
    """Each text's ids (without special tokens unless asked). From `_BATCH_FROM` texts on, in one batch
    call, which the library spreads over the host's cores (and which skips the offsets nothing here
    reads)."""
    if len(texts) < _BATCH_FROM:
        return [tuple(backend.encode(t, add_special_tokens=add_special_tokens).ids) for t in texts]
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers >= 0.21
    return [tuple(e.ids) for e in batch(list(texts), add_special_tokens=add_special_tokens)]
