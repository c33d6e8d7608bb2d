"""Token bitmasks the host writes straight into an MLX array's memory, so that a constrained draw can be
built before its masks exist.

A constrained row's draw needs its grammar's mask, and the mask needs the row's token of the step
before: built in that order, the draw's graph and the forward it feeds are built only once the token is
read back, while the device may wait (`DecodeBatch._step_ahead`). A `MaskBuffer` is an evaluated
(rows, words) uint32 array with a numpy view of its memory: the draw is built reading the array while
the device still computes the step before, and once the grammars took their tokens their masks are
written through the view (`constraint.fill_mask_rows`), no copy, and the graph is launched.

This rests on the backend: the next evaluation of a graph that reads an evaluated array must see what
the host wrote into its memory. Where host and device share memory (MLX's CPU build, Apple silicon) it
holds; elsewhere it is not promised. `host_writes_seen` checks it once per process and the engine
builds its draws in the plain order where it fails.

The host must never write a buffer while a launched draw that reads it is unfinished. A decode batch
writes it only after reading back the tokens of the last draw launched, and an evaluation has read its
inputs once its outputs exist: so one buffer per batch's rows suffices.
"""

from __future__ import annotations

import functools
import logging

import mlx.core as mx
import numpy as np

from mlxq.worker.engine.device import on_cuda
from mlxq.worker.engine.host_pages import HostPages

log = logging.getLogger(__name__)


class MaskBuffer:
    """One bitmask row per batch row, (rows, words) uint32, every bit set (everything allowed) until
    written: a free row's row stays so. `array` is what a graph reads; `host` (int32, the same memory)
    is what the host writes."""

    def __init__(self, rows: int, words: int) -> None:
        # made from host data: the array holds its memory at once (no graph to evaluate)
        self.array = mx.array(np.full((rows, words), 0xFFFFFFFF, dtype=np.uint32))
        # MLX arrays export their memory through the buffer protocol (its stub does not say so)
        self.host = np.asarray(memoryview(self.array)).view(np.int32)  # type: ignore[arg-type]
        if self.host.shape != (rows, words) or not self.host.flags.writeable:
            raise RuntimeError("an MLX array's memory is not writable through a numpy view here")
        # on CUDA the pages stay on the host, read by the device in place (`host_pages.py` says why)
        self.pages = HostPages(self, self.host.ctypes.data, self.host.nbytes) if on_cuda() else None


@functools.cache
def host_writes_seen() -> bool:
    """Whether graphs evaluated on the default device see what the host wrote into an evaluated
    array's memory after the graph was built (`MaskBuffer`); checked once per process. The caller
    makes sure nothing else is being evaluated on the stream meanwhile."""
    try:
        seen = _check()
    except Exception as e:  # any failure means: do not rely on it
        log.info("mask buffers written in place: unavailable (%s)", e)
        return False
    log.info("mask buffers written in place: %s", "available" if seen else "unavailable (writes not seen)")
    return seen


def _check() -> bool:
    """Write a buffer twice, each time after building a graph that reads it (a gather and shifts, as a
    draw's mask), and compare what the evaluations give with the values written."""
    rng = np.random.default_rng(0)
    buffer = MaskBuffer(4, 8)
    columns = np.arange(8 * 32, dtype=np.uint32)
    word, bit = mx.array(columns >> 5), mx.array(columns & 31)
    for _ in range(2):
        graph = (buffer.array[:, word] >> bit) & 1
        values = rng.integers(-(2**31), 2**31, size=(4, 8), dtype=np.int64).astype(np.int32)
        buffer.host[:] = values
        mx.eval(graph)
        expected = (values.view(np.uint32)[:, columns >> 5] >> (columns & 31)) & 1
        if not np.array_equal(np.array(graph), expected):
            return False
    return True
