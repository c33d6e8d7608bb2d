"""Encoding a text from where it parts from a recent one gives exactly the text's own encoding."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from mlxq.worker.engine.text.shared_encoding import SharedPrefixEncoder, reusable
from mlxq.worker.modelfiles.tiny_model import build_tokenizer

# Llama 3's pre-tokenizer regex (as its tokenizer.json writes it).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The queue holds 12345 jobs; workers take them.\n\nIt's   done, isn't it?",
    "def add(a, b):\n    return a + b  # 3.14159",
    "東京 café 🙂 naïve — résumé, 'quoted' and \"double\"",
]
PIECES = st.sampled_from(
    ["the", " queue", "  ", "\n", "\n\n", "\t", "123", "4567", "'s", "'ll", "!!", "...", "é", "🙂", "東京",
     "<|im_end|>", " ", "a", "word", "—", "x1", " 99", "\r\n"]
)  # fmt: skip


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("byte-level")
    build_tokenizer(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _llama3_style(eos: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|begin_of_text|>", "<|eot_id|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 8, trainer=trainer)
    ends = " <|eot_id|>:0" if eos else ""
    tok.post_processor = processors.TemplateProcessing(
        single=f"<|begin_of_text|>:0 $A:0{ends}",
        pair="<|begin_of_text|>:0 $A:0 $B:1",
        special_tokens=[("<|begin_of_text|>", 0), ("<|eot_id|>", 1)],
    )
    return tok


@pytest.fixture(scope="module")
def llama3_style() -> Tokenizer:
    return _llama3_style(eos=False)


@pytest.fixture(scope="module")
def with_eos() -> Tokenizer:
    return _llama3_style(eos=True)


def _text(pieces: list[str]) -> str:
    return "".join(pieces)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    base=st.lists(PIECES, min_size=500, max_size=700),
    tails=st.lists(st.tuples(st.integers(0, 60), st.lists(PIECES, max_size=30)), min_size=1, max_size=4),
    special=st.booleans(),
    which=st.sampled_from(["byte_level", "llama3_style", "with_eos"]),
)
def test_every_text_encodes_to_its_own_ids(
    base: list[str],
    tails: list[tuple[int, list[str]]],
    special: bool,
    which: str,
    request: pytest.FixtureRequest,
) -> None:
    backend: Tokenizer = request.getfixturevalue(which)
    encoder = SharedPrefixEncoder(backend, min_shared_chars=256)
    assert encoder.enabled
    texts = [_text(base)] + [_text(base[: len(base) - drop] + tail) for drop, tail in tails]
    for text in texts:
        assert encoder.encode(text, special) == backend.encode(text, add_special_tokens=special).ids
    # In one call (the parts after the cuts in one batch call from 8 of them), flags mixed.
    many = SharedPrefixEncoder(backend, min_shared_chars=256)
    flags = [special, not special, special] * len(texts)
    got = many.encode_many(texts * 3, flags)
    assert got == [backend.encode(t, add_special_tokens=f).ids for t, f in zip(texts * 3, flags, strict=True)]


def test_rows_sharing_a_long_document_are_encoded_in_part(llama3_style: Tokenizer) -> None:
    document = " ".join(CORPUS) * 40
    encoder = SharedPrefixEncoder(llama3_style)
    rows = [f"{document}\nQuestion {i}: which is it? Answer:" for i in range(20)]
    for text in rows:
        assert encoder.encode(text, True) == llama3_style.encode(text).ids
    assert encoder.reused == 19  # every row after the first
    together = SharedPrefixEncoder(llama3_style)
    assert together.encode_many(rows, [True] * 20) == [llama3_style.encode(t).ids for t in rows]
    assert together.reused == 19  # the first row encoded whole, the others' ends in one batch call


def test_short_texts_and_unsuitable_tokenizers_are_encoded_whole(tmp_path: Path) -> None:
    meta = Tokenizer(models.BPE())
    meta.pre_tokenizer = pre_tokenizers.Metaspace()
    assert not reusable(meta)
    prefixed = Tokenizer(models.BPE())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not reusable(prefixed)
    whole = Tokenizer(models.BPE())  # byte-level without its regex, nothing else: the whole text is one word
    whole.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    assert not reusable(whole)
    lowercase = Tokenizer(models.BPE())
    lowercase.normalizer = normalizers.Lowercase()
    lowercase.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert not reusable(lowercase)
    build_tokenizer(tmp_path)
    backend = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    encoder = SharedPrefixEncoder(backend, min_shared_chars=1024)
    short = "the queue holds jobs " * 10
    for text in (short, short + "and more"):
        assert encoder.encode(text, True) == backend.encode(text).ids
    assert encoder.reused == 0


def test_the_real_smollm2_tokenizer_gives_its_own_ids(tmp_path: Path) -> None:
    """SmolLM2's tokenizer (digits split one by one, then GPT-2's regex), as the worker builds it from the
    GGUF file the default model ships in: random texts sharing long starts encode to their own ids."""
    import random

    from gguf import GGUFReader

    from mlxq.worker.modelfiles.default_model import default_gguf_path
    from mlxq.worker.modelfiles.gguf_tokenizer import build_tokenizer as from_gguf
    from mlxq.worker.modelfiles.gguf_tokenizer import read_vocab

    backend = from_gguf(read_vocab(GGUFReader(default_gguf_path())))
    encoder = SharedPrefixEncoder(backend, min_shared_chars=256)
    assert encoder.enabled
    pieces = [*CORPUS, "12345", " 3.14", "\n\n", "  ", "é", "🙂", "<|im_start|>", "<|im_end|>", " word", "!?"]
    rng = random.Random(7)
    checked = 0
    for _ in range(40):
        base = [rng.choice(pieces) for _ in range(120)]
        for cut in (0, 3, 10, 30):
            text = "".join(base[: len(base) - cut] + [rng.choice(pieces) for _ in range(rng.randint(0, 8))])
            for special in (True, False):
                assert encoder.encode(text, special) == backend.encode(text, add_special_tokens=special).ids
                checked += 1
    assert encoder.reused > checked // 2
