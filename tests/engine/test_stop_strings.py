"""Stop strings across delta boundaries: examples plus a property test against cutting the whole text."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxq.worker.engine.text.stop_strings import StopStringMatcher


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """Feed deltas until a stop; flush at the natural end. Returns (emitted text, stopped)."""
    matcher = StopStringMatcher(stops)
    out = []
    for delta in deltas:
        safe, stopped = matcher.feed(delta)
        out.append(safe)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), matcher.stopped


def _expected(stops: list[str], text: str) -> str:
    starts = [i for s in stops if (i := text.find(s)) != -1]
    return text[: min(starts)] if starts else text


def test_stop_split_across_deltas_is_never_emitted() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("The answer is 7<") == ("The answer is 7", False)
    assert matcher.feed("/ans") == ("", False)
    assert matcher.feed("wer> and more") == ("", True)
    assert matcher.matched == "</answer>"
    assert matcher.feed("later") == ("", True)
    assert matcher.flush() == ""


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("a\n") == ("a", False)
    assert matcher.feed("\nUs") == ("", False)
    assert matcher.feed("x") == ("\n\nUsx", False)
    assert matcher.flush() == ""


def test_flush_releases_the_held_tail() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.flush() == "ST"
    assert not matcher.stopped


def test_earliest_start_wins_over_earliest_completion() -> None:
    assert _run(["abcdef", "cd"], ["xab", "cd", "ef"]) == ("x", True)
    assert _run(["abcdef", "cd"], ["xab", "cd", "eg"]) == ("xab", True)
    assert _run(["abcdef", "cd"], ["xab", "cd"]) == ("xab", True)  # decided at flush


def test_stop_at_the_very_start_and_in_one_delta() -> None:
    assert _run(["<|end|>"], ["<|end|>rest"]) == ("", True)
    assert _run(["b", "abc"], ["xabc"]) == ("x", True)


def test_no_stops_passes_everything() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_empty_stop_string_is_an_error(stops: list[str]) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(stops)


_ALPHABET = "ab\n🙂é"


@st.composite
def _split(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[i:j] for i, j in itertools.pairwise(bounds)]  # may include empty deltas


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    text=st.text(alphabet=_ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=5), max_size=4),
)
def test_streamed_result_equals_cutting_the_whole_text(
    data: st.DataObject, text: str, stops: list[str]
) -> None:
    deltas = data.draw(_split(text))
    emitted, stopped = _run(stops, deltas)
    assert emitted == _expected(stops, text)
    assert stopped == any(s in text for s in stops)


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet=_ALPHABET, max_size=60), stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=4))
)
def test_character_by_character(text: str, stops: list[str]) -> None:
    assert _run(stops, list(text))[0] == _expected(stops, text)


def test_a_long_stop_string_costs_memory_in_proportion_to_its_length() -> None:
    """A 64 KB stop string (a producer may send one) holds back a tail of at most its length; nothing
    the size of its square is built (every prefix of it would be ~2 GB)."""
    import tracemalloc

    stop = "ab" * 32_767 + "c"
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([stop, "zz"])
        emitted = [matcher.feed("ab")[0] for _ in range(33_000)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000
    assert not matcher.stopped  # what it holds back could still become the long stop
    assert "".join(emitted) == "ab" * (33_000 - 32_767)
    assert matcher.feed("zz") == ("ab" * 32_767, True)
