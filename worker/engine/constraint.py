"""Structured output: a request's `response_format` compiled to a token-level constraint.

Owns the one place mlxq touches the constrained-decoding library (llguidance, the `structured`
extra): `ConstraintCompiler` builds the library's tokenizer from the model's own `tokenizer.json`
once per engine and compiles a request's JSON schema, regex or Lark grammar into a `Constraint`
(its own matcher state); `fill_mask_rows` writes the allowed-token bitmasks of a batch's constrained
rows, on the host, while the device runs a step. The sampler applies the masks (`sampler.py`); the
decode batch decides when they are computed (`generate.py`). A constraint that cannot be compiled is
the request's `InvalidRequest`, raised at admission, before any token.

A grammar that is complete allows only EOS; a constraint whose matcher stopped (complete, and the
model has no EOS the grammar may end with) says so through `stopped`, and the row ends with `stop`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxq.jobs.errors import InvalidRequest
from mlxq.jobs.schema import (
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    RegexFormat,
    ResponseFormat,
    TextFormat,
)

if TYPE_CHECKING:
    import llguidance
    import tokenizers

INSTALL_HINT = (
    "pip install llguidance, or mlxq's `structured` extra: pip install '.[structured]' in its repository"
)

# JSON is written compactly (no free whitespace between tokens): a model could otherwise spend its
# token budget on spaces and newlines the schema allows.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # an optional extra: the job says what the worker lacks
        raise InvalidRequest(
            "this worker cannot constrain output (response_format): llguidance is not installed "
            f"({INSTALL_HINT})"
        ) from e
    return llguidance


class ConstraintViolated(InvalidRequest):
    """A row's token was not one its grammar allows (it cannot go on valid)."""


class Constraint:
    """One request's position in its grammar: what it allows next, advanced one token at a time.

    A token the grammar does not allow (or a grammar that fails on the way) leaves the error in
    `error`: the row it belongs to ends with it, its batch-mates go on."""

    def __init__(self, matcher: llguidance.LLMatcher, what: str, executor: llguidance.LLExecutor) -> None:
        self.matcher = matcher
        self.what = what  # e.g. "json_schema 'person'", for messages
        self.executor = executor  # its engine's pool of mask threads (`fill_mask_rows`)
        self.error: ConstraintViolated | None = None
        self.taken = 0  # tokens taken
        self.stopped_at: int | None = None  # tokens taken when the grammar was complete

    def take(self, token: int) -> None:
        """Advance past `token` (nothing once complete or failed: the row ends with this token)."""
        if self.error is not None or self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            self.error = ConstraintViolated(
                f"token {token} does not follow the {self.what}: {self.matcher.get_error()}"
            )
            return
        self.taken += 1
        if self.matcher.is_stopped():
            self.stopped_at = self.taken

    @property
    def stopped(self) -> bool:
        """Whether the grammar allows nothing more (complete): the row must end."""
        return bool(self.matcher.is_stopped())

    def complete_after(self, n: int) -> bool:
        """Whether the grammar allowed nothing more once it took its first `n` tokens: the row ends with
        its n-th token. (After a verify step the grammar took all the step's tokens before the row
        handles them one by one, so `stopped` may already hold for the first of them.)"""
        return self.stopped_at is not None and self.stopped_at <= n

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the grammar's position, it allows one after another (0 once it
        failed or is complete); the grammar does not move."""
        if self.error is not None or self.matcher.is_stopped() or not tokens:
            return 0
        return int(self.matcher.validate_tokens(list(tokens)))


def fill_masks(constraints: Sequence[Constraint], words: int) -> np.ndarray:
    """The allowed-token bitmasks of `constraints`, one row each: (len, `words`) int32, bit t of a
    row set where its grammar allows token t."""
    out = np.full((len(constraints), words), -1, dtype=np.int32)
    fill_mask_rows(out, list(enumerate(constraints)))
    return out


def fill_mask_rows(out: np.ndarray, rows: Sequence[tuple[int, Constraint]]) -> None:
    """Write each constraint's allowed-token bitmask into its row of `out` ((batch, words) int32, C
    order): bit t of row i set where row i's grammar allows token t; a row whose grammar is complete
    or failed allows everything (it ends before its next token is used). Rows not listed are left as
    they are. Several rows are computed in parallel on the library's threads (it releases the GIL):
    on a GPU host a step of 64 rows lasts about as long as 64 masks computed one after another
    would."""
    live = [(c.matcher, i) for i, c in rows if c.error is None and not c.matcher.is_stopped()]
    for i, c in rows:
        if c.error is not None or c.matcher.is_stopped():
            out[i] = -1
    if len(live) > 1:
        executor = rows[0][1].executor
        executor.unsafe_compute_mask_ptr(live, out.ctypes.data, out.shape[1] * 4, out.shape[0])
    elif live:
        matcher, i = live[0]
        matcher.unsafe_compute_mask_ptr(out[i].ctypes.data, out.shape[1] * 4)
    for i, c in rows:
        if c.error is None and c.matcher.is_error():
            c.error = ConstraintViolated(f"the {c.what} failed: {c.matcher.get_error()}")
            out[i] = -1


def fill_draft_masks(
    constraints: Sequence[Constraint | None], drafts: Sequence[Sequence[int]], width: int, words: int
) -> np.ndarray:
    """The bitmasks of a verify step's positions: (rows, `width`, `words`) int32; position j of a
    constrained row is its grammar after its first j drafts (which it must allow: `valid_prefix`),
    for j up to its number of drafts; every other position, and every position of a row without a
    constraint (None), allows everything. Position by position, the rows' masks are computed in
    parallel (`fill_masks`) and each row's grammar takes its next draft; the grammars are rolled back
    to where they were at the end."""
    out = np.full((len(constraints), width, words), -1, dtype=np.int32)
    rows = [i for i, c in enumerate(constraints) if c is not None]
    moved = dict.fromkeys(rows, 0)
    try:
        for j in range(width):
            at = [i for i in rows if j <= len(drafts[i])]
            if not at:
                break
            out[at, j] = fill_masks([c for i in at if (c := constraints[i]) is not None], words)
            for i in at:
                c = constraints[i]
                if j < len(drafts[i]) and c is not None and c.matcher.consume_token(drafts[i][j]):
                    moved[i] += 1
    finally:
        for i, n in moved.items():
            c = constraints[i]
            if n and c is not None:
                c.matcher.rollback(n)
    return out


class ConstraintCompiler:
    """An engine's compiler of `response_format`s: the library's view of the tokenizer, built on the
    first constrained request (it reads the whole vocabulary) and kept."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits' width (may exceed the tokenizer's)
        self._eos_ids = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None  # threads that compute masks, made with it

    @property
    def words(self) -> int:
        """int32 words in one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def _library_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            llg = _llguidance()
            try:
                self._tokenizer = llg.LLTokenizer(
                    self._hf_tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self._eos_ids or None
                )
            except Exception as e:
                raise InvalidRequest(f"this model's tokenizer cannot be used to constrain output: {e}") from e
            self._executor = llg.LLExecutor()
        return self._tokenizer

    def compile(self, fmt: ResponseFormat | None) -> Constraint | None:
        """The constraint of a request's `response_format` (None for plain text); `InvalidRequest`
        naming the problem if it cannot be compiled."""
        if fmt is None or isinstance(fmt, TextFormat):
            return None
        llg = _llguidance()
        tokenizer = self._library_tokenizer()
        what, grammar = _grammar(llg, fmt)
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"response_format: the {what} cannot be compiled: {matcher.get_error()}")
        assert self._executor is not None  # made with the tokenizer
        return Constraint(matcher, what, self._executor)


def _grammar(llg: Any, fmt: ResponseFormat) -> tuple[str, str]:
    """What the format is (for messages) and its grammar in the library's form."""
    try:
        if isinstance(fmt, JsonObjectFormat):
            return "json_object", llg.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
        if isinstance(fmt, JsonSchemaFormat):
            what = f"json_schema {fmt.json_schema.name!r}"
            schema = json.dumps(fmt.json_schema.schema_)
            return what, llg.LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
        if isinstance(fmt, RegexFormat):
            return "regex", llg.LLMatcher.grammar_from_regex(fmt.regex)
        if isinstance(fmt, GrammarFormat):
            return "grammar", llg.LLMatcher.grammar_from_lark(fmt.grammar)
    except ValueError as e:
        raise InvalidRequest(f"response_format: {e}") from e
    raise InvalidRequest(f"response_format type {fmt.type!r} is not supported")
