"""The process's GIL switch interval, lowered while a helper thread of the decode loop exists.

The decode loop's thread is mostly Python, holding the GIL; a helper thread (the launcher's, the mask
thread's) needs it briefly to start and to return from each call it makes into C++ or Rust that
releases the GIL. With Python's default interval (5 ms) such a thread may wait that long, about a
whole decode step, before it gets to start its work. Each helper holds a `lowered()` while it exists:
the interval is `SWITCH_INTERVAL_S` while any is held, and the one before comes back when the last is
released (holders may end in any order).
"""

from __future__ import annotations

import sys
import threading

SWITCH_INTERVAL_S = 0.0001

_LOCK = threading.Lock()
_HELD: list[float] = []  # the interval before the first holder, once per holder


def lower() -> None:
    """Hold the lowered interval (match with `restore`)."""
    with _LOCK:
        before = _HELD[0] if _HELD else sys.getswitchinterval()
        _HELD.append(before)
        sys.setswitchinterval(min(before, SWITCH_INTERVAL_S))


def restore() -> None:
    """Let go of one hold; the last puts back the interval from before the first."""
    with _LOCK:
        if not _HELD:
            return
        before = _HELD.pop()
        if not _HELD:
            sys.setswitchinterval(before)
