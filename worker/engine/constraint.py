"""Structured output: a request's `response_format` compiled to a token-level constraint.

Owns the one place mlxq touches the constrained-decoding library (llguidance, the `structured`
extra): `ConstraintCompiler` builds the library's tokenizer from the model's own `tokenizer.json`
once per engine and compiles a request's JSON schema, regex or Lark grammar into a `Constraint`
(its own matcher state); `fill_mask_rows` writes the allowed-token bitmasks of a batch's constrained
rows, on the host, while the device runs a step, or starts writing them on a thread of its own
(`start_mask_rows`) while the decode loop handles the step's tokens. The sampler applies the masks
(`sampler_rows.py`); the decode batch decides when they are computed (`decode_batch.py`). A constraint that
cannot be compiled is the request's `InvalidRequest`, raised at admission, before any token.

A grammar that is complete allows only EOS; a constraint whose matcher stopped (complete, and the
model has no EOS the grammar may end with) says so through `stopped`, and the row ends with `stop`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
from mlxq.worker.engine import switch_interval

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
    `error`: the row it belongs to ends with it, its batch-mates go on. `error`, `taken` and
    `stopped_at` are plain fields, set on the decode loop's thread only: while a mask thread computes
    with the matcher (`start_mask_rows`), the loop reads them and never the matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, what: str, workers: MaskWorkers) -> None:
        self.matcher = matcher
        self.what = what  # e.g. "json_schema 'person'", for messages
        self.workers = workers  # its engine's threads that compute masks (`fill_mask_rows`)
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
    would. A grammar that fails computing its mask keeps the error (`Constraint.error`)."""
    live = _live_rows(out, rows)
    _note_failures(live, _compute_masks(out, live))


def start_mask_rows(out: np.ndarray, rows: Sequence[tuple[int, Constraint]]) -> MaskWork:
    """`fill_mask_rows` on the rows' mask thread (`MaskWorkers`), returned at once: the caller's thread
    does other work meanwhile (the library computes with the GIL released), touching neither `out`
    nor these rows' matchers (two threads on one matcher: the library's borrow errors), then calls
    `MaskWork.join`, which notes the grammars that failed. Which rows are done is read here."""
    work = MaskWork(_live_rows(out, rows))
    if work.live:
        work.start(out)
    return work


class MaskWork:
    """Masks being written on the mask thread (`start_mask_rows`); `seconds`: how long the thread
    computed them (read after `join`)."""

    def __init__(self, live: list[tuple[int, Constraint]]) -> None:
        self.live = live
        self.seconds = 0.0
        self._future: Future[list[int]] | None = None

    def start(self, out: np.ndarray) -> None:
        self._future = self.live[0][1].workers.submit(self._compute, out)

    def _compute(self, out: np.ndarray) -> list[int]:
        began = time.perf_counter()
        try:
            return _compute_masks(out, self.live)
        finally:
            self.seconds = time.perf_counter() - began

    def join(self) -> None:
        """Wait for the masks; each row whose grammar failed computing its mask keeps the error, as
        `fill_mask_rows` does (noted on this thread). Raises what the computation raised."""
        future, self._future = self._future, None
        if future is not None:
            _note_failures(self.live, future.result())


def _live_rows(out: np.ndarray, rows: Sequence[tuple[int, Constraint]]) -> list[tuple[int, Constraint]]:
    """The rows whose grammar goes on; a done one's row of `out` allows everything."""
    live = []
    for i, c in rows:
        if c.error is not None or c.matcher.is_stopped():
            out[i] = -1
        else:
            live.append((i, c))
    return live


def _compute_masks(out: np.ndarray, live: Sequence[tuple[int, Constraint]]) -> list[int]:
    """The masks of `live` rows written into `out`; returns the rows whose grammar failed (their row
    then allows everything). Touches the matchers and `out` only, never a constraint's fields: it may
    run on the mask thread."""
    if len(live) > 1:
        executor = live[0][1].workers.executor
        pairs = [(c.matcher, i) for i, c in live]
        executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, out.shape[1] * 4, out.shape[0])
    elif live:
        i, c = live[0]
        c.matcher.unsafe_compute_mask_ptr(out[i].ctypes.data, out.shape[1] * 4)
    failed = [i for i, c in live if c.matcher.is_error()]
    for i in failed:
        out[i] = -1
    return failed


def _note_failures(live: Sequence[tuple[int, Constraint]], failed: Iterable[int]) -> None:
    """Each grammar of `failed` rows keeps its error."""
    failed = set(failed)
    for i, c in live:
        if i in failed and c.error is None:
            c.error = ConstraintViolated(f"the {c.what} failed: {c.matcher.get_error()}")


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


class MaskWorkers:
    """An engine's threads that compute masks: the library's pool (several rows in parallel) and one
    thread of mlxq's from which a step's masks are computed while the decode loop does other work
    (`start_mask_rows`), made at its first use. While that thread exists the process's GIL switch
    interval is lowered (`switch_interval.py`): else it could wait for the GIL, to start computing,
    until the loop's thread waits on it."""

    def __init__(self, executor: llguidance.LLExecutor) -> None:
        self.executor = executor
        self._thread: ThreadPoolExecutor | None = None

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="mlxq-masks")
            switch_interval.lower()
        return self._thread.submit(fn, *args)

    def close(self) -> None:
        """Stop the thread (a later use makes another)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)
            switch_interval.restore()


class ConstraintCompiler:
    """An engine's compiler of `response_format`s: the library's view of the tokenizer, built on the
    first constrained request (it reads the whole vocabulary) and kept.

    `limits` (the library's `LLParserLimits`; None: its defaults) bounds each grammar's work: a
    grammar that exceeds them fails, ending its row with the error (tests tighten them to make a
    grammar fail while a mask is computed)."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_ids: Iterable[int], limits: Any = None
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits' width (may exceed the tokenizer's)
        self._eos_ids = sorted(eos_ids)
        self.limits = limits
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._workers: MaskWorkers | None = None  # threads that compute masks, made with it

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
            self._workers = MaskWorkers(llg.LLExecutor())
        return self._tokenizer

    def close(self) -> None:
        """Stop the mask thread, if one was made (a later constrained step makes another)."""
        if self._workers is not None:
            self._workers.close()

    def compile(self, fmt: ResponseFormat | None) -> Constraint | None:
        """The constraint of a request's `response_format` (None for plain text); `InvalidRequest`
        naming the problem if it cannot be compiled."""
        if fmt is None or isinstance(fmt, TextFormat):
            return None
        llg = _llguidance()
        tokenizer = self._library_tokenizer()
        what, grammar = _grammar(llg, fmt)
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidRequest(f"response_format: the {what} cannot be compiled: {matcher.get_error()}")
        assert self._workers is not None  # made with the tokenizer
        return Constraint(matcher, what, self._workers)


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
