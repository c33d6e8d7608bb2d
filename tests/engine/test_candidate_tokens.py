"""Scoring's candidate token ids, worked out for many rows at once (prompt tails re-encoded with each
candidate, in batch calls to the tokenizer), equal encoding each prompt+candidate whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxq.jobs.errors import InvalidCandidate
from mlxq.worker.engine.candidate_tokens import TAIL_TOKENS, RowText, _guarded, _tails, candidate_token_ids
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

LONG = "Read the passage, then answer with one letter. The passage: queues hold jobs and workers take them. "


def _prefix_space(folder: Path) -> Path:
    """The tiny tokenizer with a prefix space added to every text: a prompt's tail encodes otherwise
    on its own than inside the prompt, so scoring falls back to encoding prompt+candidate whole."""
    write_random_checkpoint(folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = True
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture(scope="module", params=["byte-level", "prefix-space"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "prefix-space":
        return Tokenizer.from_dir(_prefix_space(folder))
    return Tokenizer.from_dir(write_random_checkpoint(folder))


def _whole(tok: Tokenizer, row: RowText) -> tuple[list[int], list[int]] | str:
    base = tok.encode(row.prompt, add_special_tokens=row.add_special_tokens)
    if not base:
        return "bad"
    out = []
    for c in row.candidates:
        ids = tok.encode(row.prompt + c, add_special_tokens=row.add_special_tokens)
        if len(ids) != len(base) + 1 or ids[: len(base)] != base or ids[-1] in tok.special_ids:
            return "bad"
        out.append(ids[-1])
    return base, out


def test_rows_together_give_what_each_prompt_and_candidate_encode_to(tok: Tokenizer) -> None:
    prompts = [LONG + f"Question {i}: which is it? Answer:" for i in range(6)]
    prompts += ["Answer:", "", LONG + "The end.\n", "<|im_start|>user\nPick one<|im_end|>\nAnswer:"]
    words = [
        w for w in [" the", " a", " of", " and", " to", " is", " in", " it"] if len(tok.encode_short(w)) == 1
    ]
    candidates = [words[:3], [" Paris"], ["<|im_end|>"], words[3:5], words[:1]]
    rows = [
        RowText(p, candidates[i % len(candidates)], i, add_special_tokens=i % 3 != 0)
        for i, p in enumerate(prompts)
    ]
    got = candidate_token_ids(tok, rows)
    want = [_whole(tok, row) for row in rows]
    for row, g, w in zip(rows, got, want, strict=True):
        if w == "bad":
            assert isinstance(g, InvalidCandidate) and str(g).startswith(f"row {row.index}: "), (row, g)
        else:
            assert g == w, row
    assert "bad" in want and sum(w != "bad" for w in want) >= 4  # both kinds of rows were met
    # The byte-level tokenizer takes the tails' path for long prompts; the prefix space, never.
    bases = [tok.encode(r.prompt, add_special_tokens=r.add_special_tokens) for r in rows]
    long = {i for i, b in enumerate(bases) if len(b) > TAIL_TOKENS}
    assert len(long) >= 6
    assert set(_tails(tok, rows, bases, set())) == (
        long if tok.backend.pre_tokenizer.add_prefix_space is False else set()
    )


def test_rows_that_split_special_tokens_encode_their_text_as_text(tok: Tokenizer) -> None:
    """A row's special-token text (in its prompt, a candidate, or across the two) is ordinary text
    unless the row allows special tokens; other rows take the tails' path as before."""
    start = tok.backend.token_to_id("<|im_start|>")
    prompts = [
        LONG + "<|im_start|>system\nobey<|im_end|>\nAnswer:",
        LONG + "Question: which? Answer:<|im_",
        LONG + "Question: which? Answer:",
    ]
    candidates = [[" the", " a"], ["end|>"], ["<|im_end|>", " the"]]
    rows = [
        RowText(p, c, i, split_special=True) for i, (p, c) in enumerate(zip(prompts, candidates, strict=True))
    ]
    got = candidate_token_ids(tok, rows)
    first = got[0]
    assert not isinstance(first, InvalidCandidate)
    assert start not in first[0]
    assert first[0] == tok.encode(prompts[0], split_special=True) != tok.encode(prompts[0])
    for i in (1, 2):  # special text across prompt and candidate, or in a candidate: more than one token
        assert isinstance(got[i], InvalidCandidate), got[i]
    allowed = candidate_token_ids(tok, [RowText(prompts[0], candidates[0], 0)])[0]
    assert not isinstance(allowed, InvalidCandidate) and start in allowed[0]
    bases = [tok.encode(r.prompt, split_special=True) for r in rows]
    guarded = {i for i, r in enumerate(rows) if _guarded(tok, r)}
    assert guarded == {0, 1, 2}
    assert not _guarded(tok, RowText(prompts[2], [" the"], 0, split_special=True))
    assert set(_tails(tok, rows, bases, guarded)) == set()
