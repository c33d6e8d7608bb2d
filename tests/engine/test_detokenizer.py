"""Incremental detokenization: deltas add up to `decode(all)` and never show half a character.

Byte-level BPE (the tiny ChatML tokenizer) takes the fixed-bytes path; a SentencePiece-style tokenizer
(Metaspace, byte fallback, Strip; as Llama 2 and Mistral ship) takes the window path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from mlxq.worker.engine.text.detokenizer import IncrementalDetokenizer
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.modelfiles.tiny_model import build_tokenizer

_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A quick brown fox jumps over the lazy dog while the cat sleeps.",
    "Queues hold jobs; workers take jobs from queues and write results.",
    "東京は日本の首都です。 café naïve",
]
_TEXT = st.text(
    alphabet=st.sampled_from(list("ab éxy\n東京🙂👍🏽\u0301\u200dçñ"))
    | st.characters(codec="utf-8", exclude_categories=("Cs",)),
    max_size=30,
)


def _sentencepiece_like(folder: Path, decoder: str) -> Path:
    """A BPE with Metaspace pre-tokenization and byte fallback, written as a model folder."""
    folder.mkdir(parents=True, exist_ok=True)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40, show_progress=False
    )
    tok = Backend(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.model.save(str(folder))
    vocab = json.loads((folder / "vocab.json").read_text())
    for b in range(256):  # byte tokens are ordinary vocabulary entries, as in Llama 2
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab))
    model = models.BPE.from_file(
        str(folder / "vocab.json"),
        str(folder / "merges.txt"),
        unk_token="<unk>",
        byte_fallback=True,
        fuse_unk=True,
    )
    full = Backend(model)
    full.add_special_tokens(["<unk>", "<s>", "</s>"])
    full.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    if decoder == "llama2":
        full.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        full.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    full.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("detok")
    build_tokenizer(root / "bytelevel")
    return {
        "bytelevel": Tokenizer.from_dir(root / "bytelevel"),
        "llama2": Tokenizer.from_dir(_sentencepiece_like(root / "llama2", "llama2")),
        "metaspace": Tokenizer.from_dir(_sentencepiece_like(root / "metaspace", "metaspace")),
    }


def _check(tok: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    """Stream `ids`; assert the invariants; return the deltas."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    final = tok.decode(ids, skip_special_tokens=skip)
    deltas = []
    for n, token in enumerate(ids, 1):
        deltas.append(detok.add(token))
        shown = detok.text
        # What is shown is settled: a prefix of the final text and of the text decoded so far (so a
        # U+FFFD is shown only where the full decode has one).
        assert final.startswith(shown)
        # Byte fallback's decode is not monotone (a byte run decodes all-or-nothing), so only byte-level.
        assert not tok.byte_level or tok.decode(ids[:n], skip_special_tokens=skip).startswith(shown)
    deltas.append(detok.flush())
    assert "".join(deltas) == final == detok.text
    return deltas


def test_strategies(toks: dict[str, Tokenizer]) -> None:
    assert toks["bytelevel"].byte_level
    assert not toks["llama2"].byte_level and not toks["metaspace"].byte_level


def test_emoji_split_across_tokens_is_held_back(toks: dict[str, Tokenizer]) -> None:
    tok = toks["bytelevel"]
    ids = tok.encode("ok 🚀🎉 東京")
    assert len(ids) > len("ok 🚀🎉 東京")  # some characters take several tokens
    deltas = _check(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[-1] == ""


def test_incomplete_tail_is_flushed_as_decode_shows_it(toks: dict[str, Tokenizer]) -> None:
    tok = toks["bytelevel"]
    ids = tok.encode("🚀")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in ids) == ""
    assert detok.flush() == tok.decode(ids) == "\ufffd"


@pytest.mark.parametrize("name", ["llama2", "metaspace"])
def test_leading_spaces_in_the_window_path(name: str, toks: dict[str, Tokenizer]) -> None:
    tok = toks[name]
    ids = tok.encode("The capital of 東京 is Paris 🙂 ok", add_special_tokens=False)
    deltas = _check(tok, ids)
    assert sum(d.startswith(" ") for d in deltas) >= 4  # spaces come with the word that follows them
    if name == "llama2":
        assert tok.backend.token_to_id("<0xF0>") in ids  # byte fallback really was exercised
        assert all("\ufffd" not in d for d in deltas)


def test_unknown_and_out_of_vocab_ids(toks: dict[str, Tokenizer]) -> None:
    for tok in toks.values():
        _check(tok, [tok.vocab_size + 5, *tok.encode("hi there"), tok.vocab_size + 100])


def test_the_window_stays_small(toks: dict[str, Tokenizer]) -> None:
    """O(1) per token: decoded ids per step stay bounded, whatever the length generated so far."""
    tok = toks["llama2"]
    ids = tok.encode(" ".join(_CORPUS) * 20, add_special_tokens=False)
    decoded: list[int] = []
    real = tok.decode

    class Counting:
        special_ids = tok.special_ids
        byte_level = False

        @staticmethod
        def decode(window: list[int], skip_special_tokens: bool = False) -> str:
            decoded.append(len(window))
            return real(window, skip_special_tokens)

    detok = IncrementalDetokenizer(Counting())  # type: ignore[arg-type]
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert len(ids) > 1000 and max(decoded) <= 12 and sum(decoded) < 10 * len(ids)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_ids_byte_level(toks: dict[str, Tokenizer], data: st.DataObject, skip: bool) -> None:
    tok = toks["bytelevel"]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size + 3), max_size=40))
    _check(tok, ids, skip)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(_TEXT, min_size=1, max_size=3), specials=st.lists(st.sampled_from([0, 1, 2]), max_size=2)
)
def test_encoded_unicode_byte_level(
    toks: dict[str, Tokenizer], texts: list[str], specials: list[int]
) -> None:
    tok = toks["bytelevel"]
    ids: list[int] = []
    for text, special in zip(texts, [*specials, *[None] * len(texts)], strict=False):
        ids += tok.encode(text) + ([] if special is None else [special])
    deltas = _check(tok, ids)
    # Valid text never shows a replacement character that it does not contain itself.
    assert "".join(deltas).count("\ufffd") == sum(t.count("\ufffd") for t in texts)
    _check(tok, ids, skip=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(_TEXT, min_size=1, max_size=3), name=st.sampled_from(["llama2", "metaspace"]))
def test_encoded_unicode_window(toks: dict[str, Tokenizer], texts: list[str], name: str) -> None:
    tok = toks[name]
    ids: list[int] = []
    for text in texts:
        ids += tok.encode(text, add_special_tokens=False) + [tok.backend.token_to_id("</s>")]
    _check(tok, ids)
    _check(tok, ids, skip=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), name=st.sampled_from(["llama2", "metaspace"]), skip=st.booleans())
def test_random_ids_window(toks: dict[str, Tokenizer], data: st.DataObject, name: str, skip: bool) -> None:
    tok = toks[name]
    # Random byte tokens under ByteFallback can form invalid runs: see the test below.
    ids = [i for i in range(tok.vocab_size + 3) if name == "metaspace" or not _is_byte_token(tok, i)]
    _check(tok, data.draw(st.lists(st.sampled_from(ids), max_size=30)), skip)


def _is_byte_token(tok: Tokenizer, token_id: int) -> bool:
    return (tok.backend.id_to_token(token_id) or "").startswith("<0x")


def test_invalid_byte_run_under_byte_fallback_is_the_known_difference(toks: dict[str, Tokenizer]) -> None:
    """ByteFallback shows a whole run of byte tokens as U+FFFD once any byte in it is invalid. A
    streamed byte cannot be taken back, so the valid character before the bad byte stays shown."""
    tok = toks["llama2"]
    ids = [tok.backend.token_to_id(t) for t in ("<0x2A>", "<0xEC>")]  # "*", then half a character
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["*", ""]
    assert detok.flush() == "\ufffd"
    assert tok.decode(ids) == "\ufffd\ufffd"
