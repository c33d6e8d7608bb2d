"""A model's tokenizer: `tokenizers` for the text <-> ids work, the model's configs for the special tokens.

Loads a Hugging Face folder (tokenizer.json, tokenizer_config.json, generation_config.json, config.json)
and encodes as `transformers.AutoTokenizer` (v5) does: tokenizer.json's post-processor decides which
special tokens are added. Two deliberate differences: a tokenizer.json without a post-processor takes
`add_bos_token`/`add_eos_token` from the config (transformers would add nothing), and a text that already
starts with the BOS token does not get a second one.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from mlxq.worker.engine.text.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate, ChatTemplateError
from mlxq.worker.engine.text.shared_encoding import SharedPrefixEncoder, encode_plain

# `Tokenizer.encode_short`: texts up to this long are remembered, this many at most (least recent out).
# The repeats it serves are near each other (one job's rows, or a batch's: 64 rows x 8 candidates is
# 512 texts), and a worker lives for days: a full memory is ~0.5 KiB a text here, 10 KiB at worst.
_SHORT_CHARS = 256
_SHORT_TEXTS = 1024

log = logging.getLogger(__name__)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as configs write it: a string or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens (`bos_token`, `eos_token`, ...) a tokenizer config sets, as strings."""
    return {
        name: tok for name in SPECIAL_TOKEN_NAMES if (tok := _token_content(config.get(name))) is not None
    }


def _ids(value: Any) -> list[int]:
    """`eos_token_id` as configs write it: an int, a list of ints, or absent."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in vocab strings."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shifted
            shifted += 1
    return {chr(c): b for b, c in chars.items()}


def _is_byte_level(decoder: Any) -> bool:
    """True when the decoder is ByteLevel alone, so each token stands for fixed bytes."""
    if decoder is None:
        return False
    spec = json.loads(decoder.__getstate__())
    if spec.get("type") == "Sequence":
        return bool(spec["decoders"]) and all(d.get("type") == "ByteLevel" for d in spec["decoders"])
    return bool(spec.get("type") == "ByteLevel")


class Tokenizer:
    """Encode, decode, special tokens and chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any],
        extra_eos_ids: Iterable[int] = (),
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens_of(config)
        self._register_special_tokens(config)
        self.bos_token = self.special_tokens.get("bos_token")
        self.bos_id: int | None = None if self.bos_token is None else backend.token_to_id(self.bos_token)
        eos_token = self.special_tokens.get("eos_token")
        eos_from_config = [] if eos_token is None else [backend.token_to_id(eos_token)]
        self.eos_ids: frozenset[int] = frozenset(
            i for i in [*eos_from_config, *extra_eos_ids] if i is not None
        )
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._set_post_processor(config)
        self.shared_encoder = SharedPrefixEncoder(backend)  # after the post-processor is final
        self._short: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # `encode_short`'s memory
        self.chat_template = chat_template
        self.byte_level = _is_byte_level(backend.decoder)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the model folder `path` (Hugging Face layout)."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}: the model folder needs a fast (tokenizers) tokenizer file"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        # special_tokens_map.json is the legacy home of the special tokens; tokenizer_config.json wins.
        config = {
            **_read_json(folder / "special_tokens_map.json"),
            **_read_json(folder / "tokenizer_config.json"),
        }
        eos = _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        eos += _ids(_read_json(folder / "config.json").get("eos_token_id"))
        template = ChatTemplate.from_dir(folder, config, special_tokens_of(config))
        tok = cls(backend, config, eos, template)
        log.debug(
            "tokenizer loaded path=%s vocab=%d eos=%s bos=%s",
            folder,
            tok.vocab_size,
            sorted(tok.eos_ids),
            tok.bos_id,
        )
        return tok

    def _register_special_tokens(self, config: Mapping[str, Any]) -> None:
        # As transformers does: named special tokens and config entries marked special become special added
        # tokens of the backend, so encoding keeps them whole and `skip_special_tokens` drops them.
        marked = config.get("added_tokens_decoder") or {}
        contents = [c for entry in marked.values() if entry.get("special") and (c := _token_content(entry))]
        contents += list(self.special_tokens.values())
        known = {tok.content for tok in self.backend.get_added_tokens_decoder().values() if tok.special}
        missing = [c for c in dict.fromkeys(contents) if c not in known]
        if missing:
            self.backend.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in missing])

    def _set_post_processor(self, config: Mapping[str, Any]) -> None:
        # transformers 5 ignores add_bos_token/add_eos_token when tokenizer.json exists: its post-processor
        # decides. Only a tokenizer.json without one (as converters write) takes the flags from the config.
        if self.backend.post_processor is not None:
            return
        add_bos = bool(config.get("add_bos_token")) and self.bos_id is not None
        eos_token = self.special_tokens.get("eos_token")
        eos_id = None if eos_token is None else self.backend.token_to_id(eos_token)
        add_eos = bool(config.get("add_eos_token")) and eos_id is not None
        if not (add_bos or add_eos):
            return
        bos, eos = [f"{self.bos_token}:0"] * add_bos, [f"{eos_token}:0"] * add_eos
        pair = [*bos, "$A:0", *eos, *[f"{self.bos_token}:1"] * add_bos, "$B:1", *[f"{eos_token}:1"] * add_eos]
        special = [(self.bos_token, self.bos_id)] * add_bos + [(eos_token, eos_id)] * add_eos
        self.backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*bos, "$A:0", *eos]), pair=" ".join(pair), special_tokens=special
        )

    def clone(self) -> Tokenizer:
        """A tokenizer that encodes and decodes as this one, sharing no mutable state with it: for another
        thread. The backend's special-token switch (`_encode_split`), the shared-prefix encoder's recent
        encodings and `encode_short`'s memory are per instance, and one thread flipping or filling them
        under another changes what the other encodes; the clone has its own backend (rebuilt from this
        one's serialized form, added tokens and post-processor included) and its own memories. Clone on
        the thread that owns this one: serializing reads the backend."""
        twin = copy.copy(self)
        twin.backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        twin.backend.encode_special_tokens = False
        twin.shared_encoder = SharedPrefixEncoder(
            twin.backend, self.shared_encoder.min_shared_chars, self.shared_encoder.keep
        )
        twin._short = OrderedDict()
        return twin

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return self.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True, split_special: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model's config asks.

        With `split_special` the text of a special token inside `text` is encoded as ordinary text,
        never as that control token (transformers' `split_special_tokens=True`): for untrusted text.
        The BOS/EOS the post-processor adds stay control tokens.
        Unlike transformers, a text that already starts with the BOS token does not get a second one.
        A long text starting like one encoded just before is encoded only from where they part
        (`shared_encoding.py`): the same ids, in a fraction of the time.
        """
        return self.encode_many([text], [add_special_tokens], [split_special])[0]

    def encode_many(
        self,
        texts: Sequence[str],
        add_special_tokens: Sequence[bool],
        split_special: Sequence[bool] | None = None,
    ) -> list[list[int]]:
        """`encode` of each text (with its own `add_special_tokens` and `split_special`); the
        shared-prefix encoder's re-encoded parts go to the tokenizer in one batch call. A text to split
        that holds no special token's text encodes the same either way, so only those that do take
        the slower path of their own."""
        split = split_special or [False] * len(texts)
        guarded = {
            k for k, (t, s) in enumerate(zip(texts, split, strict=True)) if s and self.has_special_text(t)
        }
        plain = [k for k in range(len(texts)) if k not in guarded]
        ids = self.shared_encoder.encode_many(
            [texts[k] for k in plain], [add_special_tokens[k] for k in plain]
        )
        out: list[list[int]] = [[] for _ in texts]
        for k, got in zip(plain, ids, strict=True):
            out[k] = self._drop_double_bos(texts[k], got, add_special_tokens[k])
        for k in guarded:
            out[k] = self._encode_split(texts[k], add_special_tokens[k])
        return out

    def _encode_split(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of `text` with special tokens' text split into ordinary tokens (what the post-processor
        adds with `add_special_tokens` stays)."""
        self.backend.encode_special_tokens = True
        try:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        finally:
            self.backend.encode_special_tokens = False

    def encode_short(self, text: str) -> list[int]:
        """`encode(text, add_special_tokens=False)`, remembered for short texts (least recently used out).

        Scoring encodes each row's prompt tail with every candidate, and rows of one job often end
        alike (an instruction, then "Answer:"): the same short texts again, each a ~30 us call.
        """
        return self.encode_short_many([text])[0]

    def encode_short_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode_short` of each text; those not remembered are encoded in one batch call.

        A score batch's prompt tails with their candidates are hundreds of short texts: one call each
        costs ~15 us of crossing into the tokenizer, one batch call for all of them about a third of
        that per text on 2 cores (the library spreads a batch over the host's cores).
        """
        out: list[list[int]] = [[] for _ in texts]
        missing: dict[str, list[int]] = {}
        for i, text in enumerate(texts):
            if len(text) > _SHORT_CHARS:
                out[i] = self.encode(text, add_special_tokens=False)
            elif (ids := self._short.get(text)) is not None:
                self._short.move_to_end(text)
                out[i] = list(ids)
            else:
                missing.setdefault(text, []).append(i)
        for text, ids in zip(missing, encode_plain(self.backend, list(missing)), strict=True):
            self._short[text] = ids
            for i in missing[text]:
                out[i] = list(ids)
        while len(self._short) > _SHORT_TEXTS:
            self._short.popitem(last=False)
        return out

    @cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special (control) token: what must never be read as one in untrusted text."""
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)

    @cached_property
    def longest_special_text(self) -> int:
        """Characters of the longest special token's text (0: none): a text's last this-many-minus-one
        characters are all that can join what follows it into one."""
        return max((len(t) for t in self.special_texts), default=0)

    @cached_property
    def _special_text_pattern(self) -> re.Pattern[str] | None:
        """One search for the text of any special token (a model may have hundreds: Llama 3 reserves
        256, and a score job's rows are looked at several times each)."""
        if not self.special_texts:
            return None
        return re.compile("|".join(re.escape(t) for t in self.special_texts))

    def has_special_text(self, text: str) -> bool:
        """Whether `text` holds the text of a special token (`<|im_start|>`, say)."""
        pattern = self._special_text_pattern
        return pattern is not None and pattern.search(text) is not None

    def encode_as_text(self, text: str) -> list[int]:
        """Ids of `text` with the text of special tokens encoded as ordinary text, never as control
        tokens (no BOS/EOS added): for untrusted text inside a prompt built around it."""
        return self._encode_split(text, add_special_tokens=False)

    def decode_many(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        """`decode` of each id sequence (special tokens kept), in one call to the backend."""
        return [
            str(t)
            for t in self.backend.decode_batch([list(ids) for ids in sequences], skip_special_tokens=False)
        ]

    def _drop_double_bos(self, text: str, ids: list[int], add_special_tokens: bool) -> list[int]:
        if (
            add_special_tokens
            and self.bos_id is not None
            and ids[:2] == [self.bos_id, self.bos_id]
            and self.bos_token is not None
            and text.startswith(self.bos_token)
        ):
            return ids[1:]
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; ids the tokenizer does not know decode to nothing."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """For byte-level tokenizers: the bytes each id stands for (index = id; unknown ids give b"")."""
        if not self.byte_level:
            raise ValueError("token_bytes exists only for byte-level (GPT-2 style) tokenizers")
        alphabet = _byte_alphabet()
        vocab: dict[str, int] = self.backend.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            try:
                table[i] = bytes(alphabet[c] for c in token)
            except KeyError:  # an added token outside the alphabet is decoded as its own UTF-8
                table[i] = token.encode("utf-8")
        return table

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template (as transformers' `tokenize=False` does)."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); send a raw `prompt` instead of `messages`"
            )
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
