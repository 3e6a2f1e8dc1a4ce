"""A small ring of staging slots for the per-launch index lists of the block kernels.

Each slot pairs a pinned host buffer with a device buffer and an event. A launch copies
its indices host -> device on its own stream, runs, and records the slot's event; the
slot is reused only after that event has completed, so neither buffer is overwritten
while a copy or a kernel still reads it, whatever stream it ran on.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator

import numpy as np

from .errors import check

SLOTS = 4
"""Slots in the ring: launches on different streams can overlap this many deep."""

_MIN_BYTES = 64 << 10


class StagingSlot:
    """One slot: `host` (pinned, numpy uint8), `device` (address), both `capacity` bytes."""

    def __init__(self) -> None:
        self.capacity = 0
        self.host_address = 0
        self.host: np.ndarray | None = None
        self.device = 0
        self.event: Any = None
        self.pending = False

    def release(self) -> None:
        """Free both buffers and the event (after waiting for the event)."""
        from cuda.bindings import driver

        if self.pending:
            check(driver.cuEventSynchronize(self.event), "cuEventSynchronize")
            self.pending = False
        self.free_buffers()
        if self.event is not None:
            check(driver.cuEventDestroy(self.event), "cuEventDestroy")
            self.event = None

    def free_buffers(self) -> None:
        """Free the device and pinned host buffers (the slot must be idle); capacity 0."""
        from cuda.bindings import driver

        if self.device:
            check(driver.cuMemFree(self.device), "cuMemFree")
            self.device = 0
        if self.host_address:
            check(driver.cuMemFreeHost(self.host_address), "cuMemFreeHost")
            self.host_address, self.host = 0, None
        self.capacity = 0


class StagingRing:
    """Hands out slots round-robin; `acquire(nbytes)` waits for the slot's last use and
    grows it to at least `nbytes`. Callers hold the backend's lock around acquire..record."""

    def __init__(self) -> None:
        self._slots = [StagingSlot() for _ in range(SLOTS)]
        self._next = 0

    def acquire(self, nbytes: int) -> StagingSlot:
        """The next slot, idle and at least `nbytes` long on both sides."""
        from cuda.bindings import driver

        slot = self._slots[self._next]
        self._next = (self._next + 1) % SLOTS
        if slot.event is None:
            slot.event = check(driver.cuEventCreate(2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        if slot.pending:
            check(driver.cuEventSynchronize(slot.event), "cuEventSynchronize")
            slot.pending = False
        if nbytes > slot.capacity:
            self._grow(slot, max(nbytes, 2 * slot.capacity, _MIN_BYTES))
        return slot

    @staticmethod
    def _grow(slot: StagingSlot, capacity: int) -> None:
        from cuda.bindings import driver

        capacity = -(-capacity // 256) * 256
        slot.free_buffers()
        slot.host_address = int(check(driver.cuMemHostAlloc(capacity, 0), "cuMemHostAlloc", f"staging {capacity} bytes"))
        slot.host = np.ctypeslib.as_array((ctypes.c_uint8 * capacity).from_address(slot.host_address))
        slot.device = int(check(driver.cuMemAlloc(capacity), "cuMemAlloc", f"staging {capacity} bytes"))
        slot.capacity = capacity

    @staticmethod
    def record(slot: StagingSlot, stream: Any) -> None:
        """Mark the slot in use until the work now enqueued on `stream` completes."""
        from cuda.bindings import driver

        check(driver.cuEventRecord(slot.event, stream), "cuEventRecord")
        slot.pending = True

    @contextlib.contextmanager
    def in_use(self, nbytes: int, stream: Any) -> Iterator[StagingSlot]:
        """A slot for work the block enqueues on `stream`. On leaving the block, normally or
        by an exception (a failed launch after a queued upload), the slot is marked in use
        until that work completes; if even the event cannot be recorded, the stream is
        waited for, so a queued copy can never race the slot's next user."""
        from cuda.bindings import driver

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
        """Release every slot, attempting all; the first error is raised."""
        first = None
        for slot in self._slots:
            try:
                slot.release()
            except Exception as err:  # noqa: BLE001 - every slot must be attempted
                first = first or err
        if first is not None:
            raise first
