"""CudaBackend: the GpuBackend contract on an NVIDIA GPU through the CUDA driver API.

The backend's lifetime and its context live here; its jobs live in their own modules:
memory, streams and copies (memory.py), the block kernels and their staging
(kernels.py, staging.py), device facts (device.py). The backend works in the device's
primary context, so it shares memory and streams with any other library in the process.
"""

from __future__ import annotations

import threading
from typing import Any

from ..backends.protocol import DevicePtr
from ..backends.capabilities import check_capability_name
from ..core.log import get_logger
from ..core.validate import non_negative_int
from ._bindings import driver as _driver
from .device import load_driver, read_device_facts
from .errors import BackendClosed, CudaUnavailable, check
from .graphs import GraphCapture
from .kv_kernels import KvKernels
from .kernels import KERNELS, REDUCE_THREADS, THREADS, BlockKernels
from .memory import MemoryAndCopies
from .staging import StagingRing
from .swaps import HostSwaps, copy_batch_mode

__all__ = ["CudaBackend", "KERNELS", "REDUCE_THREADS", "THREADS"]

_log = get_logger("cuda")


class CudaBackend(MemoryAndCopies, BlockKernels, KvKernels, HostSwaps, GraphCapture):
    """The GpuBackend of one CUDA device (`device` ordinal), in its primary context.

    Construction initialises the driver, retains the primary context and loads the
    kernels (compiled by NVRTC or taken from the kernel cache); `close()` (or leaving a
    `with` block) frees what the backend still holds and releases the context. Any
    thread may call in: every call makes the backend's context current on the calling
    thread unless it already is, so another library switching contexts cannot redirect
    it. Streams are int handles (0 is the legacy default stream). `device_name`,
    `compute_capability` (major, minor) and `sm_count` describe the device. A call after
    `close()` raises BackendClosed.

    `copy_batch` chooses how `copy_batch_async` copies: "auto" (cuMemcpyBatchAsync where
    the driver has it, CUDA 12.8 and later, else the copy kernel) or "kernel" (always the
    copy kernel); None reads `$PAGEDKV_COPY_BATCH` (default "auto"). `copy_batch_path`
    says which one was found.
    """

    def __init__(self, device: int = 0, kernel_cache_dir: str | None = None, copy_batch: str | None = None):
        device = non_negative_int(device, "device")
        mode = copy_batch_mode(copy_batch)
        self._closed = True  # until construction completes
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # notified when a held staging slot is let go
        self._allocs: dict[int, int] = {}
        self._alloc_bases: list[int] = []
        self._pinned: dict = {}
        self._streams: dict[int, Any] = {}
        self._region_limits: dict = {}
        self._modules: list = []
        self._launchers: dict = {}
        self._max_grid: dict[str, int] = {}
        self._staging = StagingRing()
        self._mapped_staging = StagingRing(mapped=True)
        self._swap: dict = {}
        self._events: dict = {}
        self._memcpy_batch = None
        self._ctx = None
        drv = load_driver()
        count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if device >= count:
            raise CudaUnavailable(f"CUDA device {device} does not exist: this machine has {count} GPU(s).")
        self._device = check(drv.cuDeviceGet(device), "cuDeviceGet", f"device {device}")
        self.device_ordinal = device
        self._ctx = check(drv.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        try:
            check(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            facts = read_device_facts(self._device)
            self.device_name = facts.name
            self.compute_capability = facts.compute_capability
            self.sm_count = facts.sm_count
            self._closed = False
            self._load_kernels(drv, kernel_cache_dir)
            self._resolve_copy_batch(mode)
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
            compute_capability="%d.%d" % self.compute_capability,
            sms=self.sm_count,
        )

    # -- lifetime -------------------------------------------------------------------

    def _enter(self):
        """The driver module, with the primary context current on the calling thread
        (checked with cuCtxGetCurrent on every call); BackendClosed after close()."""
        if self._closed:
            raise BackendClosed("this CudaBackend is closed")
        current = check(_driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(current) != int(self._ctx):
            check(_driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        return _driver

    def close(self) -> None:
        """Wait for any reduction still reading its result, then free the staging
        buffers, every allocation, pinned buffer and stream still held, unload the
        kernels and release the primary context (all attempted; first error raised),
        holding the backend's lock throughout. A second call does nothing."""
        with self._lock:
            if self._closed:
                return
            while self._staging.held():
                self._idle.wait()
            first: BaseException | None = None

            def attempt(action, *args) -> None:
                nonlocal first
                try:
                    action(*args)
                except Exception as err:  # noqa: BLE001 - everything must be attempted
                    first = first or err
                    _log.error("cuda_close_step_failed", error=str(err))

            try:
                self._close_resources(_driver, attempt)
            finally:
                self._closed = True
                if self._ctx is not None:
                    attempt(lambda: check(_driver.cuDevicePrimaryCtxRelease(self._device), "cuDevicePrimaryCtxRelease"))
                    self._ctx = None
            if first is not None:
                raise first

    def _close_resources(self, driver, attempt) -> None:
        """Free everything held, each step through `attempt`; the primary context is made
        current first (if that fails, the frees are still attempted)."""
        if self._ctx is not None:
            attempt(self._enter)
        attempt(lambda: check(driver.cuCtxSynchronize(), "cuCtxSynchronize"))
        attempt(self._staging.close)
        attempt(self._mapped_staging.close)
        for event in list(self._events):
            attempt(self.destroy_event, event)
        self._close_graphs(attempt)
        leaked = len(self._allocs) + len(self._pinned) + len(self._swap) + len(self._streams)
        if leaked:
            _log.warning(
                "cuda_close_freeing_leftovers",
                allocations=len(self._allocs),
                pinned=len(self._pinned),
                swap=len(self._swap),
                streams=len(self._streams),
            )
        for ptr in list(self._allocs):
            attempt(self.free, DevicePtr(ptr))
        self._release_reservations(attempt)
        for buf in list(self._pinned.values()):
            attempt(buf.free)
        for memory in list(self._swap.values()):
            attempt(memory.free)
        for handle in list(self._streams):
            attempt(self.destroy_stream, handle)
        for module in self._modules:
            attempt(lambda m=module: check(driver.cuModuleUnload(m.handle), "cuModuleUnload"))
        self._modules, self._launchers = [], {}

    SUPPORTED = frozenset({"pinned", "batched_copy", "stream_wait", "host_tier", "graphs", "device:cuda"})
    """The capabilities CudaBackend states (see pagedkv.capabilities)."""

    def supports(self, name: str) -> bool:
        """True for "pinned", "batched_copy", "stream_wait", "host_tier", "graphs" and "device:cuda", and for "vmm"
        when the device reports virtual memory management; ValueError for an unknown name."""
        if check_capability_name(name) == "vmm":
            from . import vmm

            with self._lock:
                return vmm.vmm_supported(self._enter(), self._device)
        return name in self.SUPPORTED

    def __enter__(self) -> "CudaBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True after `close()`."""
        return self._closed

    # -- virtual memory for elastic pools (the driver calls live in vmm.py) --------------

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
