"""HostBackend: the GpuBackend contract on host RAM with numpy, strict where a GPU is silent.

It is the backend of machines without a GPU, the reference the GPU tests compare
against, and a checker: an unknown pointer, a range past its allocation, a double free, an
unknown stream or an allocation beyond `capacity_bytes` raise instead of corrupting.
Work runs at once, so every stream is always synchronised.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np

from ..core.exact_sum import bf16_stats
from ..core.streams import stream_handle
from ..core.validate import positive_int
from ..errors import DeviceMemoryError, DeviceOutOfMemory
from .batch_ranges import as_ranges, check_overlaps
from .capabilities import check_capability_name
from .host_vmm import HostAddressSpace
from .protocol import (
    Bf16Stats,
    BlockRegions,
    DevicePtr,
    as_block_array,
    check_alloc_size,
    check_bf16_row,
    check_byte_count,
    check_copy_pairs,
    check_fill_byte,
    host_bytes,
)

ALIGNMENT = 256
"""Every HostBackend allocation starts on a multiple of this many bytes."""

_FIRST_ADDRESS = 0x7F00_0000_0000  # far from 0 and from small ints mistaken for pointers


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class HostBackend:
    """Device memory emulated in host RAM; addresses are unique, non-zero, 256-byte aligned
    and never reused, so a stale pointer is caught as unknown."""

    def __init__(self, capacity_bytes: int = 8 << 30, vmm_granularity: int = 2 << 20):
        self._capacity = positive_int(capacity_bytes, "capacity_bytes")
        self._vmm = _host_address_space(vmm_granularity)
        self._used = 0
        self._next_address = _FIRST_ADDRESS
        self._bases: list[int] = []  # sorted allocation bases
        self._arrays: dict[int, np.ndarray] = {}
        self._streams = {0}
        self._next_stream = 1
        self._swap: dict[int, HostSwapMemory] = {}  # live swap memory by address
        self._swap_bases: list[int] = []  # sorted addresses of live swap memory
        self._events: set[int] = set()
        self._next_event = 1

    SUPPORTED = frozenset({"batched_copy", "host_view", "vmm", "host_tier", "device:cpu"})
    """The capabilities HostBackend states (see pagedkv.capabilities)."""

    def supports(self, name: str) -> bool:
        """True for "batched_copy", "host_view", "vmm", "host_tier" and "device:cpu";
        ValueError for an unknown name."""
        return check_capability_name(name) in self.SUPPORTED

    # -- memory ---------------------------------------------------------------------

    def alloc(self, nbytes: int) -> DevicePtr:
        """Allocate `nbytes` zero-filled bytes; DeviceOutOfMemory beyond the capacity."""
        nbytes = check_alloc_size(nbytes)
        free = self._capacity - self._used
        if nbytes > free:
            raise DeviceOutOfMemory(
                f"HostBackend out of memory: asked {nbytes} bytes ({_gib(nbytes)}), "
                f"{free} bytes ({_gib(free)}) free of {self._capacity}"
            )
        base = self._next_address = self._past_swap_memory(self._next_address, nbytes, ALIGNMENT)
        self._next_address += -(-nbytes // ALIGNMENT) * ALIGNMENT + ALIGNMENT  # guard gap
        self._arrays[base] = np.zeros(nbytes, dtype=np.uint8)
        bisect.insort(self._bases, base)
        self._used += nbytes
        return DevicePtr(base)

    def free(self, ptr: DevicePtr) -> None:
        """Free the allocation starting at `ptr`; TypeError naming a non-address (None, a
        float, a bool), DeviceMemoryError for any other address."""
        if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
            raise TypeError(f"free takes a DevicePtr returned by alloc, got {type(ptr).__name__} {ptr!r:.60}")
        base = int(ptr)
        arr = self._arrays.pop(base, None)
        if arr is None:
            inside = self._find(base)
            what = "not the start of an allocation" if inside is not None else "unknown or already freed"
            raise DeviceMemoryError(f"free of {DevicePtr(base)!r}: {what}")
        self._bases.remove(base)
        self._used -= arr.nbytes

    def _find(self, address: int) -> int | None:
        i = bisect.bisect_right(self._bases, address) - 1
        if i >= 0:
            base = self._bases[i]
            if address < base + self._arrays[base].nbytes:
                return base
        return None

    def view(self, ptr: DevicePtr, nbytes: int) -> np.ndarray:
        """The `nbytes` bytes at `ptr` as a writable uint8 array; raises past an allocation's end."""
        nbytes = check_byte_count(nbytes)
        address = int(ptr)
        base = self._find(address)
        if base is None:
            reservation = self._vmm.find(address)
            if reservation is not None:
                return self._vmm.view(reservation, address, nbytes)
            raise DeviceMemoryError(f"{DevicePtr(address)!r} is not inside any live allocation")
        arr = self._arrays[base]
        start = address - base
        if start + nbytes > arr.nbytes:
            raise DeviceMemoryError(
                f"range {DevicePtr(address)!r} + {nbytes} bytes runs {start + nbytes - arr.nbytes} "
                f"bytes past the end of the {arr.nbytes}-byte allocation at {DevicePtr(base)!r}"
            )
        return arr[start : start + nbytes]

    def live_allocations(self) -> int:
        """How many allocations (and reserved address ranges) are live now."""
        return len(self._arrays) + len(self._vmm)

    def live_bytes(self) -> int:
        """How many bytes are allocated (or mapped into reserved ranges) now."""
        return self._used

    def mem_info(self) -> tuple[int, int]:
        """(capacity minus live bytes, capacity)."""
        return self._capacity - self._used, self._capacity

    # -- streams --------------------------------------------------------------------

    def default_stream(self) -> int:
        """Stream 0."""
        return 0

    def create_stream(self) -> int:
        """A new stream handle."""
        handle = self._next_stream
        self._next_stream += 1
        self._streams.add(handle)
        return handle

    def destroy_stream(self, stream: int) -> None:
        """Forget `stream`; the default stream and unknown handles raise ValueError."""
        if stream == 0 or stream not in self._streams:
            raise ValueError(f"cannot destroy stream {stream!r}: not a stream made by create_stream")
        self._streams.discard(stream)

    def _check_stream(self, stream: int) -> None:
        handle = stream_handle(stream)
        if handle not in self._streams:
            raise ValueError(f"unknown stream {handle!r}")

    def check_stream(self, stream: object) -> None:
        """ValueError naming `stream` unless it is 0 or a live `create_stream` handle (what
        a library checks when it is given a stream, before enqueueing anything on it)."""
        self._check_stream(stream)

    def synchronize(self, stream: int) -> None:
        """Nothing to wait for (work runs at once); validates the handle."""
        self._check_stream(stream)

    def synchronize_all(self) -> None:
        """Nothing to wait for (work runs at once): every stream is always synchronised."""

    # -- copies and memset ----------------------------------------------------------

    def memset_async(self, ptr: DevicePtr, value: int, nbytes: int, stream: int) -> None:
        """Set `nbytes` bytes at `ptr` to `value`."""
        self._check_stream(stream)
        self.view(ptr, nbytes)[:] = check_fill_byte(value)

    def copy_h2d(self, src: Any, dst: DevicePtr) -> None:
        """Copy host buffer `src` to `dst`."""
        data = host_bytes(src, writable=False)
        self.view(dst, data.nbytes)[:] = data

    def copy_d2h(self, src: DevicePtr, dst: Any) -> None:
        """Fill host buffer `dst` from `src`."""
        out = host_bytes(dst, writable=True)
        out[:] = self.view(src, out.nbytes)

    def copy_d2d(self, src: DevicePtr, dst: DevicePtr, nbytes: int, stream: int) -> None:
        """Copy `nbytes` from `src` to `dst` (overlap behaves as memmove)."""
        self._check_stream(stream)
        data = self.view(src, nbytes).copy()
        self.view(dst, nbytes)[:] = data

    # -- block kernels --------------------------------------------------------------

    def create_block_regions(self, rows: Sequence[tuple[int, int, int]]) -> BlockRegions:
        """A region table; the host needs no device copy."""
        return BlockRegions.from_rows(rows)

    def destroy_block_regions(self, regions: BlockRegions) -> None:
        """Nothing to release on the host."""

    def _region_blocks(self, regions: BlockRegions, r: int, blocks: np.ndarray) -> np.ndarray:
        """A `[max block + 1, nbytes]` view of region `r` (non-empty `blocks`), bounds-checked
        against its allocation."""
        stride, nbytes = int(regions.strides[r]), int(regions.nbytes[r])
        count = int(blocks.max()) + 1
        whole = self.view(DevicePtr(int(regions.bases[r])), (count - 1) * stride + nbytes)
        return np.lib.stride_tricks.as_strided(
            whole, shape=(count, nbytes), strides=(stride, 1), writeable=True
        )

    def fill_blocks(self, regions: BlockRegions, blocks: Sequence[int], value: int, stream: int) -> None:
        """Set every byte of the listed blocks in every region to `value`."""
        self._check_stream(stream)
        byte = check_fill_byte(value)
        idx = as_block_array(blocks)
        if idx.size == 0:
            return
        for r in range(len(regions)):
            self._region_blocks(regions, r, idx)[idx] = byte

    def copy_blocks(
        self, regions: BlockRegions, src: Sequence[int], dst: Sequence[int], stream: int
    ) -> None:
        """Copy block `src[i]` over `dst[i]` in every region."""
        self._check_stream(stream)
        s = as_block_array(src, "src")
        d = as_block_array(dst, "dst")
        check_copy_pairs(s, d)
        if s.size == 0:
            return
        top = np.concatenate([s, d])
        for r in range(len(regions)):
            view = self._region_blocks(regions, r, top)
            view[d] = view[s]

    def reduce_bf16_blocks(
        self, regions: BlockRegions, region: int, blocks: Sequence[int], stream: int
    ) -> Bf16Stats:
        """Exact sum, sum of squares and sum of |x| of the BF16 values in the listed blocks,
        each rounded once to float64 (pagedkv.exact_sum); the row must be BF16-aligned."""
        self._check_stream(stream)
        region, _, _, _ = check_bf16_row(regions, region)
        idx = as_block_array(blocks)
        if idx.size == 0:
            return Bf16Stats(0.0, 0.0, 0.0)
        raw = np.ascontiguousarray(self._region_blocks(regions, region, idx)[idx])
        return bf16_stats(raw.view("<u2"))


    # -- virtual memory: reserved ranges, chunks mapped on demand (see host_vmm) ------

    def vmm_granularity(self) -> int:
        """Bytes of the smallest chunk `map_chunk` maps (the constructor's `vmm_granularity`)."""
        return self._vmm.granularity

    def reserve_address(self, nbytes: int) -> DevicePtr:
        """Reserve `nbytes` (a positive multiple of `vmm_granularity()`) of address space with
        nothing mapped: every access raises until `map_chunk` backs it. Costs no capacity
        (a ceiling may exceed the device); DeviceOutOfMemory, nothing reserved, when the host
        cannot give the lazily zeroed array that emulates the range."""
        granularity = self._vmm.granularity
        base = self._past_swap_memory(-(-self._next_address // granularity) * granularity, nbytes, granularity)
        self._vmm.reserve(base, nbytes)
        self._next_address = base + nbytes + granularity  # guard gap; addresses never reused
        return DevicePtr(base)

    def map_chunk(self, ptr: DevicePtr, nbytes: int) -> None:
        """Back the granule-aligned `nbytes` at `ptr` (inside one reservation, none of it
        mapped) with fresh zeroed memory; DeviceOutOfMemory, nothing mapped, beyond the capacity."""
        reservation, offset, nbytes = self._vmm.chunk(ptr, nbytes, "map_chunk")
        free = self._capacity - self._used
        if nbytes > free:
            raise DeviceOutOfMemory(
                f"HostBackend out of memory: map_chunk asked {nbytes} bytes ({_gib(nbytes)}), "
                f"{free} bytes ({_gib(free)}) free of {self._capacity}"
            )
        self._vmm.map(reservation, offset, nbytes)
        self._used += nbytes

    def unmap_chunk(self, ptr: DevicePtr, nbytes: int) -> None:
        """Unmap and release a chunk `map_chunk` mapped at `ptr` with exactly `nbytes`;
        its bytes become inaccessible and its memory returns to the capacity."""
        reservation, offset, nbytes = self._vmm.chunk(ptr, nbytes, "unmap_chunk")
        self._vmm.unmap(reservation, offset, nbytes)
        self._used -= nbytes

    def release_address(self, ptr: DevicePtr) -> None:
        """Unmap every chunk still mapped in the reservation starting at `ptr` and forget the
        range; DeviceMemoryError for any other address."""
        reservation = self._vmm.release(ptr)
        self._used -= reservation.mapped_bytes()


    # -- host tier: swap memory, one batched copy per call, events ---------------------

    def alloc_swap_memory(self, nbytes: int) -> "HostSwapMemory":
        """`nbytes` (a positive int, else ValueError naming it) of zeroed host memory that
        `copy_batch_async` reaches: a numpy array, its data pointer the `address`. It costs
        no device capacity; DeviceOutOfMemory when the host cannot give it."""
        nbytes = positive_int(nbytes, "swap memory size")
        refused = []  # arrays landing on emulated addresses, kept until one lands elsewhere
        while True:
            try:
                array = np.zeros(nbytes, dtype=np.uint8)
            except (MemoryError, ValueError) as err:
                raise DeviceOutOfMemory(f"HostBackend cannot allocate {nbytes} bytes of swap memory: {err}") from None
            if not self._overlaps_emulated(int(array.ctypes.data), nbytes):
                break
            refused.append(array)
            if len(refused) == 16:
                raise DeviceOutOfMemory(f"HostBackend: {nbytes} bytes of swap memory keep landing on emulated addresses")
        memory = HostSwapMemory(self, array)
        self._swap[memory.address] = memory
        bisect.insort(self._swap_bases, memory.address)
        return memory

    def _past_swap_memory(self, base: int, nbytes: int, alignment: int) -> int:
        """The first `alignment`-aligned address from `base` whose `nbytes` overlap no live
        swap memory: its addresses are real host addresses, which may lie where this
        backend's own emulated addresses grow, and one address must mean one range."""
        moved = True
        while moved:
            moved = False
            for memory in self._swap.values():
                if base < memory.address + memory.nbytes and memory.address < base + max(nbytes, 1):
                    base = -(-(memory.address + memory.nbytes + ALIGNMENT) // alignment) * alignment
                    moved = True
        return base

    def _overlaps_emulated(self, address: int, nbytes: int) -> bool:
        """True when `[address, address + nbytes)` meets a live allocation or reservation."""
        i = bisect.bisect_left(self._bases, address + nbytes) - 1
        if i >= 0 and self._bases[i] + self._arrays[self._bases[i]].nbytes > address:
            return True
        vmm = self._vmm
        j = bisect.bisect_left(vmm._bases, address + nbytes) - 1
        return j >= 0 and vmm._bases[j] + vmm._reservations[vmm._bases[j]].size > address

    def _forget_swap(self, memory: "HostSwapMemory") -> None:
        del self._swap[memory.address]
        self._swap_bases.remove(memory.address)

    def live_swap_memory(self) -> int:
        """How many swap memories are live (allocated and not freed)."""
        return len(self._swap)

    def _range_view(self, address: int, nbytes: int, i: int, what: str) -> np.ndarray:
        """The bytes of one `copy_batch_async` range: inside one live swap memory, or inside
        one live allocation; IndexError naming entry `i` and the address otherwise."""
        j = bisect.bisect_right(self._swap_bases, address) - 1
        if j >= 0:
            memory = self._swap[self._swap_bases[j]]
            start = address - memory.address
            if start + nbytes <= memory.nbytes and start < memory.nbytes:
                return memory.array[start : start + nbytes]
        base = self._find(address)
        if base is not None:
            arr = self._arrays[base]
            start = address - base
            if start + nbytes <= arr.nbytes:
                return arr[start : start + nbytes]
        reservation = self._vmm.find(address)
        if reservation is not None:
            try:
                return self._vmm.view(reservation, address, nbytes)
            except DeviceMemoryError:
                pass  # unmapped or past the reservation: refused below
        raise IndexError(
            f"copy_batch_async entry {i}: {what} range 0x{address:x} + {nbytes} bytes is not inside "
            "one live allocation or swap memory"
        )

    def copy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int) -> None:
        """Copy `sizes[i]` bytes from `srcs[i]` to `dsts[i]` for every i, as one call on
        `stream` (it runs now). Each range must lie inside one live allocation or one live
        swap memory (IndexError naming i and the address); destination ranges that overlap
        each other or a source raise ValueError; all checked before any byte moves. n == 0
        does nothing, and so does a 0-byte range (its addresses are not looked at, as on
        CudaBackend)."""
        self._check_stream(stream)
        dst, src, size, index = as_ranges(dsts, srcs, sizes)
        views = []
        for i, at in enumerate(index.tolist()):
            nbytes = int(size[i])
            views.append((self._range_view(int(dst[i]), nbytes, at, "destination"),
                          self._range_view(int(src[i]), nbytes, at, "source")))
        check_overlaps(dst, src, size, index)
        for out, data in views:
            out[:] = data

    def record_event(self, stream: int) -> int:
        """An event recorded on `stream` now; work runs at once, so it is done already."""
        self._check_stream(stream)
        event = self._next_event
        self._next_event += 1
        self._events.add(event)
        return event

    def _check_event(self, event: int) -> None:
        if isinstance(event, bool) or not isinstance(event, (int, np.integer)) or int(event) not in self._events:
            raise ValueError(f"unknown event {event!r}: not recorded by record_event, or destroyed")

    def event_done(self, event: int) -> bool:
        """True (everything ran when it was called); ValueError for an unknown event."""
        self._check_event(event)
        return True

    def wait_event(self, event: int) -> None:
        """Nothing to wait for; ValueError for an unknown event."""
        self._check_event(event)

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Nothing to order (work runs at once); checks the stream and the event."""
        self._check_stream(stream)
        self._check_event(event)

    def destroy_event(self, event: int) -> None:
        """Forget `event`; ValueError naming an unknown or already destroyed one."""
        self._check_event(event)
        self._events.discard(int(event))

    def live_events(self) -> int:
        """How many events are recorded and not destroyed."""
        return len(self._events)


class HostSwapMemory:
    """HostBackend's swap memory: `array` (writable uint8 numpy), `address` (its data
    pointer), `nbytes`; `free()` forgets it (a second call does nothing), `freed` says so."""

    def __init__(self, backend: HostBackend, array: np.ndarray):
        self._backend = backend
        self.array = array
        self.address = int(array.ctypes.data)
        self.nbytes = int(array.nbytes)
        self.freed = False

    def free(self) -> None:
        """Give the memory back; later batched copies refuse its ranges. Idempotent."""
        if not self.freed:
            self._backend._forget_swap(self)  # first: marked freed only once it is gone
            self.freed = True

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return f"HostSwapMemory(0x{self.address:x}, {self.nbytes} bytes, {state})"


def _host_address_space(granularity: int) -> HostAddressSpace:
    granularity = positive_int(granularity, "vmm_granularity")
    if granularity % ALIGNMENT:
        raise ValueError(f"vmm_granularity must be a multiple of {ALIGNMENT} bytes, got {granularity}")
    return HostAddressSpace(granularity)


def bf16_bytes_to_float64(raw: np.ndarray) -> np.ndarray:
    """Little-endian BF16 bytes as float64 values (exact: BF16 widens losslessly)."""
    bits = np.frombuffer(np.ascontiguousarray(raw).tobytes(), dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)
