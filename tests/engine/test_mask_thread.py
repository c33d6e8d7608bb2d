"""Masks computed on the mask thread while the decode loop handles a step's tokens (`DecodeBatch._step_ahead`
with masks in place, `constraint.start_mask_rows`).

The order of a constrained step changes (the tokens handled before the launch, beside the masks), the
tokens must not: every row gets what the plain order gives it (`_both_orders` in
`test_structured_output.py` compares tokens, text, finish reasons and logprobs; those tests run the
thread too). Here: a grammar that fails while its mask is computed, the matchers never touched by two
threads at once (real llguidance, every call recorded), and the clock's parts.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
from test_structured_output import (  # the structured tests' model, engines and requests
    DATE,
    SCORES,
    _batch,
    _engine,
    _mixed,
    _request,
    json_schema,
    model_dir,
)

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine import Engine
from mlxq.worker.engine.constraint import ConstraintViolated, fill_mask_rows, start_mask_rows

llguidance = pytest.importorskip("llguidance")

__all__ = ["model_dir"]  # a fixture these tests use

# A free string: with few lexer states allowed, its grammar fails computing a mask some tokens in
# (after the tokens that open the string were taken), not at admission.
NOTES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
    "minItems": 3,
}


def _few_states() -> Any:
    """Limits a `NOTES` grammar exceeds; short messages (the verbose ones carry timings)."""
    return llguidance.LLParserLimits(max_lexer_states=30, verbose_errors=False)


def _failing_requests() -> list[GenerateRequest]:
    """Rows whose grammar fails computing a mask (greedy, seeded) beside constrained rows that do not
    and a free one."""
    fmt = json_schema(NOTES)
    return [
        _request(prompt="Row 0:", max_tokens=30, temperature=0.0, response_format=fmt),
        _request(prompt="Row 1:", max_tokens=30, temperature=0.0, response_format=json_schema(SCORES)),
        _request(prompt="Row 2:", max_tokens=30, temperature=0.8, seed=3, response_format=fmt),
        _request(
            prompt="Row 3:", max_tokens=30, temperature=0.0, response_format={"type": "regex", "regex": DATE}
        ),
        _request(prompt="Row 4:", max_tokens=30, temperature=0.0),
    ]


@pytest.mark.parametrize(("pad_shapes", "overlap", "join_every"), [(False, False, 0), (True, True, 2)])
def test_a_grammar_failing_while_its_mask_is_computed_ends_its_row_as_in_the_plain_order(
    model_dir: Path, pad_shapes: bool, overlap: bool, join_every: int
) -> None:
    """The failure is found at the join, after the row handled its token: the row ends at that token
    with the same error as when it is found before handling (the plain order), and its batch-mates
    get what they get there. Its stream alone may hold that one token more."""
    outcomes = []
    for in_place in (False, True):
        engine = _engine(
            model_dir,
            prefix_cache_bytes=0,
            masks_in_place=in_place,
            pad_shapes=pad_shapes,
            decode_overlap=overlap,
        )
        engine.constraints.limits = _few_states()
        seen: dict[str, str] = {}
        outcomes.append((_batch(engine, _failing_requests(), join_every, seen), seen))
        engine.close()
    (plain, plain_seen), (ahead, ahead_seen) = outcomes
    failed = 0
    for a, b in zip(plain, ahead, strict=True):
        if a.error is not None:
            assert isinstance(a.error, ConstraintViolated) and isinstance(b.error, ConstraintViolated)
            assert str(b.error) == str(a.error)
            assert "failed: lexer error" in str(a.error)
            assert ahead_seen[a.key].startswith(plain_seen[a.key])
            failed += 1
            continue
        assert b.error is None and a.result is not None and b.result is not None, b.error
        assert (b.result.token_ids, b.result.text, b.result.finish_reason, b.result.logprobs) == (
            a.result.token_ids,
            a.result.text,
            a.result.finish_reason,
            a.result.logprobs,
        )
        assert ahead_seen[a.key] == plain_seen[a.key]
    assert failed == 2 and plain[1].result is not None and plain[3].result is not None


def test_a_failure_found_on_the_mask_thread_is_noted_at_the_join(engine: Engine) -> None:
    """`start_mask_rows` leaves the constraints' fields alone until `join`, which notes the failure as
    `fill_mask_rows` does, with the same message, and the same masks."""
    engine.constraints.limits = _few_states()
    fmt = _request(prompt="x", response_format=json_schema(NOTES)).response_format
    text = '[{"a":"hello world","b":1},'
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    words = engine.constraints.words
    messages = []
    for threaded in (False, True):
        constraints = [engine.constraints.compile(fmt) for _ in range(2)]
        masks = np.zeros((2, words), dtype=np.int32)
        taken = 0
        while all(c is not None and c.error is None for c in constraints) and taken < len(ids):
            rows = [(i, c) for i, c in enumerate(constraints) if c is not None]
            if threaded:
                work = start_mask_rows(masks, rows)
                assert all(c.error is None for _, c in rows)  # not before the join
                work.join()
            else:
                fill_mask_rows(masks, rows)
            for _, c in rows:
                if c.error is None:
                    c.take(ids[taken])
            taken += 1
        errors = [c.error for c in constraints if c is not None]
        assert all(isinstance(e, ConstraintViolated) for e in errors), (threaded, taken)
        assert (masks == -1).all()  # a failed row allows everything
        messages.append((taken, [str(e) for e in errors]))
    assert messages[0] == messages[1]


class _LibraryCalls:
    """Every call into llguidance's matchers and executor, from every thread (a profile function):
    the calls per thread, and each call made while another thread was inside one."""

    def __init__(self) -> None:
        self.inside: dict[int, int] = {}  # thread -> library calls it is inside (the GIL orders events)
        self.calls: Counter[str] = Counter()
        self.overlaps: list[str] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("c_call", "c_return", "c_exception"):
            return
        if not isinstance(getattr(arg, "__self__", None), llguidance.LLMatcher | llguidance.LLExecutor):
            return
        me = threading.get_ident()
        if event != "c_call":
            self.inside[me] -= 1
            return
        others = [t for t, depth in self.inside.items() if depth and t != me]
        if others:
            self.overlaps.append(f"{threading.current_thread().name}: {arg.__name__}")
        self.inside[me] = self.inside.get(me, 0) + 1
        self.calls[threading.current_thread().name.split("_")[0]] += 1


def test_no_matcher_is_touched_by_two_threads_at_once(model_dir: Path) -> None:
    """Mixed constrained and free rows joining and leaving, with the launcher's thread: the mask thread
    computes masks at most steps, the loop's thread takes tokens and cuts nothing meanwhile, and no
    library call ever starts while another thread is inside one."""
    engine = _engine(
        model_dir, prefix_cache_bytes=0, masks_in_place=True, pad_shapes=True, decode_overlap=True
    )
    calls = _LibraryCalls()
    threading.setprofile(calls)  # threads started from now on: the mask thread, made at its first use
    sys.setprofile(calls)
    try:
        finished = _batch(engine, _mixed(engine), join_every=2)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert calls.overlaps == []
    assert all(f.error is None for f in finished)
    assert calls.calls["mlxq-masks"] > 10 and calls.calls["MainThread"] > 10, calls.calls


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return _engine(model_dir, prefix_cache_bytes=0)
