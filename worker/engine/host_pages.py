"""Keeping an array the host rewrites every step on the host, read by the GPU where it lies.

MLX's CUDA build allocates arrays in unified (managed) memory: a page lives where it was last touched
and moves on a fault. A constrained batch's `MaskBuffer` is written by the host at every step and read
by the draw on the device, so each step its pages would move to the device on the draw's faults and
back on the host's writes: for 64 rows of a 128k-token vocabulary (1 MiB of bitmasks) about a
millisecond of faults a step, on the constrained batch's critical path (`bench/README.md`, issue 34).
Advising the driver that the buffer's preferred location is the host and that the device accesses it
maps the pages for the device where they are: the draw reads them over the link without a fault, and
the host writes local memory.

MLX has no such call, so it goes through the CUDA driver (`cuMemAdvise` in libcuda, by ctypes). The
advice outlives the array in MLX's buffer cache, where another array may later take the memory, so
it is taken back when its owner is collected (`HostPages.release`). Where any of it fails (no CUDA
driver, memory that is not managed, an older driver) nothing is advised: slower, never wrong.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from typing import Any

log = logging.getLogger(__name__)

# CUDA driver API constants (cuda.h)
_SET_PREFERRED_LOCATION, _UNSET_PREFERRED_LOCATION = 3, 4
_SET_ACCESSED_BY, _UNSET_ACCESSED_BY = 5, 6
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
_CPU_DEVICE = -1  # CU_DEVICE_CPU, the v1 call's way of naming the host
_IS_MANAGED = 8  # CU_POINTER_ATTRIBUTE_IS_MANAGED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]  # ctypes' own form


class _Driver:
    """libcuda's few calls used here, bound once per process; `advise` raises OSError on failure."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            raise OSError("cuInit failed")
        self._lib = lib
        self._v2 = hasattr(lib, "cuMemAdvise_v2")
        if self._v2:
            lib.cuMemAdvise_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _Location]
        else:
            lib.cuMemAdvise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]

    def current(self, device: int) -> None:
        """Make `device`'s primary context (the one MLX's runtime calls use) current on this thread,
        where none is: driver calls need one."""
        ctx = ctypes.c_void_p()
        if self._lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
            return
        handle = ctypes.c_int()
        if self._lib.cuDeviceGet(ctypes.byref(handle), device) != 0:
            raise OSError(f"cuDeviceGet({device}) failed")
        if self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle) != 0:
            raise OSError("cuDevicePrimaryCtxRetain failed")
        if self._lib.cuCtxSetCurrent(ctx) != 0:
            raise OSError("cuCtxSetCurrent failed")

    def managed(self, pointer: int) -> bool:
        value = ctypes.c_uint(0)
        return self._lib.cuPointerGetAttribute(ctypes.byref(value), _IS_MANAGED, pointer) == 0 and bool(
            value.value
        )

    def advise(self, pointer: int, nbytes: int, advice: int, device: int | None) -> None:
        """`advice` for the range, about `device` (None: the host)."""
        if self._v2:
            where = _Location(_LOCATION_HOST, 0) if device is None else _Location(_LOCATION_DEVICE, device)
            rc = self._lib.cuMemAdvise_v2(pointer, nbytes, advice, where)
        else:
            rc = self._lib.cuMemAdvise(pointer, nbytes, advice, _CPU_DEVICE if device is None else device)
        if rc != 0:
            raise OSError(f"cuMemAdvise({advice}) returned {rc}")


_driver: _Driver | None = None
_driver_failed = False
_lock = threading.Lock()


def _the_driver() -> _Driver | None:
    global _driver, _driver_failed
    with _lock:
        if _driver is None and not _driver_failed:
            try:
                _driver = _Driver()
            except (OSError, AttributeError) as e:
                _driver_failed = True
                log.info("host-resident mask buffers: unavailable (%s)", e)
        return _driver


class HostPages:
    """The advice on one array's memory, taken back by `release` (at the latest when `owner` is
    collected). `advised`: whether the pages stay on the host for the device to read."""

    def __init__(self, owner: Any, pointer: int, nbytes: int, device: int = 0) -> None:
        self.advised = False
        driver = _the_driver()
        if driver is None:
            return
        try:
            driver.current(device)
        except OSError as e:
            log.info("host-resident mask buffer: not advised (%s)", e)
            return
        if not driver.managed(pointer):
            log.info("host-resident mask buffer: not managed memory, left as it is")
            return
        try:
            driver.advise(pointer, nbytes, _SET_PREFERRED_LOCATION, None)
            driver.advise(pointer, nbytes, _SET_ACCESSED_BY, device)
        except OSError as e:
            log.info("host-resident mask buffer: not advised (%s)", e)
            _release(driver, pointer, nbytes, device)
            return
        self.advised = True
        self._finalizer = weakref.finalize(owner, _release, driver, pointer, nbytes, device)

    def release(self) -> None:
        if self.advised:
            self._finalizer()
            self.advised = False


def _release(driver: _Driver, pointer: int, nbytes: int, device: int) -> None:
    for advice, about in ((_UNSET_ACCESSED_BY, device), (_UNSET_PREFERRED_LOCATION, None)):
        try:
            driver.advise(pointer, nbytes, advice, about)
        except OSError as e:  # the memory stays advised: other arrays that reuse it are slower, not wrong
            log.warning("could not take back a host-resident buffer's advice (%s)", e)
