"""CudaBackend: the GpuBackend contract on an NVIDIA GPU through the CUDA driver API.

Memory, copies and streams are direct driver calls (`cuda.bindings.driver`); the block
kernels (fill, copy, BF16 reduction) are NVRTC-compiled from `pagedkv/nvrtc_src` for the
device's own architecture. The backend works in the device's primary context, so it
shares memory and streams with any other library in the process.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Sequence

import numpy as np

from ..backend import (
    Bf16Stats,
    BlockRegions,
    DevicePtr,
    as_block_array,
    check_alloc_size,
    check_byte_count,
    check_copy_pairs,
    check_fill_byte,
    host_bytes,
)
from ..errors import DeviceMemoryError
from ..log import get_logger
from ..streams import is_stream_object, stream_handle
from ..validate import index_in_range, non_negative_int
from . import nvrtc
from .errors import CudaError, CudaUnavailable, check, driver_status_text
from .launch import CopyArgs, FillArgs, KernelLauncher, ReduceFinalArgs, ReducePartialArgs
from .pinned import PinnedBuffer
from .staging import StagingRing, StagingSlot

THREADS = 256
"""Threads per CTA of every block kernel (REDUCE_THREADS in reduce_bf16.cu)."""

CTAS_PER_SM = 16
"""Fill and copy grids are capped at this many CTAs per SM (grid-stride beyond)."""

REDUCE_CTAS_PER_SM = 8
"""The reduction's first pass is capped at this many CTAs per SM."""

_INT32_MAX = 2**31 - 1
_EVENT_DISABLE_TIMING = 2
_CUDA_ERROR_NO_DEVICE = 100
_ATTR_SM_COUNT = 16
_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76

# kernel source file -> (kernel name, argument structure) of each kernel it defines
KERNELS = {
    "fill_blocks.cu": [("pagedkv_fill_blocks", FillArgs)],
    "copy_blocks.cu": [("pagedkv_copy_blocks", CopyArgs)],
    "reduce_bf16.cu": [
        ("pagedkv_reduce_bf16_partial", ReducePartialArgs),
        ("pagedkv_reduce_bf16_final", ReduceFinalArgs),
    ],
}

_log = get_logger("cuda")
_THREAD = threading.local()  # .backend: id of the backend whose context this thread made current
_NEXT_ID = iter(range(1, 2**62))


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _load_driver():
    """The cuda.bindings driver module, initialised; CudaUnavailable in one sentence if not."""
    try:
        from cuda.bindings import driver
    except ImportError as err:
        raise CudaUnavailable(
            f"cuda-bindings is not installed ({err}); install pagedkv[cu13] or pagedkv[cu12]."
        ) from None
    try:
        result = driver.cuInit(0)
    except Exception as err:  # noqa: BLE001 - pathfinder raises its own types when libcuda is absent
        raise CudaUnavailable(
            f"No NVIDIA driver on this machine: libcuda.so.1 could not be loaded ({type(err).__name__})."
        ) from None
    status = int(result[0] if isinstance(result, tuple) else result)
    if status == _CUDA_ERROR_NO_DEVICE:
        raise CudaUnavailable("The NVIDIA driver is installed but reports no GPU (CUDA_ERROR_NO_DEVICE).")
    if status != 0:
        name, message = driver_status_text(status)
        raise CudaUnavailable(f"The NVIDIA driver did not start: cuInit returned {name} ({message}).")
    return driver


def _host_view(buf: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, keep-alive) of a C-contiguous host buffer or PinnedBuffer."""
    if isinstance(buf, PinnedBuffer):
        buf = buf.array
    arr = host_bytes(buf, writable)
    return arr.ctypes.data, arr.nbytes, arr


def _int32_indices(idx: np.ndarray, what: str) -> np.ndarray:
    if idx.size and int(idx.max()) > _INT32_MAX:
        raise ValueError(f"{what} holds block index {int(idx.max())}, above the kernels' limit {_INT32_MAX}")
    return idx.astype(np.int32)


class CudaBackend:
    """The GpuBackend of one CUDA device (`device` ordinal), in its primary context.

    Construction initialises the driver, retains the primary context and loads the
    kernels (compiled by NVRTC or taken from the kernel cache); `close()` (or leaving a
    `with` block) frees what the backend still holds and releases the context. Any
    thread may call in: the context is made current on each thread's first call.
    Streams are int handles (0 is the legacy default stream). `device_name`,
    `compute_capability` (major, minor) and `sm_count` describe the device.
    """

    def __init__(self, device: int = 0, kernel_cache_dir: str | None = None):
        device = non_negative_int(device, "device")
        self._closed = True  # until construction completes
        self._id = next(_NEXT_ID)
        self._lock = threading.RLock()
        self._allocs: dict[int, int] = {}
        self._alloc_bases: list[int] = []
        self._pinned: dict[int, PinnedBuffer] = {}
        self._streams: dict[int, Any] = {}
        self._region_limits: dict[int, int] = {}
        self._modules: list[Any] = []
        self._launchers: dict[str, KernelLauncher] = {}
        self._staging = StagingRing()
        self._ctx = None
        drv = _load_driver()
        count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if device >= count:
            raise CudaUnavailable(f"CUDA device {device} does not exist: this machine has {count} GPU(s).")
        self._device = check(drv.cuDeviceGet(device), "cuDeviceGet", f"device {device}")
        self.device_ordinal = device
        self._ctx = check(drv.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        try:
            check(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            _THREAD.backend = self._id
            raw = check(drv.cuDeviceGetName(256, self._device), "cuDeviceGetName")
            self.device_name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
            major = self._attribute(drv, _ATTR_CC_MAJOR)
            minor = self._attribute(drv, _ATTR_CC_MINOR)
            self.compute_capability = (major, minor)
            self.sm_count = self._attribute(drv, _ATTR_SM_COUNT)
            self._closed = False
            self._load_kernels(drv, kernel_cache_dir)
        except BaseException:
            self._closed = False
            try:
                self.close()
            except Exception as err:  # noqa: BLE001 - the construction error is the one to raise
                _log.error("cuda_backend_cleanup_failed", error=str(err))
            raise
        _log.info(
            "cuda_backend_ready",
            device=device,
            name=self.device_name,
            compute_capability=f"{major}.{minor}",
            sms=self.sm_count,
        )

    def _attribute(self, drv, attribute: int) -> int:
        attr = drv.CUdevice_attribute(attribute)
        return int(check(drv.cuDeviceGetAttribute(attr, self._device), "cuDeviceGetAttribute", attr.name))

    def _load_kernels(self, drv, cache_dir: str | None) -> None:
        arch = nvrtc.arch_option(*self.compute_capability)
        from pathlib import Path

        for filename, kernels in KERNELS.items():
            compiled = nvrtc.compile_cached(nvrtc.SOURCE_DIR / filename, arch, Path(cache_dir) if cache_dir else None)
            module = check(drv.cuModuleLoadData(compiled.cubin), "cuModuleLoadData", filename)
            self._modules.append(module)
            for name, args_type in kernels:
                function = check(drv.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction", name)
                self._launchers[name] = KernelLauncher(name, function, args_type)

    # -- lifetime -------------------------------------------------------------------

    def _enter(self):
        """The driver module, with the primary context current on the calling thread."""
        if self._closed:
            raise CudaError("CudaBackend", 201, "CUDA_ERROR_INVALID_CONTEXT", "the backend is closed")
        from cuda.bindings import driver

        if getattr(_THREAD, "backend", None) != self._id:
            check(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            _THREAD.backend = self._id
        return driver

    def close(self) -> None:
        """Free the staging buffers, every allocation, pinned buffer and stream still held,
        unload the kernels and release the primary context (all attempted; first error
        raised). A second call does nothing."""
        if self._closed:
            return
        from cuda.bindings import driver

        first: BaseException | None = None

        def attempt(action, *args) -> None:
            nonlocal first
            try:
                action(*args)
            except Exception as err:  # noqa: BLE001 - everything must be attempted
                first = first or err
                _log.error("cuda_close_step_failed", error=str(err))

        try:
            self._close_resources(driver, attempt)
        finally:
            self._closed = True
            if self._ctx is not None:
                attempt(lambda: check(driver.cuDevicePrimaryCtxRelease(self._device), "cuDevicePrimaryCtxRelease"))
                self._ctx = None
                if getattr(_THREAD, "backend", None) == self._id:
                    _THREAD.backend = None
        if first is not None:
            raise first

    def _close_resources(self, driver, attempt) -> None:
        """Free everything held, each step through `attempt`; the primary context is made
        current first (if that fails, the frees are still attempted)."""
        if self._ctx is not None:
            attempt(self._enter)
        attempt(lambda: check(driver.cuCtxSynchronize(), "cuCtxSynchronize"))
        attempt(self._staging.close)
        leaked = len(self._allocs) + len(self._pinned) + len(self._streams)
        if leaked:
            _log.warning(
                "cuda_close_freeing_leftovers",
                allocations=len(self._allocs),
                pinned=len(self._pinned),
                streams=len(self._streams),
            )
        for ptr in list(self._allocs):
            attempt(self.free, DevicePtr(ptr))
        self._release_reservations(attempt)
        for buf in list(self._pinned.values()):
            attempt(buf.free)
        for handle in list(self._streams):
            attempt(self.destroy_stream, handle)
        for module in self._modules:
            attempt(lambda m=module: check(driver.cuModuleUnload(m), "cuModuleUnload"))
        self._modules, self._launchers = [], {}

    def __enter__(self) -> "CudaBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True after `close()`."""
        return self._closed

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
            del self._allocs[address]
            self._alloc_bases.remove(address)
        driver = self._enter()
        check(driver.cuMemFree(address), "cuMemFree", f"{DevicePtr(address)!r}")

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
            self._pinned.pop(buf.address, None)
        driver = self._enter()
        check(driver.cuMemFreeHost(buf.address), "cuMemFreeHost")

    def _require_pinned(self, address: int, nbytes: int) -> None:
        with self._lock:
            if not any(b.contains(address, nbytes) for b in self._pinned.values()):
                raise ValueError(
                    "async host copies need page-locked memory: pass a PinnedBuffer from alloc_pinned (or a view of one)"
                )

    # -- streams --------------------------------------------------------------------

    def default_stream(self) -> int:
        """0, the legacy default stream."""
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
            handle = self._streams.pop(stream, None) if stream != 0 else None
        if handle is None:
            raise ValueError(f"cannot destroy stream {stream!r}: not a stream made by create_stream")
        driver = self._enter()
        check(driver.cuStreamDestroy(handle), "cuStreamDestroy")

    def _stream(self, stream: int) -> Any:
        if is_stream_object(stream):  # another library's stream, named by __cuda_stream__
            return self._any_stream(stream_handle(stream))
        if stream == 0:
            return 0
        handle = self._streams.get(stream)
        if handle is None:
            raise ValueError(f"unknown stream {stream!r}")
        return handle

    def _any_stream(self, handle: int) -> Any:
        """The driver handle of stream `handle`: one of ours, 0, or any other CUstream value
        of this context (1 legacy, 2 per-thread, or another library's stream)."""
        if handle == 0:
            return 0
        with self._lock:
            ours = self._streams.get(handle)
        if ours is not None:
            return ours
        from cuda.bindings import driver

        return driver.CUstream(handle)

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
        check(destroyed, "cuEventDestroy")

    def synchronize(self, stream: int) -> None:
        """Wait for the stream's work (`cuStreamSynchronize`)."""
        driver = self._enter()
        check(driver.cuStreamSynchronize(self._stream(stream)), "cuStreamSynchronize")

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
        """Synchronous `cuMemcpyHtoD` of every byte of `src` (pageable or pinned)."""
        address, nbytes, keep = _host_view(src, writable=False)
        if nbytes:
            driver = self._enter()
            check(driver.cuMemcpyHtoD(int(dst), address, nbytes), "cuMemcpyHtoD", f"{nbytes} bytes")
        del keep

    def copy_d2h(self, src: DevicePtr, dst: Any) -> None:
        """Synchronous `cuMemcpyDtoH` filling `dst` (pageable or pinned)."""
        address, nbytes, keep = _host_view(dst, writable=True)
        if nbytes:
            driver = self._enter()
            check(driver.cuMemcpyDtoH(address, int(src), nbytes), "cuMemcpyDtoH", f"{nbytes} bytes")
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

    # -- block kernels --------------------------------------------------------------

    def create_block_regions(self, rows: Sequence[tuple[int, int, int]]) -> BlockRegions:
        """A region table whose `(base, stride, nbytes)` rows are uploaded once to a device
        buffer (`device_table`); rows inside this backend's allocations also bound the
        block indices the kernels accept."""
        regions = BlockRegions.from_rows(rows)
        if len(regions) == 0:
            return regions
        if len(regions) > _INT32_MAX:
            raise ValueError(f"{len(regions)} regions is above the kernels' limit {_INT32_MAX}")
        table = np.ascontiguousarray(np.stack([regions.bases, regions.strides, regions.nbytes], axis=1), dtype=np.int64)
        limit = self._block_limit(regions)
        ptr = self.alloc(table.nbytes)
        try:
            self.copy_h2d(table, ptr)
        except BaseException:
            self.free(ptr)
            raise
        regions.device_table = ptr
        with self._lock:
            self._region_limits[int(ptr)] = limit
        return regions

    def _block_limit(self, regions: BlockRegions) -> int:
        """The number of blocks every row has room for inside its allocation (rows outside
        this backend's allocations are not bounded)."""
        limit = _INT32_MAX + 1
        with self._lock:
            for base, stride, nbytes in zip(regions.bases.tolist(), regions.strides.tolist(), regions.nbytes.tolist()):
                end = self._allocation_end(base)
                if end is not None:
                    if base + nbytes > end:
                        raise ValueError(f"region at {DevicePtr(base)!r}: one block of {nbytes} bytes runs past its allocation")
                    limit = min(limit, (end - base - nbytes) // stride + 1)
        return limit

    def destroy_block_regions(self, regions: BlockRegions) -> None:
        """Free the table's device copy; a second call does nothing."""
        if regions.device_table is None:
            return
        ptr = regions.device_table
        regions.device_table = None
        with self._lock:
            self._region_limits.pop(int(ptr), None)
        self.free(ptr)

    def _table(self, regions: BlockRegions, top: int) -> int:
        """The device table of `regions`, after checking block index `top` fits every row."""
        if regions.device_table is None:
            raise ValueError("these BlockRegions have no device table: make them with create_block_regions")
        limit = self._region_limits.get(int(regions.device_table))
        if limit is None:
            raise ValueError("these BlockRegions belong to another backend or were destroyed")
        if top >= limit:
            raise IndexError(f"block {top} out of range: the regions hold {limit} blocks")
        return int(regions.device_table)

    def _grid(self, items: int, per_sm: int) -> int:
        return max(1, min(items, self.sm_count * per_sm))

    def fill_blocks(self, regions: BlockRegions, blocks: Sequence[int], value: int, stream: int) -> None:
        """Every byte of the listed blocks in every region set to `value`: one kernel launch."""
        byte = check_fill_byte(value)
        handle = self._stream(stream)
        idx = _int32_indices(as_block_array(blocks), "blocks")
        if idx.size == 0 or len(regions) == 0:
            return
        table = self._table(regions, int(idx.max()))
        self._enter()
        with self._lock, self._staging.in_use(idx.nbytes, handle) as slot:
            self._upload(slot, [idx], handle)
            self._launchers["pagedkv_fill_blocks"].launch(
                self._grid(len(regions) * idx.size, CTAS_PER_SM), THREADS, handle,
                table=table, num_rows=len(regions), blocks=slot.device, num_blocks=idx.size, value=byte,
            )

    def copy_blocks(self, regions: BlockRegions, src: Sequence[int], dst: Sequence[int], stream: int) -> None:
        """Block `src[i]` copied over `dst[i]` in every region: one kernel launch."""
        handle = self._stream(stream)
        s = as_block_array(src, "src")
        d = as_block_array(dst, "dst")
        check_copy_pairs(s, d)
        if s.size == 0 or len(regions) == 0:
            return
        s, d = _int32_indices(s, "src"), _int32_indices(d, "dst")
        table = self._table(regions, max(int(s.max()), int(d.max())))
        self._enter()
        with self._lock, self._staging.in_use(s.nbytes + d.nbytes, handle) as slot:
            self._upload(slot, [s, d], handle)
            self._launchers["pagedkv_copy_blocks"].launch(
                self._grid(len(regions) * s.size, CTAS_PER_SM), THREADS, handle,
                table=table, num_rows=len(regions), src=slot.device, dst=slot.device + s.nbytes, num_pairs=s.size,
            )

    def reduce_bf16_blocks(self, regions: BlockRegions, region: int, blocks: Sequence[int], stream: int) -> Bf16Stats:
        """Float64 sum, sum of squares and sum of |x| of the BF16 values in the listed
        blocks of row `region`: a partial pass over a fixed grid and one fixed-order final
        pass, so the same data gives bit-identical results; waits for the result."""
        handle = self._stream(stream)
        region = index_in_range(region, len(regions), "region", f"a table of {len(regions)} regions")
        nbytes = int(regions.nbytes[region])
        if nbytes % 2:
            raise ValueError(f"region {region} has an odd block size {nbytes}: not BF16")
        idx = _int32_indices(as_block_array(blocks), "blocks")
        if idx.size == 0:
            return Bf16Stats(0.0, 0.0, 0.0)
        self._table(regions, int(idx.max()))
        driver = self._enter()
        grid = self._grid(idx.size, REDUCE_CTAS_PER_SM)
        partials_at = -(-idx.nbytes // 16) * 16
        out_at = partials_at + 24 * grid
        with self._lock:
            with self._staging.in_use(out_at + 24, handle) as slot:
                self._upload(slot, [idx], handle)
                self._launchers["pagedkv_reduce_bf16_partial"].launch(
                    grid, THREADS, handle,
                    base=int(regions.bases[region]), stride=int(regions.strides[region]), nbytes=nbytes,
                    blocks=slot.device, num_blocks=idx.size, partials=slot.device + partials_at,
                )
                self._launchers["pagedkv_reduce_bf16_final"].launch(
                    1, THREADS, handle, partials=slot.device + partials_at, num_partials=grid, out=slot.device + out_at,
                )
                check(
                    driver.cuMemcpyDtoHAsync(slot.host_address + out_at, slot.device + out_at, 24, handle),
                    "cuMemcpyDtoHAsync",
                )
            check(driver.cuEventSynchronize(slot.event), "cuEventSynchronize")
            slot.pending = False
            result = slot.host[out_at : out_at + 24].view(np.float64).copy()
        return Bf16Stats(float(result[0]), float(result[1]), float(result[2]))

    def _upload(self, slot: StagingSlot, arrays: list[np.ndarray], stream: Any) -> None:
        """Concatenate `arrays` into the slot's pinned buffer and copy them to its device
        buffer on `stream`."""
        from cuda.bindings import driver

        at = 0
        for arr in arrays:
            slot.host[at : at + arr.nbytes] = arr.view(np.uint8)
            at += arr.nbytes
        check(driver.cuMemcpyHtoDAsync(slot.device, slot.host_address, at, stream), "cuMemcpyHtoDAsync")

    # -- virtual memory for elastic pools (ELASTIC; the driver calls live in vmm.py) ------

    def supports(self, name: str) -> bool:
        """Whether this backend has the optional feature `name`: "vmm" (reserve_address,
        map_chunk, unmap_chunk, release_address, vmm_granularity) when the device reports
        virtual memory management support."""
        if name != "vmm":
            return False
        from . import vmm

        with self._lock:
            return vmm.vmm_supported(self._enter(), self._device)

    def _virtual_memory(self):
        """This backend's `vmm.VirtualMemory`, made on first use."""
        space = getattr(self, "_vmm_space", None)
        if space is None:
            from .vmm import VirtualMemory

            space = self._vmm_space = VirtualMemory(self.device_ordinal)
        return space

    def vmm_granularity(self) -> int:
        """Bytes of the smallest chunk `map_chunk` maps (the device's minimum granularity)."""
        with self._lock:
            return self._virtual_memory().granularity(self._enter())

    def reserve_address(self, nbytes: int) -> DevicePtr:
        """`cuMemAddressReserve` of `nbytes` (a multiple of `vmm_granularity()`), nothing mapped."""
        with self._lock:
            return self._virtual_memory().reserve(self._enter(), nbytes)

    def map_chunk(self, ptr: DevicePtr, nbytes: int) -> None:
        """`cuMemCreate` + `cuMemMap` + `cuMemSetAccess` (read-write) of `nbytes` at `ptr`
        inside a reservation; CudaOutOfMemory with nothing created when the device is full."""
        with self._lock:
            self._virtual_memory().map(self._enter(), ptr, nbytes)

    def unmap_chunk(self, ptr: DevicePtr, nbytes: int) -> None:
        """`cuMemUnmap` + `cuMemRelease` of the chunk `map_chunk` mapped at `ptr`."""
        with self._lock:
            self._virtual_memory().unmap(self._enter(), ptr, nbytes)

    def release_address(self, ptr: DevicePtr) -> None:
        """Unmap what is still mapped in the reservation at `ptr`, then `cuMemAddressFree` it."""
        with self._lock:
            self._virtual_memory().release(self._enter(), ptr)

    def _release_reservations(self, attempt) -> None:
        """close(): release every reservation still held, each through `attempt`."""
        space = getattr(self, "_vmm_space", None)
        for base in [] if space is None else space.reservations():
            attempt(self.release_address, DevicePtr(base))
