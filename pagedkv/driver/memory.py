"""Memory, streams and copies of CudaBackend: device and pinned allocations, streams,
memsets and host/device copies, all direct driver calls.

Stream 0 is the legacy default stream, passed to the driver as CU_STREAM_LEGACY so it is
the same stream whatever CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM says. The synchronous
host copies are queued on that stream and waited for: they run after the work already
queued on every blocking stream, by the legacy stream's own rule, not by relying on what
handle 0 happens to mean.
"""

from __future__ import annotations

import bisect
from typing import Any

from ..backends.protocol import DevicePtr, check_alloc_size, check_byte_count, check_fill_byte, host_bytes
from ..errors import DeviceMemoryError
from ..core.streams import is_stream_object, stream_handle
from ._bindings import CU_STREAM_LEGACY, driver as _driver
from .errors import check
from .pinned import PinnedBuffer


_EVENT_DISABLE_TIMING = 2


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _host_view(buf: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, keep-alive) of a C-contiguous host buffer or PinnedBuffer
    (SwapMemory is one)."""
    if isinstance(buf, PinnedBuffer):
        buf = buf.array
    arr = host_bytes(buf, writable)
    return arr.ctypes.data, arr.nbytes, arr


class MemoryAndCopies:
    """The memory, stream and copy half of CudaBackend (a mixin: CudaBackend provides
    `_enter`, `_lock` and the bookkeeping dicts it initialises)."""

    _allocs: dict[int, int]
    _alloc_bases: list[int]
    _pinned: dict[int, PinnedBuffer]
    _streams: dict[int, Any]
    _events: dict[int, Any]

    # -- memory ---------------------------------------------------------------------

    def alloc(self, nbytes: int) -> DevicePtr:
        """`cuMemAlloc` of `nbytes`; CudaOutOfMemory (a CudaError and a DeviceOutOfMemory) when it fails for lack of memory."""
        nbytes = check_alloc_size(nbytes)
        driver = self._enter()
        ptr = int(check(driver.cuMemAlloc(nbytes), "cuMemAlloc", f"asking {_gib(nbytes)}"))
        with self._lock:
            self._allocs[ptr] = nbytes
            bisect.insort(self._alloc_bases, ptr)
        return DevicePtr(ptr)

    def free(self, ptr: DevicePtr) -> None:
        """`cuMemFree` of an allocation made by this backend; anything else raises DeviceMemoryError."""
        address = int(ptr)
        with self._lock:
            if address not in self._allocs:
                raise DeviceMemoryError(f"free of {DevicePtr(address)!r}: not an allocation of this backend, or already freed")
            driver = self._enter()
            # recorded until the driver says it is gone: a failed free can be retried
            check(driver.cuMemFree(address), "cuMemFree", f"{DevicePtr(address)!r}")
            del self._allocs[address]
            self._alloc_bases.remove(address)

    def live_allocations(self) -> int:
        """How many allocations made by `alloc` are live now."""
        return len(self._allocs)

    def _allocation_end(self, address: int) -> int | None:
        """End address of the live allocation holding `address`, or None (foreign memory)."""
        i = bisect.bisect_right(self._alloc_bases, address) - 1
        if i >= 0:
            base = self._alloc_bases[i]
            end = base + self._allocs[base]
            if address < end:
                return end
        return None

    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device, from cuMemGetInfo."""
        driver = self._enter()
        free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def alloc_pinned(self, nbytes: int) -> PinnedBuffer:
        """Page-locked host memory (`cuMemHostAlloc`) for the async host copies."""
        nbytes = check_alloc_size(nbytes)
        driver = self._enter()
        address = int(check(driver.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc", f"asking {_gib(nbytes)}"))
        buf = PinnedBuffer(address, nbytes, self._free_pinned)
        with self._lock:
            self._pinned[address] = buf
        return buf

    def _free_pinned(self, buf: PinnedBuffer) -> None:
        with self._lock:
            driver = self._enter()
            check(driver.cuMemFreeHost(buf.address), "cuMemFreeHost")  # recorded until it succeeds
            self._pinned.pop(buf.address, None)

    def _require_pinned(self, address: int, nbytes: int) -> None:
        with self._lock:
            if not any(b.contains(address, nbytes) for b in self._pinned.values()) and not self._in_swap_memory(address, nbytes):
                raise ValueError(
                    "async host copies need page-locked memory: pass a PinnedBuffer from alloc_pinned (or a view of one)"
                )

    # -- streams --------------------------------------------------------------------

    def default_stream(self) -> int:
        """0, the legacy default stream (CU_STREAM_LEGACY to the driver)."""
        return 0

    def create_stream(self) -> int:
        """A new stream (`cuStreamCreate`, blocking with respect to the default stream)."""
        driver = self._enter()
        stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
        handle = int(stream)
        with self._lock:
            self._streams[handle] = stream
        return handle

    def destroy_stream(self, stream: int) -> None:
        """Destroy a stream made by `create_stream`; 0 or an unknown handle raises ValueError."""
        with self._lock:
            handle = self._streams.get(stream) if stream != 0 else None
            if handle is None:
                raise ValueError(f"cannot destroy stream {stream!r}: not a stream made by create_stream")
            driver = self._enter()
            check(driver.cuStreamDestroy(handle), "cuStreamDestroy")  # recorded until it succeeds
            self._streams.pop(stream, None)

    def _stream(self, stream: int) -> Any:
        if is_stream_object(stream):  # another library's stream, named by __cuda_stream__
            return self._any_stream(stream_handle(stream))
        if stream == 0:
            return CU_STREAM_LEGACY
        handle = self._streams.get(stream)
        if handle is None:
            raise ValueError(f"unknown stream {stream!r}")
        return handle

    def _any_stream(self, handle: int) -> Any:
        """The driver handle of stream `handle`: one of ours, 0 (the legacy default stream,
        passed as CU_STREAM_LEGACY), or any other CUstream value of this context (1 legacy,
        2 per-thread, or another library's stream)."""
        if handle == 0:
            return CU_STREAM_LEGACY
        with self._lock:
            ours = self._streams.get(handle)
        if ours is not None:
            return ours
        return _driver.CUstream(handle)

    def make_stream_wait(self, waiting: Any, on: Any) -> None:
        """Make stream `waiting` (an int handle of any stream of this context, another
        library's included, or a `__cuda_stream__` object) wait for the work enqueued so far
        on stream `on` (one of this backend's): `cuEventRecord` on `on`, `cuStreamWaitEvent`
        on `waiting`, then the event is destroyed (the wait stays). Nothing is enqueued when
        both are the same stream (0 and 1 both name the legacy default stream)."""
        producer = self._stream(on)
        consumer = self._any_stream(stream_handle(waiting))
        p, c = int(producer), int(consumer)
        if p == c or {p, c} <= {0, 1}:
            return
        driver = self._enter()
        event = check(driver.cuEventCreate(_EVENT_DISABLE_TIMING), "cuEventCreate")
        try:
            check(driver.cuEventRecord(event, producer), "cuEventRecord")
            check(driver.cuStreamWaitEvent(consumer, event, 0), "cuStreamWaitEvent")
        finally:
            destroyed = driver.cuEventDestroy(event)
            if int(getattr(destroyed[0], "value", destroyed[0])) != 0:
                with self._lock:
                    self._events[int(event)] = event  # kept: destroy_event or close() retries it
        check(destroyed, "cuEventDestroy")

    def synchronize(self, stream: int) -> None:
        """Wait for the stream's work (`cuStreamSynchronize`)."""
        handle = self._stream(stream)
        driver = self._enter()
        check(driver.cuStreamSynchronize(handle), "cuStreamSynchronize")

    def synchronize_all(self) -> None:
        """Wait for the work of every stream this backend made and of the default stream:
        call it before freeing memory that queued work may still touch."""
        driver = self._enter()
        with self._lock:
            handles = list(self._streams.values())
        for handle in (*handles, CU_STREAM_LEGACY):
            check(driver.cuStreamSynchronize(handle), "cuStreamSynchronize")

    # -- copies and memset ----------------------------------------------------------

    def memset_async(self, ptr: DevicePtr, value: int, nbytes: int, stream: int) -> None:
        """`cuMemsetD8Async` of `nbytes` bytes at `ptr` to `value`."""
        value = check_fill_byte(value)
        nbytes = check_byte_count(nbytes)
        handle = self._stream(stream)
        if nbytes:
            driver = self._enter()
            check(driver.cuMemsetD8Async(int(ptr), value, nbytes, handle), "cuMemsetD8Async")

    def copy_h2d(self, src: Any, dst: DevicePtr) -> None:
        """Copy every byte of `src` (pageable or pinned) to `dst`, after the work queued on
        the default and every blocking stream; returns when done."""
        address, nbytes, keep = _host_view(src, writable=False)
        if nbytes:
            driver = self._enter()
            check(driver.cuMemcpyHtoDAsync(int(dst), address, nbytes, CU_STREAM_LEGACY), "cuMemcpyHtoDAsync", f"{nbytes} bytes")
            check(driver.cuStreamSynchronize(CU_STREAM_LEGACY), "cuStreamSynchronize")
        del keep

    def copy_d2h(self, src: DevicePtr, dst: Any) -> None:
        """Fill `dst` (pageable or pinned) from `src`, after the work queued on the default
        and every blocking stream; returns when done."""
        address, nbytes, keep = _host_view(dst, writable=True)
        if nbytes:
            driver = self._enter()
            check(driver.cuMemcpyDtoHAsync(address, int(src), nbytes, CU_STREAM_LEGACY), "cuMemcpyDtoHAsync", f"{nbytes} bytes")
            check(driver.cuStreamSynchronize(CU_STREAM_LEGACY), "cuStreamSynchronize")
        del keep

    def copy_h2d_async(self, src: Any, dst: DevicePtr, stream: int) -> None:
        """`cuMemcpyHtoDAsync` from pinned memory (a PinnedBuffer or a view of one); the
        source must stay unchanged until the stream reaches the copy."""
        address, nbytes, _ = _host_view(src, writable=False)
        if nbytes:
            self._require_pinned(address, nbytes)
            driver = self._enter()
            check(driver.cuMemcpyHtoDAsync(int(dst), address, nbytes, self._stream(stream)), "cuMemcpyHtoDAsync")

    def copy_d2h_async(self, src: DevicePtr, dst: Any, stream: int) -> None:
        """`cuMemcpyDtoHAsync` into pinned memory; the data is there after `synchronize(stream)`."""
        address, nbytes, _ = _host_view(dst, writable=True)
        if nbytes:
            self._require_pinned(address, nbytes)
            driver = self._enter()
            check(driver.cuMemcpyDtoHAsync(address, int(src), nbytes, self._stream(stream)), "cuMemcpyDtoHAsync")

    def copy_d2d(self, src: DevicePtr, dst: DevicePtr, nbytes: int, stream: int) -> None:
        """`cuMemcpyDtoDAsync` of `nbytes` on `stream`."""
        nbytes = check_byte_count(nbytes)
        handle = self._stream(stream)
        if nbytes:
            driver = self._enter()
            check(driver.cuMemcpyDtoDAsync(int(dst), int(src), nbytes, handle), "cuMemcpyDtoDAsync")
