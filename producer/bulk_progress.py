"""The progress line of a bulk run: rows decided, rate, tokens per second and time left, on a terminal."""

from __future__ import annotations

import time
from typing import TextIO

from .bulk_files import Counts


class ProgressLine:
    """A one-line progress report on a terminal, redrawn in place with `\\r` a few times a second."""

    def __init__(self, stream: TextIO | None, total: int | None, every_s: float = 0.2) -> None:
        self.stream = stream
        self.total = total
        self.every_s = every_s
        self.started = time.monotonic()
        self._next_at = 0.0
        self._width = 0

    def update(self, counts: Counts, force: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (now < self._next_at and not force):
            return
        self._next_at = now + self.every_s
        text = self.render(counts, now - self.started)
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)

    def render(self, counts: Counts, elapsed_s: float) -> str:
        worked = counts.succeeded + counts.failed
        rate = worked / elapsed_s if elapsed_s > 0 else 0.0
        done = f"{counts.decided:,}/{self.total:,}" if self.total is not None else f"{counts.decided:,}"
        parts = [f"{done} rows", f"{rate:,.1f} rows/s"]
        if counts.generated_tokens and elapsed_s > 0:
            parts.append(f"{counts.generated_tokens / elapsed_s:,.0f} tokens/s")
        if self.total is not None:
            left = max(self.total - counts.decided, 0)
            parts.append("ETA " + (_clock(left / rate) if rate > 0 else "?"))
        if counts.failed:
            parts.append(f"{counts.failed:,} failed")
        if counts.skipped:
            parts.append(f"{counts.skipped:,} skipped")
        return "  ".join(parts)

    def close(self, counts: Counts) -> None:
        """Draw the last state and end the line."""
        if self.stream is not None:
            self.update(counts, force=True)
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
