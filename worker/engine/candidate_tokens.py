"""Candidate rows' text as tokens: each row's prompt tokens and the one ordinary token each of its
candidates adds (`candidate_token_ids`), or the row's `InvalidCandidate` error. Only a prompt's tail is
re-encoded with each candidate (`TAIL_TOKENS`), and all rows go to the tokenizer together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxq.jobs.errors import InvalidCandidate
from mlxq.worker.engine.text.tokenizer import Tokenizer

TAIL_TOKENS = 16  # prompt tokens re-encoded with each candidate (see `candidate_token_ids`)


@dataclass(frozen=True)
class RowText:
    """A score row as text: `index` is its number in its own job (for error messages); with
    `split_special` the text of a special token in its prompt or candidates is encoded as ordinary text
    (`Tokenizer.encode`)."""

    prompt: str
    candidates: Sequence[str]
    index: int
    add_special_tokens: bool = True
    split_special: bool = False


RowTokens = tuple[list[int], list[int]]  # prompt tokens, and the one token each candidate adds


def candidate_token_ids(tokenizer: Tokenizer, rows: Sequence[RowText]) -> list[RowTokens | InvalidCandidate]:
    """Per row, its prompt tokens and the one ordinary token each candidate appends, or the row's
    `InvalidCandidate` error (rows of several jobs go together; each job decides what a bad row does).

    Re-encoding a long prompt once per candidate dominated scoring time, so only the prompt's last
    `TAIL_TOKENS` tokens are re-encoded with each candidate when that tail encodes to the same ids on
    its own (checked once per row); otherwise prompt+candidate is encoded whole. The tails, and then
    the tails with their candidates, of all rows go to the tokenizer in one batch call each. A row
    whose special-token text is to be split and that holds some (`_guarded`) is encoded whole, split.
    """
    bases = tokenizer.encode_many(
        [r.prompt for r in rows], [r.add_special_tokens for r in rows], [r.split_special for r in rows]
    )
    guarded = {i for i, row in enumerate(rows) if _guarded(tokenizer, row)}
    tails = _tails(tokenizer, rows, bases, guarded)
    encoded = tokenizer.encode_short_many([t + c for i, t in tails.items() for c in rows[i].candidates])
    # The other rows' prompt+candidate texts, encoded whole: all rows' in one call (not one per candidate).
    whole = [i for i in range(len(rows)) if i not in tails]
    encoded_whole = tokenizer.encode_many(
        [rows[i].prompt + c for i in whole for c in rows[i].candidates],
        [rows[i].add_special_tokens for i in whole for _ in rows[i].candidates],
        [rows[i].split_special for i in whole for _ in rows[i].candidates],
    )
    with_candidates: dict[int, list[list[int]]] = {}
    at = 0
    for i in tails:
        with_candidates[i] = encoded[at : at + len(rows[i].candidates)]
        at += len(rows[i].candidates)
    whole_ids: dict[int, list[list[int]]] = {}
    at = 0
    for i in whole:
        whole_ids[i] = encoded_whole[at : at + len(rows[i].candidates)]
        at += len(rows[i].candidates)
    return [
        _row_tokens(tokenizer, row, base, with_candidates.get(i), whole_ids.get(i, []))
        for i, (row, base) in enumerate(zip(rows, bases, strict=True))
    ]


def _guarded(tokenizer: Tokenizer, row: RowText) -> bool:
    """Whether `row` splits special-token text and holds some: in its prompt, in a candidate, or across
    the two (the prompt's last characters and a candidate's first)."""
    if not row.split_special:
        return False
    end = row.prompt[max(0, len(row.prompt) - tokenizer.longest_special_text + 1) :]
    return tokenizer.has_special_text(row.prompt) or any(
        tokenizer.has_special_text(end + c) for c in row.candidates
    )


def _tails(
    tokenizer: Tokenizer, rows: Sequence[RowText], bases: list[list[int]], guarded: set[int]
) -> dict[int, str]:
    """By row, the text of its prompt's last `TAIL_TOKENS` tokens where that text ends the prompt and
    encodes back to those same ids on its own (tokenizers that add a prefix space, for example, fail
    the check); rows without one, and `guarded` rows, are not in it."""
    long = [i for i, base in enumerate(bases) if len(base) > TAIL_TOKENS and i not in guarded]
    texts = tokenizer.decode_many([bases[i][-TAIL_TOKENS:] for i in long])
    ends = [(i, t) for i, t in zip(long, texts, strict=True) if rows[i].prompt.endswith(t)]
    ids = tokenizer.encode_short_many([t for _, t in ends])
    return {i: text for (i, text), got in zip(ends, ids, strict=True) if got == bases[i][-TAIL_TOKENS:]}


def _row_tokens(
    tokenizer: Tokenizer,
    row: RowText,
    base: list[int],
    tails: list[list[int]] | None,
    whole: list[list[int]],
) -> RowTokens | InvalidCandidate:
    """The row's prompt tokens and each candidate's one token, from its prompt's tail re-encoded with
    each candidate (`tails`) or else from prompt+candidate encoded whole (`whole`)."""
    if not base:
        return InvalidCandidate(f"row {row.index}: the prompt is empty (it encodes to no tokens)")
    for cand in row.candidates:
        if row.split_special and tokenizer.has_special_text(cand):
            return InvalidCandidate(
                f"row {row.index}: candidate {cand!r} holds a special token's text; a candidate adds "
                "exactly one ordinary token"
            )
    # Per candidate: (tokens of prompt+candidate, whether the prompt's own tokens are kept, last id).
    if tails is not None:
        shape = [
            (len(base) - TAIL_TOKENS + len(ids), ids[:TAIL_TOKENS] == base[-TAIL_TOKENS:], ids[-1])
            for ids in tails
        ]
    else:
        shape = [(len(ids), ids[: len(base)] == base, ids[-1] if ids else -1) for ids in whole]
    out = []
    for cand, (n, kept, last) in zip(row.candidates, shape, strict=True):
        if n != len(base) + 1 or not kept:
            return InvalidCandidate(
                f"row {row.index}: candidate {cand!r} does not add exactly one token to the prompt "
                f"(the prompt is {len(base)} tokens, prompt+candidate is {n}"
                + ("" if kept else ", and the prompt's own tokens change")
                + ")"
            )
        if last in tokenizer.special_ids:
            return InvalidCandidate(f"row {row.index}: candidate {cand!r} is a special token (id {last})")
        out.append(last)
    return base, out
