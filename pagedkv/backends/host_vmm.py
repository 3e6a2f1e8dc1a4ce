"""Virtual memory for HostBackend: reserved address ranges whose chunks are mapped on demand.

The host twin of CUDA's VMM calls (`cuMemAddressReserve`, `cuMemCreate` + `cuMemMap` +
`cuMemSetAccess`, `cuMemUnmap` + `cuMemRelease`, `cuMemAddressFree`). A reservation is one
lazily zeroed numpy array (the OS commits pages only when they are touched) and a bitmap of
mapped granules; a byte range is readable only when every granule it touches is mapped,
otherwise `view` raises, as a GPU faults on an unmapped address. Mapping and unmapping
happen in whole granules, and only mapped bytes count as used memory.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from ..core.validate import as_int, positive_int
from ..errors import ChunkNotMapped, DeviceMemoryError, DeviceOutOfMemory
from .protocol import DevicePtr


@dataclass
class Reservation:
    """One reserved range: `size` bytes at `base`, granule `g`; `chunks` maps the offset of
    each mapped chunk to its length, `mapped[i]` tells whether granule i is backed."""

    base: int
    size: int
    granularity: int
    memory: np.ndarray
    mapped: np.ndarray
    chunks: dict[int, int] = field(default_factory=dict)

    def mapped_bytes(self) -> int:
        """Bytes of this range backed by memory now."""
        return sum(self.chunks.values())


class HostAddressSpace:
    """The reservations of one HostBackend. Every method checks its arguments and changes
    nothing when it raises."""

    def __init__(self, granularity: int):
        self.granularity = positive_int(granularity, "vmm_granularity")
        self._reservations: dict[int, Reservation] = {}
        self._bases: list[int] = []

    def __len__(self) -> int:
        return len(self._reservations)

    def reserve(self, base: int, nbytes: int) -> Reservation:
        """Record a reservation of `nbytes` (a positive multiple of the granularity) at `base`."""
        nbytes = positive_int(nbytes, "reservation size")
        if nbytes % self.granularity:
            raise ValueError(
                f"reservation size {nbytes} is not a multiple of the {self.granularity}-byte granularity"
            )
        try:
            memory = np.zeros(nbytes, dtype=np.uint8)  # lazily zeroed: costs nothing until touched
        except (MemoryError, ValueError):
            raise DeviceOutOfMemory(
                f"cannot reserve {nbytes} bytes of address space: the host cannot back a range that large"
            ) from None
        res = Reservation(base, nbytes, self.granularity, memory, np.zeros(nbytes // self.granularity, dtype=bool))
        self._reservations[base] = res
        bisect.insort(self._bases, base)
        return res

    def find(self, address: int) -> Reservation | None:
        """The reservation holding `address`, or None."""
        i = bisect.bisect_right(self._bases, address) - 1
        if i >= 0:
            res = self._reservations[self._bases[i]]
            if address < res.base + res.size:
                return res
        return None

    def chunk(self, ptr: object, nbytes: object, action: str) -> tuple[Reservation, int, int]:
        """(reservation, offset, nbytes) of a granule-aligned chunk inside one reservation,
        or ValueError / DeviceMemoryError naming what is wrong."""
        if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
            raise TypeError(f"{action} takes a DevicePtr inside a reservation, got {type(ptr).__name__} {ptr!r:.60}")
        address = int(ptr)
        nbytes = positive_int(as_int(nbytes, f"{action} size"), f"{action} size")
        res = self.find(address)
        if res is None:
            raise DeviceMemoryError(f"{action} at {DevicePtr(address)!r}: not inside a reserved address range")
        offset = address - res.base
        if offset % res.granularity or nbytes % res.granularity:
            raise ValueError(
                f"{action} at offset {offset} of {nbytes} bytes: both must be multiples of the "
                f"{res.granularity}-byte granularity"
            )
        if offset + nbytes > res.size:
            raise DeviceMemoryError(
                f"{action} of {nbytes} bytes at offset {offset} runs past the {res.size}-byte reservation "
                f"at {DevicePtr(res.base)!r}"
            )
        return res, offset, nbytes

    def map(self, res: Reservation, offset: int, nbytes: int) -> None:
        """Back `nbytes` at `offset` with fresh zeroed memory; DeviceMemoryError if any of it
        is mapped already."""
        g = res.granularity
        granules = slice(offset // g, (offset + nbytes) // g)
        if res.mapped[granules].any():
            first = offset + int(np.argmax(res.mapped[granules])) * g
            raise DeviceMemoryError(
                f"map of {nbytes} bytes at offset {offset} of the reservation at {DevicePtr(res.base)!r}: "
                f"offset {first} is mapped already"
            )
        res.memory[offset : offset + nbytes] = 0
        res.mapped[granules] = True
        res.chunks[offset] = nbytes

    def unmap(self, res: Reservation, offset: int, nbytes: int) -> None:
        """Drop the chunk mapped at `offset`, which must be exactly `nbytes` long."""
        if res.chunks.get(offset) != nbytes:
            raise ChunkNotMapped(
                f"unmap of {nbytes} bytes at offset {offset} of the reservation at {DevicePtr(res.base)!r}: "
                f"not a chunk mapped there (mapped chunks: {sorted(res.chunks.items())[:8]})"
            )
        g = res.granularity
        del res.chunks[offset]
        res.mapped[offset // g : (offset + nbytes) // g] = False  # `map` zeroes it again

    def release(self, ptr: object) -> Reservation:
        """Forget the reservation starting at `ptr` (its chunks with it) and return it."""
        if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
            raise TypeError(f"release_address takes a DevicePtr from reserve_address, got {type(ptr).__name__} {ptr!r:.60}")
        res = self._reservations.pop(int(ptr), None)
        if res is None:
            raise DeviceMemoryError(f"release_address of {DevicePtr(int(ptr))!r}: not the start of a live reservation")
        self._bases.remove(res.base)
        return res

    def view(self, res: Reservation, address: int, nbytes: int) -> np.ndarray:
        """The `nbytes` at `address` inside `res`, when every granule they touch is mapped;
        DeviceMemoryError naming the first unmapped offset otherwise."""
        start = address - res.base
        end = start + nbytes
        if end > res.size:
            raise DeviceMemoryError(
                f"range {DevicePtr(address)!r} + {nbytes} bytes runs {end - res.size} bytes past the end "
                f"of the {res.size}-byte reservation at {DevicePtr(res.base)!r}"
            )
        if nbytes:
            g = res.granularity
            granules = res.mapped[start // g : -(-end // g)]
            if not granules.all():
                first = (start // g + int(np.argmin(granules))) * g
                raise DeviceMemoryError(
                    f"access to {DevicePtr(address)!r} + {nbytes} bytes touches the unmapped chunk at offset "
                    f"{first} of the reservation at {DevicePtr(res.base)!r} (a GPU would fault here)"
                )
        return res.memory[start:end]
