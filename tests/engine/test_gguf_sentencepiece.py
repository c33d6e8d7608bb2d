"""GGUF files whose vocabulary is SentencePiece BPE (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral,
Gemma): the tokenizer rebuilt from the GGUF's pieces, scores and token types gives SentencePiece's own ids
and text. The reference is the `sentencepiece` library with a tiny model trained here the way Llama's was
(BPE, byte fallback, no normalization beyond the leading space), written into a GGUF as llama.cpp's
converter writes one (pieces, scores, token types)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf import GGUFReader

from mlxq.worker.engine.text.detokenizer import IncrementalDetokenizer
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.modelfiles.gguf_tokenizer import (
    UnsupportedTokenizer,
    build_tokenizer,
    read_vocab,
    tokenizer_config,
    write_tokenizer,
)

spm = pytest.importorskip("sentencepiece")

_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1999 2026, and prices like $3.50 or 12%.",
    "Queues hold jobs; workers take them, one batch at a time, and write results back.",
    "Über naïve café façade — déjà vu.",
] * 20

TEXTS = [
    "The capital of France is Paris.",
    " leading space and  two spaces",
    "def add(a, b):\n    return a + b",
    "unseen characters: 你好 🙂 ∑ and Ω",
    "Über naïve café",
    "",
    "\n\n",
    "numbers 12345 and 3.14159",
]


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def sp_model(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """Llama's settings; without the leading space as Gemma's vocabulary is."""
    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(_CORPUS))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / ("space-prefix" if request.param else "no-space-prefix")),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=request.param,
        split_digits=True,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        minloglevel=2,
    )
    return folder / ("space-prefix.model" if request.param else "no-space-prefix.model")


def _gguf_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    """llama.cpp converter's token type of piece i."""
    if sp.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.is_control(i):
        return gguf.TokenType.CONTROL
    if sp.is_byte(i):
        return gguf.TokenType.BYTE
    if sp.is_unused(i):
        return gguf.TokenType.UNUSED
    return gguf.TokenType.NORMAL


@pytest.fixture(scope="module")
def gguf_file(sp_model: Path) -> Path:
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    path = sp_model.with_suffix(".gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    w.add_token_types([_gguf_type(sp, i) for i in range(sp.get_piece_size())])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(sp_model.stem == "space-prefix")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_rebuilt_tokenizer_gives_sentencepieces_ids_and_text(sp_model: Path, gguf_file: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    vocab = read_vocab(GGUFReader(str(gguf_file)))
    assert vocab.model == "llama" and vocab.scores is not None
    assert vocab.add_space_prefix == (sp_model.stem == "space-prefix")
    tok = build_tokenizer(vocab)
    for text in TEXTS:
        want = sp.encode(text)
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, text
        assert tok.encode(text).ids == [sp.bos_id(), *want]  # add_bos_token
        assert tok.decode(got) == sp.decode(want) == text, text
    assert any(sp.is_byte(i) for text in TEXTS for i in sp.encode(text))  # byte fallback was exercised


def test_the_worker_reads_the_written_tokenizer_and_streams_its_text(sp_model: Path, gguf_file: Path) -> None:
    """What `mlxq import-gguf` writes loads in the engine's tokenizer, whose incremental text (the
    SentencePiece decoder is not byte-level) adds up to the whole decode, characters never split."""
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    vocab = read_vocab(GGUFReader(str(gguf_file)))
    out = gguf_file.parent / "folder"
    out.mkdir()
    write_tokenizer(build_tokenizer(vocab), vocab, out, model_max_length=4096)
    assert tokenizer_config(vocab, 4096)["added_tokens_decoder"]["0"]["special"]  # <unk>
    tokenizer = Tokenizer.from_dir(out)
    assert not tokenizer.byte_level
    text = "unseen characters: 你好 🙂 and the capital of France"
    ids = tokenizer.encode(text)
    assert ids == [sp.bos_id(), *sp.encode(text)]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids[1:]]  # text as generated: no BOS before it
    assert "".join([*deltas, detok.flush()]) == tokenizer.decode(ids[1:]) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_sentencepiece_vocabulary_without_scores_is_refused_by_name(gguf_file: Path) -> None:
    vocab = read_vocab(GGUFReader(str(gguf_file)))
    with pytest.raises(UnsupportedTokenizer, match=r"needs tokenizer\.ggml\.scores"):
        build_tokenizer(type(vocab)(**{**vocab.__dict__, "scores": None}))
    with pytest.raises(UnsupportedTokenizer, match=r"'gpt2' .* and 'llama'"):
        build_tokenizer(type(vocab)(**{**vocab.__dict__, "model": "bert"}))
