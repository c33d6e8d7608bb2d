"""Mask buffers kept on the host for the device to read in place (`host_pages.py`)."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from mlxq.worker.engine import host_pages
from mlxq.worker.engine.device import on_cuda
from mlxq.worker.engine.mask_buffer import MaskBuffer


def _draw_bits(buffer: MaskBuffer, columns: int) -> mx.array:
    """What a draw reads of the buffer: bit c of each row, for c < `columns`."""
    c = mx.arange(columns, dtype=mx.uint32)
    return (buffer.array[:, c >> 5] >> (c & 31)) & 1


def _expected(values: np.ndarray, columns: int) -> np.ndarray:
    c = np.arange(columns, dtype=np.uint32)
    return (values.view(np.uint32)[:, c >> 5] >> (c & 31)) & 1


@pytest.mark.skipif(on_cuda(), reason="the CPU's way: nothing to advise")
def test_off_cuda_a_buffer_is_left_as_it_is_and_works() -> None:
    buffer = MaskBuffer(3, 4)
    assert buffer.pages is None
    pages = host_pages.HostPages(buffer, buffer.host.ctypes.data, buffer.host.nbytes)
    assert not pages.advised  # no CUDA driver, or memory it does not manage: nothing done, no error
    values = np.random.default_rng(0).integers(-(2**31), 2**31, size=(3, 4)).astype(np.int32)
    graph = _draw_bits(buffer, 128)
    buffer.host[:] = values
    assert np.array_equal(np.array(graph), _expected(values, 128))


@pytest.mark.skipif(not on_cuda(), reason="unified memory advice is CUDA's")
def test_on_cuda_the_pages_stay_on_the_host_and_the_device_reads_each_write() -> None:
    buffer = MaskBuffer(64, 4008)
    assert buffer.pages is not None and buffer.pages.advised
    rng = np.random.default_rng(1)
    for _ in range(3):  # a graph built before each write reads that write (as a draw does)
        values = rng.integers(-(2**31), 2**31, size=(64, 4008)).astype(np.int32)
        graph = _draw_bits(buffer, 4008 * 32)
        buffer.host[:] = values
        assert np.array_equal(np.array(graph), _expected(values, 4008 * 32))
    pages = buffer.pages
    del buffer
    gc.collect()
    assert not pages.advised or pages._finalizer.alive is False  # taken back with its owner
