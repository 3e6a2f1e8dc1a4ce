"""The backend contract: device pointers, block-region tables and the GpuBackend protocol.

A backend is the only thing that knows what memory is. The cache asks it for
allocations, memsets, copies and three block kernels (fill, copy, BF16 reduction), all
addressed through a `BlockRegions` table: one row per (layer, side) pool giving its base
address, its block stride and the bytes of one block. A block kernel call works on every
row (or one row, for the reduction) for a list of block indices, in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ..core.exact_sum import Bf16Stats
from ..core.validate import as_int, index_in_range, non_negative_int, positive_int


class DevicePtr(int):
    """A device address: an int with `offset()`, `is_null` and a hex repr."""

    __slots__ = ()

    def __new__(cls, address: int = 0) -> "DevicePtr":
        if isinstance(address, bool) or not isinstance(address, (int, np.integer)):
            raise TypeError(f"a device address must be an int, got {address!r}")
        if address < 0:
            raise ValueError(f"a device address cannot be negative, got {address}")
        return super().__new__(cls, int(address))

    def offset(self, nbytes: int) -> "DevicePtr":
        """The address `nbytes` further on (negative goes back; below zero raises; a
        non-integer offset raises TypeError rather than being truncated)."""
        return DevicePtr(int(self) + as_int(nbytes, "a byte offset"))

    @property
    def is_null(self) -> bool:
        """True for address 0."""
        return int(self) == 0

    def __repr__(self) -> str:
        return f"DevicePtr(0x{int(self):x})"


NULL = DevicePtr(0)
"""The null device address."""


@dataclass
class BlockRegions:
    """A table of pools addressed by block index: row r covers block b at
    `bases[r] + b * strides[r]`, `nbytes[r]` bytes long.

    Made by `GpuBackend.create_block_regions` and released by `destroy_block_regions`;
    `device_table` is the backend's own copy (a device buffer on CUDA, None on the host).
    """

    bases: np.ndarray
    strides: np.ndarray
    nbytes: np.ndarray
    device_table: Any = field(default=None)

    def __len__(self) -> int:
        return len(self.bases)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, int, int]]) -> "BlockRegions":
        """Validate `(base, stride, nbytes)` rows into a host-side table (no device copy yet)."""
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 3) if len(rows) else np.zeros((0, 3), np.int64)
        for r, (base, stride, nbytes) in enumerate(table.tolist()):
            if base <= 0:
                raise ValueError(f"region {r}: base address must be non-null, got {base:#x}")
            if nbytes <= 0 or stride < nbytes:
                raise ValueError(
                    f"region {r}: need 0 < nbytes <= stride, got nbytes {nbytes}, stride {stride}"
                )
        return cls(
            bases=table[:, 0].copy(), strides=table[:, 1].copy(), nbytes=table[:, 2].copy()
        )


def as_block_array(blocks: Sequence[int] | np.ndarray, what: str = "blocks") -> np.ndarray:
    """`blocks` as a 1-D int64 array of non-negative indices; ValueError names a bad entry."""
    arr = np.asarray(blocks)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D sequence of ints, got {blocks!r}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        raise ValueError(f"{what} holds a negative block index {int(arr.min())}")
    return arr


def host_bytes(buf: Any, writable: bool) -> np.ndarray:
    """A flat uint8 view (no copy) of a C-contiguous numpy array of any dtype (ml_dtypes'
    bfloat16 included) or bytes-like object; ValueError for a read-only destination or a
    strided buffer, TypeError for an object without the buffer protocol."""
    if isinstance(buf, np.ndarray):
        if writable and not buf.flags.writeable:
            raise ValueError("destination host buffer is read-only")
        if not buf.flags.c_contiguous:
            raise ValueError("host buffer must be C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"host buffer must support the buffer protocol, got {type(buf).__name__}") from None
    if writable and view.readonly:
        raise ValueError("destination host buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("host buffer must be C-contiguous")
    return np.frombuffer(view.cast("B"), dtype=np.uint8) if view.nbytes else np.zeros(0, np.uint8)


def check_alloc_size(nbytes: Any) -> int:
    """`nbytes` as a positive int, or ValueError naming it."""
    return positive_int(nbytes, "allocation size")


def check_byte_count(nbytes: Any) -> int:
    """`nbytes` as a non-negative int, or ValueError naming it."""
    return non_negative_int(nbytes, "byte count")


def check_fill_byte(value: Any) -> int:
    """`value` as a byte 0..255, or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= 255:
        raise ValueError(f"fill value must be a byte 0..255, got {value!r}")
    return int(value)


def check_bf16_row(regions: "BlockRegions", region: Any) -> tuple[int, int, int, int]:
    """`(region, base, stride, nbytes)` of the row a BF16 reduction reads, after checking
    the index and that the base, the stride and the block size are all even (2-byte loads
    at odd addresses are misaligned on a GPU); IndexError/ValueError name the bad value."""
    region = index_in_range(region, len(regions), "region", f"a table of {len(regions)} regions")
    base, stride, nbytes = (int(regions.bases[region]), int(regions.strides[region]), int(regions.nbytes[region]))
    if nbytes % 2:
        raise ValueError(f"region {region} has an odd block size {nbytes}: not BF16")
    if base % 2:
        raise ValueError(f"region {region} has an odd base address {base:#x}: BF16 values must start on 2 bytes")
    if stride % 2:
        raise ValueError(f"region {region} has an odd block stride {stride}: BF16 blocks must start on 2 bytes")
    return region, base, stride, nbytes


def check_copy_pairs(src: np.ndarray, dst: np.ndarray) -> None:
    """Refuse block-copy pairs a parallel copy would race on: unequal lengths, a repeated
    destination, a block that is both a source and a destination."""
    if src.size != dst.size:
        raise ValueError(f"copy_blocks needs as many src as dst blocks, got {src.size} and {dst.size}")
    if np.unique(dst).size != dst.size:
        raise ValueError(f"copy_blocks destinations repeat: {dst.tolist()}")
    both = np.intersect1d(src, dst)
    if both.size:
        raise ValueError(f"copy_blocks blocks {both.tolist()} are both a source and a destination")


@runtime_checkable
class GpuBackend(Protocol):
    """What pagedkv needs from a device: the contract every backend honours, checked rule
    by rule by `pagedkv.testing.backend_conformance` (docs/BACKENDS.md says how to write
    one). `HostBackend`, `CudaBackend` and `pagedkv.backends.torch_arena` implement it.

    For every method: arguments and ranges are checked before anything is written, so a
    call that raises changes nothing. Host buffers are C-contiguous bytes-like objects or
    numpy arrays of any dtype. Streams are int handles; `*_async`, `copy_d2d` and the block
    calls are ordered on their stream and `synchronize` waits for it. Zero-byte ranges
    and empty block lists do nothing.

    Beyond this protocol a backend may define `supports(name) -> bool` and the optional
    methods of the capabilities it states (`pagedkv.capabilities`: pinned memory, stream
    waits, host views, the device kind); without `supports` it offers only the protocol.
    """

    def alloc(self, nbytes: int) -> DevicePtr:
        """Allocate `nbytes` (a positive int, else ValueError naming it): a non-null pointer,
        256-byte aligned, overlapping no live allocation, contents undefined.
        DeviceOutOfMemory (a MemoryError) when it does not fit, with nothing taken."""
        ...

    def free(self, ptr: DevicePtr) -> None:
        """Free the allocation starting at `ptr`. A double free, a pointer inside an
        allocation and one the backend never returned raise DeviceMemoryError naming it."""
        ...

    def memset_async(self, ptr: DevicePtr, value: int, nbytes: int, stream: int) -> None:
        """Set `nbytes` (>= 0) bytes at `ptr` to the byte `value` (0..255; else ValueError),
        on `stream`."""
        ...

    def copy_h2d(self, src: Any, dst: DevicePtr) -> None:
        """Copy every byte of host buffer `src` to `dst`; returns when done (pageable or
        pinned `src`). A strided buffer raises ValueError, a non-buffer TypeError."""
        ...

    def copy_d2h(self, src: DevicePtr, dst: Any) -> None:
        """Fill writable host buffer `dst` from `src` (len(dst) bytes); returns when done.
        A read-only or strided `dst` raises ValueError."""
        ...

    def copy_d2d(self, src: DevicePtr, dst: DevicePtr, nbytes: int, stream: int) -> None:
        """Copy `nbytes` (>= 0) from `src` to `dst` on `stream`."""
        ...

    def synchronize(self, stream: int) -> None:
        """Wait until all work enqueued on `stream` has finished; ValueError for a stream
        that is not (or no longer) one of the backend's."""
        ...

    def synchronize_all(self) -> None:
        """Wait until the work enqueued on every stream of this backend has finished (call
        it before freeing memory that queued work may still touch)."""
        ...

    def default_stream(self) -> int:
        """The handle of the default stream."""
        ...

    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device, ints with 0 <= free <= total; an
        allocation takes at least its size from free, its free gives it back."""
        ...

    def create_stream(self) -> int:
        """A new stream handle, distinct from the default and every live stream, to be
        destroyed with `destroy_stream`."""
        ...

    def destroy_stream(self, stream: int) -> None:
        """Destroy a stream made by `create_stream` (after its work has finished); the
        default stream, a destroyed or an unknown handle raise ValueError naming it."""
        ...

    def create_block_regions(self, rows: Sequence[tuple[int, int, int]]) -> BlockRegions:
        """Make a region table from `(base, stride, nbytes)` rows (validated as
        `BlockRegions.from_rows` does), with whatever device copy the backend needs."""
        ...

    def destroy_block_regions(self, regions: BlockRegions) -> None:
        """Release what `create_block_regions` allocated for `regions`."""
        ...

    def fill_blocks(
        self, regions: BlockRegions, blocks: Sequence[int], value: int, stream: int
    ) -> None:
        """Set the `nbytes` bytes of every listed block in every region to `value` (the gap
        up to the stride untouched). A negative index or a value outside 0..255 raises
        ValueError, a block past a region's allocation IndexError or DeviceMemoryError."""
        ...

    def copy_blocks(
        self, regions: BlockRegions, src: Sequence[int], dst: Sequence[int], stream: int
    ) -> None:
        """Copy block `src[i]` over block `dst[i]` in every region. Unequal lengths, a
        repeated `dst` or a block in both raise ValueError (`check_copy_pairs`); bounds as
        for `fill_blocks`."""
        ...

    def reduce_bf16_blocks(
        self, regions: BlockRegions, region: int, blocks: Sequence[int], stream: int
    ) -> Bf16Stats:
        """Sum, sum of squares and sum of |x| over the BF16 values of the listed blocks of
        region `region` (IndexError when out of range), each exact then rounded once to
        float64 (pagedkv.exact_sum: equal to math.fsum of the widened values), so identical
        on every backend and grid; the row's base, stride and block size must be even.
        Returns when the result is on the host. No blocks give (0.0, 0.0, 0.0)."""
        ...
