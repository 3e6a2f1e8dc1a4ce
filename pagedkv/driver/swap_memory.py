"""SwapMemory: page-locked, device-mapped host memory for a host tier's batched copies."""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np


class SwapMemory:
    """`nbytes` of host memory from `cuMemHostAlloc(PORTABLE | DEVICEMAP)`: `address` is
    the host address that `copy_batch_async` ranges use, `device_address` the device's
    address of the same bytes (`cuMemHostGetDevicePointer`), `array` a writable 1-D uint8
    numpy view. `free()` returns it to the driver (a second call does nothing); the backend
    keeps it recorded, and frees it at close, until a free succeeds. Views taken before
    `free()` must not be used after it."""

    def __init__(self, address: int, device_address: int, nbytes: int, release: Callable[["SwapMemory"], None]):
        self.address = address
        self.device_address = device_address
        self.nbytes = nbytes
        self._release = release
        self._array: np.ndarray | None = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))

    @property
    def array(self) -> np.ndarray:
        """The bytes as a writable 1-D uint8 array (ValueError after `free()`)."""
        if self._array is None:
            raise ValueError("SwapMemory has been freed")
        return self._array

    @property
    def freed(self) -> bool:
        """True once a `free()` has succeeded."""
        return self._array is None

    def contains(self, address: int, nbytes: int) -> bool:
        """True when `[address, address + nbytes)` lies inside this live memory."""
        return self._array is not None and self.address <= address and address + nbytes <= self.address + self.nbytes

    def free(self) -> None:
        """`cuMemFreeHost` (after the device's queued work, as the driver does); a second
        call does nothing. If the driver refuses, the error is raised and the memory stays
        live and recorded."""
        if self._array is None:
            return
        self._release(self)
        self._array = None

    def __enter__(self) -> "SwapMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"0x{self.address:x}"
        return f"SwapMemory({self.nbytes} bytes at {state})"
