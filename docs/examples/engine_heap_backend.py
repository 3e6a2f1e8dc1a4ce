"""A backend an engine writes around the device allocator it already has.

`EngineHeap` stands in for the engine's allocator: one big region handed out by
first-fit with 256-byte granules, as an engine's device heap would be (here the region
is host memory, so the example runs anywhere). `EngineHeapBackend` is the whole backend:
the required GpuBackend calls over that heap, and the block calls from
`pagedkv.backends.per_range` because the engine has no batched kernels. It states
"device:cpu" through `supports`; `pagedkv.testing.backend_conformance` checks it.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from pagedkv.backend import DevicePtr, check_alloc_size, check_byte_count, check_fill_byte, host_bytes
from pagedkv.backends.per_range import PerRangeBlockOps
from pagedkv.capabilities import check_capability_name
from pagedkv.errors import DeviceMemoryError, DeviceOutOfMemory

GRANULE = 256


class EngineHeap:
    """The engine's allocator: `capacity` bytes, first-fit, 256-byte granules; `malloc`
    returns an offset or None when nothing fits, `release` takes the offset back."""

    def __init__(self, capacity: int):
        self.memory = np.zeros(capacity + GRANULE, np.uint8)
        self.start = -self.memory.ctypes.data % GRANULE  # first aligned byte
        self.capacity = capacity
        self.holes = [(0, capacity)]  # (offset, size), sorted
        self.blocks: dict[int, int] = {}  # offset -> size

    def malloc(self, nbytes: int) -> int | None:
        size = -(-nbytes // GRANULE) * GRANULE
        for i, (offset, hole) in enumerate(self.holes):
            if hole >= size:
                self.holes[i : i + 1] = [(offset + size, hole - size)] if hole > size else []
                self.blocks[offset] = size
                return offset
        return None

    def release(self, offset: int) -> None:
        size = self.blocks.pop(offset)
        bisect.insort(self.holes, (offset, size))
        merged: list[tuple[int, int]] = []
        for off, sz in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self.holes = merged

    def free_bytes(self) -> int:
        return sum(size for _, size in self.holes)


class EngineHeapBackend(PerRangeBlockOps):
    """GpuBackend over an EngineHeap: addresses are the heap's real addresses."""

    def __init__(self, heap: EngineHeap):
        self.heap = heap
        self.base = heap.memory.ctypes.data + heap.start
        self.sizes: dict[int, int] = {}  # address -> bytes asked
        self.streams = {0}

    def supports(self, name: str) -> bool:
        return check_capability_name(name) == "device:cpu"

    # memory
    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = check_alloc_size(nbytes)
        offset = self.heap.malloc(nbytes)
        if offset is None:
            raise DeviceOutOfMemory(f"engine heap: no room for {nbytes} bytes ({self.heap.free_bytes()} free)")
        self.sizes[self.base + offset] = nbytes
        return DevicePtr(self.base + offset)

    def free(self, ptr: DevicePtr) -> None:
        if int(ptr) not in self.sizes:
            raise DeviceMemoryError(f"free of {DevicePtr(int(ptr))!r}: not an allocation, or already freed")
        del self.sizes[int(ptr)]
        self.heap.release(int(ptr) - self.base)

    def mem_range_ok(self, ptr: DevicePtr, nbytes: int) -> bool:
        starts = sorted(self.sizes)
        i = bisect.bisect_right(starts, int(ptr)) - 1
        return i >= 0 and int(ptr) + nbytes <= starts[i] + self.sizes[starts[i]]

    def _bytes(self, ptr: DevicePtr, nbytes: int) -> np.ndarray:
        nbytes = check_byte_count(nbytes)
        if nbytes and not self.mem_range_ok(ptr, nbytes):
            raise DeviceMemoryError(f"{DevicePtr(int(ptr))!r} + {nbytes} bytes is not inside one allocation")
        at = self.heap.start + int(ptr) - self.base
        return self.heap.memory[at : at + nbytes]

    def mem_info(self) -> tuple[int, int]:
        return self.heap.free_bytes(), self.heap.capacity

    # streams: work runs at once
    def default_stream(self) -> int:
        return 0

    def create_stream(self) -> int:
        handle = max(self.streams) + 1
        self.streams.add(handle)
        return handle

    def destroy_stream(self, stream: int) -> None:
        if stream == 0 or stream not in self.streams:
            raise ValueError(f"cannot destroy stream {stream!r}")
        self.streams.discard(stream)

    def synchronize(self, stream: int) -> None:
        if stream not in self.streams:
            raise ValueError(f"unknown stream {stream!r}")

    def synchronize_all(self) -> None:
        pass

    # copies
    def memset_async(self, ptr: DevicePtr, value: int, nbytes: int, stream: int) -> None:
        value = check_fill_byte(value)
        self.synchronize(stream)
        self._bytes(ptr, nbytes)[:] = value

    def copy_h2d(self, src: Any, dst: DevicePtr) -> None:
        data = host_bytes(src, writable=False)
        self._bytes(dst, data.nbytes)[:] = data

    def copy_d2h(self, src: DevicePtr, dst: Any) -> None:
        out = host_bytes(dst, writable=True)
        out[:] = self._bytes(src, out.nbytes)

    def copy_d2d(self, src: DevicePtr, dst: DevicePtr, nbytes: int, stream: int) -> None:
        self.synchronize(stream)
        data = self._bytes(src, nbytes).copy()
        self._bytes(dst, nbytes)[:] = data
