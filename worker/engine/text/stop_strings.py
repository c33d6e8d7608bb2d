"""Stop strings over streamed text: hold back what might begin a stop, never show the stop or what follows.

Text arrives in deltas (one per token, split anywhere); a stop string may straddle several of them. The
result equals cutting the whole text at the earliest-starting occurrence of any stop, however the text
was split. The matcher keeps only a tail shorter than the longest stop, so its work per delta is bounded
by the delta and the stops, not by the text generated so far; its memory is the stops and that tail
(no table of every prefix of every stop: a long stop string would cost the square of its length).

One corner follows from "earliest start": when a stop is complete but a longer stop that would start
earlier is still possible (stops "abcdef" and "cd" on text "abcd"), the matcher waits for the next
delta before deciding; at the natural end, `flush` decides and sets `stopped`.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the earliest-starting occurrence of any stop string in a stream of text deltas."""

    def __init__(self, stops: Sequence[str]) -> None:
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._longest_prefix = max((len(s) - 1 for s in self.stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next delta; return (text safe to emit now, whether a stop string was reached).

        After a stop, every call returns ("", True).
        """
        if self.stopped:
            return "", True
        text = self._held + delta
        hit = self._first_stop(text)
        pending = len(text) - self._tail_len(text)  # where a not-yet-complete stop could start
        if hit is not None and hit[0] <= pending:
            return self._stop(text, hit), True
        self._held = text[pending:]
        return text[:pending], False

    def flush(self) -> str:
        """At the natural end of the text: release the held tail, up to a stop if it holds one."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        hit = self._first_stop(held)
        return held if hit is None else self._stop(held, hit)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        return min(((i, s) for s in self.stops if (i := text.find(s)) != -1), default=None)

    def _stop(self, text: str, hit: tuple[int, str]) -> str:
        self.stopped, self.matched, self._held = True, hit[1], ""
        return text[: hit[0]]

    def _tail_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop: for each stop,
        the earliest place in the tail where the stop's first character stands and the rest of the
        tail continues the stop (the searches and comparisons run in C)."""
        best = 0
        for stop in self.stops:
            tail = text[len(text) - min(len(stop) - 1, len(text)) :]
            at = tail.find(stop[0])
            while at != -1 and len(tail) - at > best:
                if stop.startswith(tail[at:]):
                    best = len(tail) - at
                    break
                at = tail.find(stop[0], at + 1)
        return best
