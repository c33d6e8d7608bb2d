"""Out-of-memory handling: free what the worker can spare, try once more, else fail the job clearly.

MLX reports a failed allocation as a RuntimeError (Metal: `[metal::malloc] ...`); Python as MemoryError.
The worker survives either way: the job fails with `OutOfMemory`, naming what it asked for. (On Linux,
an allocation the kernel refuses can end the process instead; RQ then retries or fails the job as
abandoned, see the faults tests.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from mlxq.jobs.errors import OutOfMemory

log = logging.getLogger(__name__)

T = TypeVar("T")

_MARKERS = ("malloc", "out of memory", "unable to allocate", "failed to allocate", "memory limit")


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _MARKERS)
    )


def with_memory_retry(
    run: Callable[[], T], free: Callable[[], None], what: str, may_retry: Callable[[], bool] = lambda: True
) -> T:
    """`run()`; on an allocation failure `free()` and run once more (if `may_retry()`), else `OutOfMemory`."""
    try:
        return run()
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        if not may_retry():  # e.g. text was already streamed: a second run would repeat it
            raise OutOfMemory(f"the worker ran out of memory for {what} ({e})") from e
        log.warning("out of memory, freeing caches and retrying once what=%s error=%s", what, e)
        free()
    try:
        return run()
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        raise OutOfMemory(
            f"the worker ran out of memory for {what}, even after emptying its caches ({e}); "
            "send a shorter prompt or fewer tokens, or use a worker with more memory"
        ) from e
