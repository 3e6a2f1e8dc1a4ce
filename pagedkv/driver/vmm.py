"""CUDA virtual memory management for elastic pools: reserve address space, map physical
chunks into it on demand, unmap and release them.

`VirtualMemory` holds one device's reservations (`cuMemAddressReserve`) and the physical
handle of each chunk mapped into them (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`, undone
by `cuMemUnmap` + `cuMemRelease`). Every call takes the driver module of a caller that has
made the device's context current (CudaBackend does, and serialises calls with its lock).
Each call is all or nothing: a failed map releases what it created, so nothing leaks.
Nothing is forgotten before the driver says it is gone: a chunk whose `cuMemUnmap` worked
but whose `cuMemRelease` failed is kept (unmapped, its handle unreleased), and the next
`unmap` of it, any `map` (before its `cuMemCreate`, so a handle value the driver reuses is
never recorded twice), `release` of its reservation or the backend's close retries the
release; a retry refused as an invalid handle means the first release took effect.
"""

from __future__ import annotations

from typing import Any

from ..backends.protocol import DevicePtr
from ..errors import ChunkNotMapped, DeviceMemoryError
from ..core.validate import as_int, positive_int
from .errors import check

_ATTR_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ACCESS_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_CUDA_ERROR_INVALID_HANDLE = 400


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def vmm_supported(driver: Any, device: Any) -> bool:
    """Whether `device` reports virtual memory management support (attribute 102)."""
    attr = driver.CUdevice_attribute(_ATTR_VMM_SUPPORTED)
    return bool(check(driver.cuDeviceGetAttribute(attr, device), "cuDeviceGetAttribute", attr.name))


class VirtualMemory:
    """The VMM reservations of device `ordinal`: `reserve`, `map`, `unmap`, `release`.
    `granularity(driver)` is the device's minimum chunk size, asked once."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self._granularity: int | None = None
        self._reservations: dict[int, int] = {}  # base -> size
        self._chunks: dict[int, tuple[int, Any]] = {}  # address -> (size, physical handle)
        self._unreleased: dict[int, tuple[int, Any]] = {}  # unmapped chunks whose cuMemRelease failed

    def _prop(self, driver: Any) -> Any:
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        return prop

    def granularity(self, driver: Any) -> int:
        """Bytes of the smallest chunk the device maps (`cuMemGetAllocationGranularity`, minimum)."""
        if self._granularity is None:
            flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            value = check(driver.cuMemGetAllocationGranularity(self._prop(driver), flag), "cuMemGetAllocationGranularity")
            self._granularity = int(value)
        return self._granularity

    def reservations(self) -> list[int]:
        """Bases of the live reservations."""
        return list(self._reservations)

    def mapped_spans(self) -> list[tuple[int, int]]:
        """(address, nbytes) of every mapped chunk, adjacent chunks merged into one span."""
        spans: list[list[int]] = []
        for address, (size, _) in sorted(self._chunks.items()):
            if spans and spans[-1][0] + spans[-1][1] == address:
                spans[-1][1] += size
            else:
                spans.append([address, size])
        return [(a, n) for a, n in spans]

    def mapped_bytes(self) -> int:
        """Bytes mapped over every reservation."""
        return sum(size for size, _ in self._chunks.values())

    def reserve(self, driver: Any, nbytes: int) -> DevicePtr:
        """Reserve `nbytes` (a positive multiple of the granularity) of address space, aligned
        to the granularity, with nothing mapped."""
        nbytes = positive_int(nbytes, "reservation size")
        g = self.granularity(driver)
        if nbytes % g:
            raise ValueError(f"reservation size {nbytes} is not a multiple of the {g}-byte granularity")
        base = int(check(driver.cuMemAddressReserve(nbytes, g, 0, 0), "cuMemAddressReserve", f"reserving {_gib(nbytes)}"))
        self._reservations[base] = nbytes
        return DevicePtr(base)

    def _reservation_of(self, address: int, nbytes: int, action: str) -> int:
        g = self._granularity or 1
        for base, size in self._reservations.items():
            if base <= address < base + size:
                if (address - base) % g or nbytes % g:
                    raise ValueError(
                        f"{action} at offset {address - base} of {nbytes} bytes: both must be multiples of "
                        f"the {g}-byte granularity"
                    )
                if address + nbytes > base + size:
                    raise DeviceMemoryError(
                        f"{action} of {nbytes} bytes at offset {address - base} runs past the {size}-byte "
                        f"reservation at {DevicePtr(base)!r}"
                    )
                return base
        raise DeviceMemoryError(f"{action} at {DevicePtr(address)!r}: not inside a reserved address range")

    def map(self, driver: Any, ptr: DevicePtr, nbytes: int) -> None:
        """Create `nbytes` of device memory and map it read-write at `ptr` (granule-aligned,
        inside a reservation, not mapped); CudaOutOfMemory with nothing created when the
        device has no room."""
        address = int(ptr)
        nbytes = positive_int(as_int(nbytes, "map_chunk size"), "map_chunk size")
        self._reservation_of(address, nbytes, "map_chunk")
        for at, (size, _) in self._chunks.items():
            if at < address + nbytes and address < at + size:
                raise DeviceMemoryError(f"map_chunk at {DevicePtr(address)!r}: {DevicePtr(at)!r} is mapped already")
        for at in list(self._unreleased):  # first: a handle the driver may reuse must not be recorded twice
            self._release_unmapped(driver, at)  # raises if it fails again
        handle = check(driver.cuMemCreate(nbytes, self._prop(driver), 0), "cuMemCreate", f"asking {_gib(nbytes)}")
        self._unreleased[address] = (nbytes, handle)  # created, not mapped: recorded until released
        try:
            check(driver.cuMemMap(address, nbytes, 0, handle, 0), "cuMemMap")
        except BaseException:
            self._release_unmapped(driver, address, first=True)  # stays recorded if the release fails too
            raise
        self._chunks[address] = self._unreleased.pop(address)  # mapped: `unmap` undoes it
        try:
            access = driver.CUmemAccessDesc()
            access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.ordinal
            access.flags = driver.CUmemAccess_flags(_ACCESS_READWRITE)
            check(driver.cuMemSetAccess(address, nbytes, [access], 1), "cuMemSetAccess")
        except BaseException:
            self.unmap(driver, DevicePtr(address), nbytes)  # what fails stays recorded for a retry
            raise

    def unmap(self, driver: Any, ptr: DevicePtr, nbytes: int) -> None:
        """Unmap the chunk `map` mapped at `ptr` with exactly `nbytes` and release its memory."""
        address = int(ptr)
        left = self._unreleased.get(address)
        if left is not None and left[0] == nbytes:
            self._release_unmapped(driver, address)  # the retry of an unmap whose release failed
            return
        chunk = self._chunks.get(address)
        if chunk is None or chunk[0] != nbytes:
            raise ChunkNotMapped(f"unmap_chunk of {nbytes} bytes at {DevicePtr(address)!r}: not a chunk mapped there")
        check(driver.cuMemUnmap(address, nbytes), "cuMemUnmap")
        del self._chunks[address]  # unmapped: the handle is all that is left to release
        self._unreleased[address] = chunk
        self._release_unmapped(driver, address, first=True)

    def _release_unmapped(self, driver: Any, address: int, first: bool = False) -> None:
        """`cuMemRelease` of the unmapped chunk at `address`; it stays recorded if that fails.
        A retry (not `first`) that the driver refuses as an invalid handle means the earlier
        release took effect before failing: the handle is gone, and forgotten."""
        result = driver.cuMemRelease(self._unreleased[address][1])
        if not first and int(getattr(result[0], "value", result[0])) == _CUDA_ERROR_INVALID_HANDLE:
            del self._unreleased[address]
            return
        check(result, "cuMemRelease")
        del self._unreleased[address]

    def unreleased(self) -> int:
        """How many unmapped chunks still wait for their `cuMemRelease` (a retry)."""
        return len(self._unreleased)

    def release(self, driver: Any, ptr: DevicePtr) -> None:
        """Unmap every chunk still mapped in the reservation at `ptr`, then free the range;
        the first failure is raised with what is left still recorded (a retry goes on)."""
        base = int(ptr)
        size = self._reservations.get(base)
        if size is None:
            raise DeviceMemoryError(f"release_address of {DevicePtr(base)!r}: not the start of a live reservation")
        for address in sorted(a for a in self._unreleased if base <= a < base + size):
            self._release_unmapped(driver, address)
        for address in sorted(a for a in self._chunks if base <= a < base + size):
            self.unmap(driver, DevicePtr(address), self._chunks[address][0])
        check(driver.cuMemAddressFree(base, size), "cuMemAddressFree")
        del self._reservations[base]
