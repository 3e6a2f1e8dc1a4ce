"""Host-tier swaps of CudaBackend: swap memory (mapped pinned host memory), the batched
range copy and events (the "host_tier" capability).

`copy_batch_async` is one driver call however many ranges it has: `cuMemcpyBatchAsync`
(memcpy_batch.py) when the driver has it, else one launch of `pagedkv_copy_batch`
(nvrtc_src/copy_batch.cu), which reads its descriptor from a mapped staging slot and
reaches swap memory through its device pointer. The legacy default stream, which
cuMemcpyBatchAsync refuses, always takes the kernel; `CudaBackend(copy_batch="kernel")`
or `PAGEDKV_COPY_BATCH=kernel` forces the kernel everywhere.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from ..backends.protocol import check_alloc_size
from ..errors import DeviceMemoryError
from ._bindings import CU_STREAM_LEGACY
from ..backends.batch_ranges import AddressTable, as_ranges, check_overlaps
from .errors import check
from .memcpy_batch import MemcpyBatch, resolve
from .pinned import PinnedBuffer
from ..core.log import get_logger
from .swap_memory import SwapMemory

COPY_BATCH_ENV = "PAGEDKV_COPY_BATCH"
"""Environment variable: `kernel` forces the copy kernel for `copy_batch_async`; `auto`
(the default) uses cuMemcpyBatchAsync where the driver has it."""

COPY_BATCH_MODES = ("auto", "kernel")

COPY_BATCH_CHUNK = 64 << 10
"""Bytes of one work item of the copy kernel (a multiple of 16)."""

_KERNEL = "pagedkv_copy_batch"
_log = get_logger("cuda")
_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02
_CUDA_ERROR_NOT_READY = 600
_EVENT_DISABLE_TIMING = 2
_INT64_MAX = 2**63 - 1


def copy_batch_mode(mode: str | None) -> str:
    """The copy_batch mode: `mode` if given, else $PAGEDKV_COPY_BATCH, else "auto";
    ValueError naming anything other than "auto" or "kernel"."""
    chosen = mode if mode is not None else (os.environ.get(COPY_BATCH_ENV) or "auto")
    if chosen not in COPY_BATCH_MODES:
        source = "copy_batch" if mode is not None else COPY_BATCH_ENV
        raise ValueError(f"{source}={chosen!r}: expected one of {COPY_BATCH_MODES}")
    return chosen


class HostSwaps:
    """The host-tier half of CudaBackend (a mixin: CudaBackend provides `_enter`, `_lock`,
    `_stream`, `_allocs`, `_launchers`, `_grid`, `_mapped_staging`, `device_ordinal` and
    the dicts and `_memcpy_batch` it initialises)."""

    _swap: dict[int, SwapMemory]
    _events: dict[int, Any]
    _memcpy_batch: MemcpyBatch | None

    def _resolve_copy_batch(self, mode: str) -> None:
        """Construction: find cuMemcpyBatchAsync unless the kernel is forced."""
        self._memcpy_batch = None if mode == "kernel" else resolve(self._enter())

    @property
    def copy_batch_path(self) -> str:
        """"driver" when `copy_batch_async` calls cuMemcpyBatchAsync on streams other than
        the legacy default one, "kernel" when it always launches the copy kernel."""
        return "kernel" if self._memcpy_batch is None else "driver"

    # -- swap memory ---------------------------------------------------------------------

    def alloc_swap_memory(self, nbytes: int) -> SwapMemory:
        """`nbytes` of page-locked host memory mapped into the device
        (`cuMemHostAlloc(PORTABLE | DEVICEMAP)`, device pointer from
        `cuMemHostGetDevicePointer`), recorded until its `free()` succeeds and freed at
        `close()`. ValueError naming `nbytes` unless positive; CudaOutOfMemory (a
        DeviceOutOfMemory) when the host cannot give it."""
        nbytes = check_alloc_size(nbytes)
        driver = self._enter()
        flags = _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP
        address = int(check(driver.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc", f"swap memory of {nbytes} bytes"))
        try:
            device = int(check(driver.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))
        except BaseException:
            freed = driver.cuMemFreeHost(address)
            if int(getattr(freed[0], "value", freed[0])) != 0:  # kept as pinned memory: close() frees it
                with self._lock:
                    self._pinned[address] = PinnedBuffer(address, nbytes, self._free_pinned)
            raise
        memory = SwapMemory(address, device, nbytes, self._free_swap)
        with self._lock:
            self._swap[address] = memory
        return memory

    def _free_swap(self, memory: SwapMemory) -> None:
        with self._lock:
            if self._swap.get(memory.address) is not memory:
                raise DeviceMemoryError(f"{memory!r} is not swap memory of this backend")
            driver = self._enter()
            check(driver.cuMemFreeHost(memory.address), "cuMemFreeHost", repr(memory))
            del self._swap[memory.address]

    def live_swap_memories(self) -> int:
        """How many SwapMemory objects of this backend are live now."""
        return len(self._swap)

    def _in_swap_memory(self, address: int, nbytes: int) -> bool:
        with self._lock:
            return any(m.contains(address, nbytes) for m in self._swap.values())

    def _address_table(self) -> AddressTable:
        """Every span a batch may touch now: device allocations, mapped VMM chunks and swap
        memories (the caller holds the lock)."""
        spans = [(base, size, 0, False) for base, size in self._allocs.items()]
        space = getattr(self, "_vmm_space", None)
        if space is not None:
            spans += [(base, size, 0, False) for base, size in space.mapped_spans()]
        spans += [(m.address, m.nbytes, m.device_address - m.address, True) for m in self._swap.values()]
        return AddressTable(spans)

    # -- the batched copy ----------------------------------------------------------------

    def copy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int) -> None:
        """Copy `sizes[i]` bytes from `srcs[i]` to `dsts[i]` for every i, in one driver call
        on `stream` (cuMemcpyBatchAsync, or one launch of the copy kernel); the ranges run
        in no particular order among themselves, after the work queued on `stream` before.
        Each range must lie inside one live device allocation (or mapped VMM chunk) or one
        live SwapMemory of this backend (IndexError naming the range and the address);
        destinations overlapping each other or a source raise ValueError; unequal lengths
        or negative values ValueError. Everything is checked before anything is enqueued;
        no range (or only ranges of 0 bytes) does nothing."""
        handle = self._stream(stream)
        d, s, n, index = as_ranges(dsts, srcs, sizes)
        if d.size == 0:
            return
        with self._lock:
            self._enter()
            table = self._address_table()
            dst_span = table.locate(d, n, index, "destination")
            src_span = table.locate(s, n, index, "source")
            check_overlaps(d, s, n, index)
            legacy = int(handle) in (0, CU_STREAM_LEGACY)
            if self._memcpy_batch is not None and not legacy:
                self._memcpy_batch(d, s, n, table.is_host[src_span], table.is_host[dst_span],
                                   self.device_ordinal, int(handle))
                return
            self._launch_copy_batch(table.device_addresses(d, dst_span), table.device_addresses(s, src_span), n, handle)

    def _launch_copy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, handle: Any) -> None:
        """One launch of the copy kernel, its descriptor written into a mapped staging slot
        (reused only once the launch has run); the caller holds the lock."""
        count = dsts.size
        chunks = (sizes + np.uint64(COPY_BATCH_CHUNK - 1)) // np.uint64(COPY_BATCH_CHUNK)
        first = np.zeros(count + 1, dtype=np.uint64)
        np.cumsum(chunks, out=first[1:])
        total = int(first[-1])
        if total > _INT64_MAX:
            raise ValueError(f"copy_batch_async of {int(sizes.sum())} bytes is beyond the copy kernel's reach")
        descriptor = np.concatenate([dsts, srcs, sizes, first]).astype(np.uint64)
        with self._mapped_staging.in_use(descriptor.nbytes, handle) as slot:
            slot.host[: descriptor.nbytes] = descriptor.view(np.uint8)
            self._launchers[_KERNEL].launch(
                self._grid(_KERNEL, total), handle, ranges=slot.device, count=count, chunk=COPY_BATCH_CHUNK,
            )

    # -- events --------------------------------------------------------------------------

    def record_event(self, stream: int) -> int:
        """A new event recorded on `stream` now (cuEventCreate without timing, then
        cuEventRecord): an int handle for `event_done`, `wait_event`, `stream_wait_event`;
        destroy it with `destroy_event` (close() destroys those left)."""
        handle = self._stream(stream)
        driver = self._enter()
        event = check(driver.cuEventCreate(_EVENT_DISABLE_TIMING), "cuEventCreate")
        with self._lock:
            self._events[int(event)] = event  # recorded first: every failure path keeps it until destroyed
        try:
            check(driver.cuEventRecord(event, handle), "cuEventRecord")
        except BaseException:
            try:
                self.destroy_event(int(event))
            except Exception as err:  # noqa: BLE001 - the record error is the one to raise
                _log.error("cuda_event_destroy_failed", error=str(err))  # recorded: close() retries it
            raise
        return int(event)

    def _event(self, event: int) -> Any:
        with self._lock:
            found = self._events.get(event) if isinstance(event, int) else None
        if found is None:
            raise ValueError(f"unknown event {event!r}: not made by record_event of this backend, or destroyed")
        return found

    def event_done(self, event: int) -> bool:
        """True once the work before the event has run (cuEventQuery); never blocks."""
        found = self._event(event)
        driver = self._enter()
        result = driver.cuEventQuery(found)
        if int(getattr(result[0], "value", result[0])) == _CUDA_ERROR_NOT_READY:
            return False
        check(result, "cuEventQuery")
        return True

    def wait_event(self, event: int) -> None:
        """The host waits for the work before the event (cuEventSynchronize)."""
        found = self._event(event)
        driver = self._enter()
        check(driver.cuEventSynchronize(found), "cuEventSynchronize")

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work enqueued on `stream` after this call waits for the event (cuStreamWaitEvent);
        nothing blocks."""
        found = self._event(event)
        handle = self._stream(stream)
        driver = self._enter()
        check(driver.cuStreamWaitEvent(handle, found, 0), "cuStreamWaitEvent")

    def destroy_event(self, event: int) -> None:
        """Destroy an event of `record_event` (queued waits on it still hold); ValueError
        naming an unknown or destroyed handle. It stays recorded if the driver refuses."""
        found = self._event(event)
        driver = self._enter()
        check(driver.cuEventDestroy(found), "cuEventDestroy")
        with self._lock:
            self._events.pop(event, None)

    def live_events(self) -> int:
        """How many events of `record_event` are not destroyed yet."""
        return len(self._events)
