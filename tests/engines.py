"""Engines the engine tests load, closed after each test (`_close_engines` in tests/conftest.py): an
engine holds a launcher thread's stream and MLX memory, and a module's engines would otherwise outlive
it."""

from __future__ import annotations

from mlxq.worker.engine import Engine

_open: list[Engine] = []


def closed_after_test(engine: Engine) -> Engine:
    """`engine`, to be closed once the running test ends."""
    _open.append(engine)
    return engine


def close_engines() -> None:
    """Close every engine registered since the last call (newest first)."""
    while _open:
        _open.pop().close()
