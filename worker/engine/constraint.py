"""Structured output: a request's `response_format` compiled to a token-level constraint.

Owns the one place mlxq touches the constrained-decoding library (llguidance, the `structured`
extra): `ConstraintCompiler` builds the library's tokenizer from the model's own `tokenizer.json`
once per engine and compiles a request's JSON schema, regex or Lark grammar into a `Constraint`
(its own matcher state); `fill_masks` writes the allowed-token bitmasks of a batch's constrained
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
        self.executor = executor  # its engine's pool of mask threads (`fill_masks`)
        self.error: ConstraintViolated | None = None

    def take(self, token: int) -> None:
        """Advance past `token` (nothing once complete or failed: the row ends with this token)."""
        if self.error is not None or self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            self.error = ConstraintViolated(
                f"token {token} does not follow the {self.what}: {self.matcher.get_error()}"
            )

    @property
    def stopped(self) -> bool:
        """Whether the grammar allows nothing more (complete): the row must end."""
        return bool(self.matcher.is_stopped())

    def fill(self, out: np.ndarray) -> None:
        """Write the allowed next tokens as a bitmask into `out` (int32 words, a row of a C array)."""
        if self.error is None and not self.matcher.is_stopped():
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * out.itemsize)
            if self.matcher.is_error():
                self.error = ConstraintViolated(f"the {self.what} failed: {self.matcher.get_error()}")
        if self.error is not None or self.matcher.is_stopped():
            out[:] = -1  # nothing to constrain: the row ends before its next token is used


def fill_masks(constraints: Sequence[Constraint], words: int) -> np.ndarray:
    """The allowed-token bitmasks of `constraints`, one row each: (len, `words`) int32, bit t of a
    row set where its grammar allows token t. Several rows are computed in parallel on the library's
    threads (it releases the GIL): on a GPU host a step of 64 rows lasts about as long as 64 masks
    computed one after another would."""
    out = np.full((len(constraints), words), -1, dtype=np.int32)
    live = [
        (c.matcher, i) for i, c in enumerate(constraints) if c.error is None and not c.matcher.is_stopped()
    ]
    if len(live) > 1:
        executor = constraints[live[0][1]].executor
        executor.unsafe_compute_mask_ptr(live, out.ctypes.data, words * 4, len(constraints))
    elif live:
        constraints[live[0][1]].fill(out[live[0][1]])
    for c in constraints:
        if c.error is None and c.matcher.is_error():
            c.error = ConstraintViolated(f"the {c.what} failed: {c.matcher.get_error()}")
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
