"""Staging slots for the per-launch index lists and results of the block kernels, from
allocation to release.

Each slot pairs a pinned host buffer with a device buffer and an event. A launch copies
its indices host -> device on its own stream, runs, and records the slot's event; the
slot is reused only after that event has completed, so neither buffer is overwritten
while a copy or a kernel still reads it, whatever stream it ran on. A slot can also be
*held* by a caller that waits for its result without the backend's lock (the
reduction): the ring never hands a held slot out, and grows instead.

A *mapped* ring (`StagingRing(mapped=True)`) has no device buffers: each slot's pinned
host buffer is allocated DEVICEMAP and `device` is its device pointer
(`cuMemHostGetDevicePointer`), so a kernel reads what the host wrote there without any
upload call (the batched copy's descriptor); the same event rule keeps the host from
rewriting a slot a queued kernel still reads.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator

import numpy as np

from ._bindings import driver
from .errors import CudaError, check

SLOTS = 4
"""Slots in the ring to start with: launches on different streams can overlap this many deep."""

_MIN_BYTES = 64 << 10
_CU_EVENT_DISABLE_TIMING = 2
_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02
_CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900


def refuse_capture(stream: Any, what: str) -> None:
    """Raise CudaError (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, naming `what`) when `stream`
    is capturing a CUDA graph: staged work reads a slot that later calls rewrite, so a
    graph replaying it would read another call's indices or descriptor."""
    capturing = check(driver.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    if int(getattr(capturing, "value", capturing)) != 0:
        raise CudaError(
            what, _CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "operation not permitted when stream is capturing",
            "(it reads a reused staging slot, which a graph replay would find rewritten)",
        )


class StagingSlot:
    """One slot: `host` (pinned, numpy uint8), `device` (address), both `capacity` bytes;
    `pending` while recorded work may still use it, `held` while a caller waits on it.
    A `mapped` slot's `device` is the device pointer of `host` (no device buffer)."""

    def __init__(self, mapped: bool = False) -> None:
        self.mapped = mapped
        self.capacity = 0
        self.host_address = 0
        self.host: np.ndarray | None = None
        self.device = 0
        self.event: Any = None
        self.pending = False
        self.held = False

    def upload(self, arrays: list[np.ndarray], stream: Any) -> None:
        """Concatenate `arrays` into the pinned buffer and copy them to the device buffer
        on `stream` (the caller sized the slot)."""
        at = 0
        for arr in arrays:
            self.host[at : at + arr.nbytes] = arr.view(np.uint8)
            at += arr.nbytes
        check(driver.cuMemcpyHtoDAsync(self.device, self.host_address, at, stream), "cuMemcpyHtoDAsync")

    def download(self, offset: int, nbytes: int, stream: Any) -> None:
        """Queue a copy of device bytes [offset, offset + nbytes) to the same host offset."""
        check(
            driver.cuMemcpyDtoHAsync(self.host_address + offset, self.device + offset, nbytes, stream),
            "cuMemcpyDtoHAsync",
        )

    def wait(self) -> None:
        """Wait for the recorded work; the slot is then idle."""
        if self.pending:
            check(driver.cuEventSynchronize(self.event), "cuEventSynchronize")
            self.pending = False

    def release(self) -> None:
        """Free both buffers and the event (after waiting for the event)."""
        self.wait()
        self.free_buffers()
        if self.event is not None:
            check(driver.cuEventDestroy(self.event), "cuEventDestroy")
            self.event = None

    def free_buffers(self) -> None:
        """Free the device and pinned host buffers (the slot must be idle); capacity 0."""
        if self.device and not self.mapped:
            check(driver.cuMemFree(self.device), "cuMemFree")
        self.device = 0
        if self.host_address:
            check(driver.cuMemFreeHost(self.host_address), "cuMemFreeHost")
            self.host_address, self.host = 0, None
        self.capacity = 0

    def grow(self, capacity: int) -> None:
        """Replace both buffers by `capacity` bytes (rounded up to 256; the slot must be
        idle); on failure the slot is left with no buffers and capacity 0."""
        capacity = -(-capacity // 256) * 256
        self.free_buffers()
        flags = _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP if self.mapped else 0
        self.host_address = int(check(driver.cuMemHostAlloc(capacity, flags), "cuMemHostAlloc", f"staging {capacity} bytes"))
        self.host = np.ctypeslib.as_array((ctypes.c_uint8 * capacity).from_address(self.host_address))
        if self.mapped:
            self.device = int(check(driver.cuMemHostGetDevicePointer(self.host_address, 0), "cuMemHostGetDevicePointer"))
        else:
            self.device = int(check(driver.cuMemAlloc(capacity), "cuMemAlloc", f"staging {capacity} bytes"))
        self.capacity = capacity


class StagingRing:
    """Hands out slots round-robin, skipping held ones (and growing the ring when every
    slot is held); `acquire(nbytes)` waits for the slot's last use and grows it to at
    least `nbytes`. Callers hold the backend's lock around acquire..record and around
    any change of `held`. `mapped` makes every slot a mapped one (see the module)."""

    def __init__(self, mapped: bool = False) -> None:
        self.mapped = mapped
        self._slots = [StagingSlot(mapped) for _ in range(SLOTS)]
        self._next = 0

    def __len__(self) -> int:
        return len(self._slots)

    def held(self) -> int:
        """How many slots a caller holds now."""
        return sum(slot.held for slot in self._slots)

    def acquire(self, nbytes: int) -> StagingSlot:
        """The next slot not held, idle and at least `nbytes` long on both sides."""
        for _ in range(len(self._slots)):
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if not slot.held:
                break
        else:
            slot = StagingSlot(self.mapped)
            self._slots.append(slot)
        if slot.event is None:
            slot.event = check(driver.cuEventCreate(_CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        slot.wait()
        if nbytes > slot.capacity:
            slot.grow(max(nbytes, 2 * slot.capacity, _MIN_BYTES))
        return slot

    @staticmethod
    def record(slot: StagingSlot, stream: Any) -> None:
        """Mark the slot in use until the work now enqueued on `stream` completes."""
        check(driver.cuEventRecord(slot.event, stream), "cuEventRecord")
        slot.pending = True

    @contextlib.contextmanager
    def in_use(self, nbytes: int, stream: Any) -> Iterator[StagingSlot]:
        """A slot for work the block enqueues on `stream`. On leaving the block, normally or
        by an exception (a failed launch after a queued upload), the slot is marked in use
        until that work completes; if even the event cannot be recorded, the stream is
        waited for, so a queued copy can never race the slot's next user. A stream that is
        capturing a CUDA graph is refused first (`refuse_capture`), nothing acquired."""
        refuse_capture(stream, "a staged launch")
        slot = self.acquire(nbytes)
        try:
            yield slot
        finally:
            try:
                self.record(slot, stream)
            except Exception:
                driver.cuStreamSynchronize(stream)  # best effort; the record error propagates
                raise

    def close(self) -> None:
        """Release every slot (none may be held), attempting all; the first error is raised."""
        first = None
        for slot in self._slots:
            try:
                slot.release()
            except Exception as err:  # noqa: BLE001 - every slot must be attempted
                first = first or err
        if first is not None:
            raise first
