"""Rebuild a Hugging Face `tokenizer.json` + `tokenizer_config.json` from a GGUF file's metadata.

Two kinds of vocabulary are handled:
- GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`). The pre-tokenizer is chosen by
  `tokenizer.ggml.pre`, the name llama.cpp's converter writes for each known tokenizer family; each
  family is written the way Hugging Face ships it so ids match the original tokenizer.
- SentencePiece BPE (`"llama"`: Llama 1/2, Mistral, Gemma, ...): the pieces with their scores, `▁` for
  a space, `<0xXX>` byte pieces for what no piece covers. SentencePiece merges the adjacent pair whose
  joined piece scores highest; a BPE whose merges are every split of every piece into two pieces,
  ranked by the joined piece's score, merges the same pairs in the same order (how Hugging Face converts
  these models too). The space SentencePiece puts before the text (`add_space_prefix`, on unless the
  GGUF says otherwise) is a normalizer here, and the decoder takes it off again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

if TYPE_CHECKING:
    from gguf import GGUFReader

# llama.cpp's token types (gguf.TokenType): control and user-defined tokens become added tokens (and a
# SentencePiece vocabulary's unknown piece, special as Hugging Face's `<unk>` is); byte pieces stay in
# the model, for its byte fallback.
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4
_BYTE = 6
_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _gpt2_single_digits() -> pre_tokenizers.PreTokenizer:
    # StarCoder/SmolLM split every digit on its own before the GPT-2 regex (llama.cpp: "\p{N}" first).
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def _llama3() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "phi-2", "roberta-bpe"), _gpt2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r"), _gpt2_single_digits),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"), _llama3),
}
# Llama 3's tokenizer.json looks a whole pre-token up in the vocabulary before merging.
_IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3"))


class UnsupportedTokenizer(ValueError):
    """The GGUF's tokenizer is not one this module can rebuild; the message names what it found."""


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer part of a GGUF's metadata (`tokenizer.ggml.*` and `tokenizer.chat_template`)."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    extra_eos_ids: tuple[int, ...] = ()
    scores: list[float] | None = None  # a SentencePiece vocabulary's piece scores
    add_space_prefix: bool = True  # SentencePiece: a space before the text, as its normalizer adds

    def token(self, token_id: int | None) -> str | None:
        """The token string for an id, or None for a missing or out-of-range id."""
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A GGUF metadata value as a Python value (str, number, bool or list), or `default` if absent."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def read_vocab(reader: GGUFReader) -> GGUFVocab:
    """Read the tokenizer metadata of an open GGUF file."""
    tokens = metadata_value(reader, "tokenizer.ggml.tokens", [])
    eos_id = metadata_value(reader, "tokenizer.ggml.eos_token_id")
    extra = [metadata_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return GGUFVocab(
        model=metadata_value(reader, "tokenizer.ggml.model", ""),
        pre=metadata_value(reader, "tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=metadata_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
        merges=metadata_value(reader, "tokenizer.ggml.merges", []),
        bos_id=metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=eos_id,
        unk_id=metadata_value(reader, "tokenizer.ggml.unknown_token_id"),
        pad_id=metadata_value(reader, "tokenizer.ggml.padding_token_id"),
        add_bos=bool(metadata_value(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(metadata_value(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata_value(reader, "tokenizer.chat_template"),
        extra_eos_ids=tuple(i for i in extra if i is not None and i != eos_id),
        scores=metadata_value(reader, "tokenizer.ggml.scores"),
        add_space_prefix=bool(metadata_value(reader, "tokenizer.ggml.add_space_prefix", True)),
    )


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """Build a `tokenizers.Tokenizer` whose ids equal the GGUF's token ids."""
    if vocab.model == "llama":
        return _sentencepiece(vocab)
    if vocab.model != "gpt2":
        raise UnsupportedTokenizer(
            f"tokenizer.ggml.model={vocab.model!r}: only 'gpt2' (byte-level BPE) and 'llama' "
            "(SentencePiece BPE) are supported"
        )
    pre = vocab.pre or "default"
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"tokenizer.ggml.pre={pre!r} is not supported; supported: {sorted(_PRE_TOKENIZERS)}"
        )
    ids: dict[str, int] = {}
    for i, token in enumerate(vocab.tokens):
        ids.setdefault(token, i)  # a repeated string keeps its first id, as llama.cpp's token_to_id does
    merges = [_split_merge(m) for m in vocab.merges]
    bpe = models.BPE(vocab=ids, merges=merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(vocab)
    added = [
        AddedToken(t, special=kind == _CONTROL, normalized=False)
        for t, kind in zip(vocab.tokens, vocab.token_types, strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)
    return tok


def _sentencepiece(vocab: GGUFVocab) -> Tokenizer:
    """A SentencePiece BPE vocabulary as a BPE with byte fallback (see the module docstring)."""
    if vocab.scores is None or len(vocab.scores) != len(vocab.tokens):
        raise UnsupportedTokenizer(
            "a SentencePiece vocabulary (tokenizer.ggml.model='llama') needs tokenizer.ggml.scores, "
            "one per token"
        )
    if vocab.unk_id is None or vocab.token(vocab.unk_id) is None:
        raise UnsupportedTokenizer("a SentencePiece vocabulary needs tokenizer.ggml.unknown_token_id")
    ids: dict[str, int] = {}
    for i, token in enumerate(vocab.tokens):
        ids.setdefault(token, i)
    bpe = models.BPE(
        vocab=ids,
        merges=_merges_by_score(vocab, ids),
        unk_token=vocab.token(vocab.unk_id),
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    spaces: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPACE)]
    if vocab.add_space_prefix:
        spaces.insert(0, normalizers.Prepend(_SPACE))
    tok.normalizer = normalizers.Sequence(spaces)
    steps: list[decoders.Decoder] = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    if (template := _special_tokens(vocab)) is not None:
        tok.post_processor = template
    tok.add_tokens(
        [
            AddedToken(t, special=kind in _SPECIAL_KINDS, normalized=False)
            for t, kind in zip(vocab.tokens, vocab.token_types, strict=True)
            if kind in _added_kinds(vocab)
        ]
    )
    return tok


_SPECIAL_KINDS = (_CONTROL, _UNKNOWN)


def _added_kinds(vocab: GGUFVocab) -> tuple[int, ...]:
    """The token types that are added tokens of the rebuilt tokenizer."""
    return (_CONTROL, _USER_DEFINED, _UNKNOWN) if vocab.model == "llama" else (_CONTROL, _USER_DEFINED)


def _merges_by_score(vocab: GGUFVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces of the vocabulary, the splits of higher-scoring
    pieces first (a piece's splits in the order of their parts' ids)."""
    assert vocab.scores is not None
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for i, (piece, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if kind in (_CONTROL, _USER_DEFINED, _UNKNOWN, _BYTE) or ids.get(piece) != i:
            continue
        splits = [
            (piece[:cut], piece[cut:])
            for cut in range(1, len(piece))
            if piece[:cut] in ids and piece[cut:] in ids
        ]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked.extend((-vocab.scores[i], i, n, pair) for n, pair in enumerate(splits))
    ranked.sort()
    return [pair for *_, pair in ranked]


def _split_merge(merge: str) -> tuple[str, str]:
    # Search from index 1 so a merge whose left part is itself a space still splits right (as llama.cpp).
    cut = merge.find(" ", 1)
    if cut < 0:
        raise UnsupportedTokenizer(f"malformed BPE merge {merge!r}: expected 'left right'")
    return merge[:cut], merge[cut + 1 :]


def _post_processor(vocab: GGUFVocab) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    template = _special_tokens(vocab)
    return byte_level if template is None else processors.Sequence([byte_level, template])


def _special_tokens(vocab: GGUFVocab) -> processors.PostProcessor | None:
    """The BOS/EOS the GGUF says to add around a text (None: neither)."""
    bos, eos = vocab.token(vocab.bos_id), vocab.token(vocab.eos_id)
    single, pair, specials = "$A", "$A $B:1", []
    if vocab.add_bos and bos is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos}:1 $B:1"
        specials.append((bos, vocab.bos_id))
    if vocab.add_eos and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}:1"
        specials.append((eos, vocab.eos_id))
    if not specials:
        return None
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def tokenizer_config(vocab: GGUFVocab, model_max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` transformers expects next to the `tokenizer.json`."""
    decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": kind in _SPECIAL_KINDS,
        }
        for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True))
        if kind in _added_kinds(vocab)
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.token(vocab.bos_id),
        "eos_token": vocab.token(vocab.eos_id),
        "unk_token": vocab.token(vocab.unk_id),
        "pad_token": vocab.token(vocab.pad_id),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": decoder,
    }
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return config


def write_tokenizer(tokenizer: Tokenizer, vocab: GGUFVocab, out_dir: Path, model_max_length: int) -> None:
    """Write `tokenizer.json` (from `build_tokenizer(vocab)`) and `tokenizer_config.json` into `out_dir`."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(vocab, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
