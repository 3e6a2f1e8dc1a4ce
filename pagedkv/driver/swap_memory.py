"""SwapMemory: page-locked, device-mapped host memory for a host tier's batched copies."""

from __future__ import annotations

from typing import Callable

from .pinned import PinnedBuffer


class SwapMemory(PinnedBuffer):
    """`nbytes` of host memory from `cuMemHostAlloc(PORTABLE | DEVICEMAP)`: `address` is
    the host address that `copy_batch_async` ranges use, `device_address` the device's
    address of the same bytes (`cuMemHostGetDevicePointer`), `array` a writable 1-D uint8
    numpy view. `free()` returns it to the driver (a second call does nothing); the backend
    keeps it recorded, and frees it at close, until a free succeeds. Views taken before
    `free()` must not be used after it. `array`, `freed`, `contains`, the `with` block and
    the buffer protocol are PinnedBuffer's."""

    def __init__(self, address: int, device_address: int, nbytes: int, release: Callable[["SwapMemory"], None]):
        super().__init__(address, nbytes, release)
        self.device_address = device_address

    def free(self) -> None:
        """`cuMemFreeHost` (after the device's queued work, as the driver does); a second
        call does nothing. If the driver refuses, the error is raised and the memory stays
        live and recorded."""
        if self._array is None:
            return
        self._release(self)
        self._array = None
