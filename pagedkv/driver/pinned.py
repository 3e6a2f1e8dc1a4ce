"""PinnedBuffer: page-locked host memory from cuMemHostAlloc, usable as a numpy array."""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np


class PinnedBuffer:
    """`nbytes` of page-locked host memory. `array` is a writable uint8 numpy view of it;
    async host copies require it. Free with `free()` (or a `with` block) while its backend
    is open; views taken before `free()` must not be used after it."""

    def __init__(self, address: int, nbytes: int, release: Callable[["PinnedBuffer"], None]):
        self.address = address
        self.nbytes = nbytes
        self._release = release
        self._array: np.ndarray | None = np.ctypeslib.as_array(
            (ctypes.c_uint8 * nbytes).from_address(address)
        )

    @property
    def array(self) -> np.ndarray:
        """The buffer as a 1-D uint8 array (raises after `free()`)."""
        if self._array is None:
            raise ValueError(f"{type(self).__name__} has been freed")
        return self._array

    @property
    def freed(self) -> bool:
        """True once `free()` has run."""
        return self._array is None

    def contains(self, address: int, nbytes: int) -> bool:
        """True when `[address, address + nbytes)` lies inside this live buffer."""
        return self._array is not None and self.address <= address and address + nbytes <= self.address + self.nbytes

    def free(self) -> None:
        """Return the memory to the driver; a second call does nothing. If the driver
        refuses, the error is raised and the buffer stays live and recorded (a retry, or
        the backend's close, frees it)."""
        if self._array is None:
            return
        self._release(self)
        self._array = None

    def __enter__(self) -> "PinnedBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __buffer__(self, flags: int) -> memoryview:
        """The buffer protocol (Python 3.12+): the same bytes as `array`."""
        return memoryview(self.array)

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"0x{self.address:x}"
        return f"{type(self).__name__}({self.nbytes} bytes at {state})"
