"""TorchArenaBackend: the GpuBackend contract over memory from torch's CPU allocator.

The backend of an engine that already owns its memory through torch: every `alloc` is a
`torch.empty` uint8 tensor that the backend keeps alive until `free`, and device
pointers are the tensors' real host addresses (256-byte aligned within them), so pool
views export kDLCPU tensors that torch reads in place. Every operation is a torch op on
those tensors: memsets are `fill_`, copies `copy_`, the block calls index `as_strided`
views of a pool, and the BF16 reduction widens through `torch.bfloat16` and sums exactly.
Work runs at once, so every stream is always synchronised. Needs torch (the `interop`
extra installs the CPU build).
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Sequence

import torch

from ..core.streams import stream_handle
from ..core.validate import positive_int
from ..errors import DeviceMemoryError, DeviceOutOfMemory
from .capabilities import check_capability_name
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
"""Every allocation starts on a multiple of this many bytes."""


class TorchArenaBackend:
    """Device memory as torch CPU tensors, at most `capacity_bytes` live at once (beyond
    it `alloc` raises DeviceOutOfMemory). `allocate(nbytes)` makes each tensor (default
    `torch.empty(nbytes, dtype=torch.uint8)`): pass the engine's own allocator there."""

    SUPPORTED = frozenset({"batched_copy", "device:cpu"})
    """The capabilities this backend states (see pagedkv.capabilities)."""

    def __init__(self, capacity_bytes: int = 1 << 30, allocate=None):
        self._capacity = positive_int(capacity_bytes, "capacity_bytes")
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        self._used = 0
        self._bases: list[int] = []
        self._tensors: dict[int, torch.Tensor] = {}  # aligned base -> exactly nbytes of its tensor
        self._streams = {0}
        self._next_stream = 1

    def supports(self, name: str) -> bool:
        """True for "batched_copy" and "device:cpu"; ValueError for an unknown name."""
        return check_capability_name(name) in self.SUPPORTED

    # -- memory ---------------------------------------------------------------------

    def alloc(self, nbytes: int) -> DevicePtr:
        """A tensor of `nbytes` from the allocator (contents undefined); DeviceOutOfMemory
        beyond the capacity, or when the allocator itself runs out."""
        nbytes = check_alloc_size(nbytes)
        free = self._capacity - self._used
        if nbytes > free:
            raise DeviceOutOfMemory(f"TorchArenaBackend out of memory: asked {nbytes} bytes, {free} free of {self._capacity}")
        try:
            whole = self._allocate(nbytes + ALIGNMENT - 1)
        except RuntimeError as err:  # torch reports allocation failure as RuntimeError
            raise DeviceOutOfMemory(f"TorchArenaBackend: the allocator failed for {nbytes} bytes: {err}") from None
        skip = -whole.data_ptr() % ALIGNMENT
        tensor = whole[skip : skip + nbytes]
        base = tensor.data_ptr()
        self._tensors[base] = tensor
        bisect.insort(self._bases, base)
        self._used += nbytes
        return DevicePtr(base)

    def free(self, ptr: DevicePtr) -> None:
        """Drop the tensor allocated at `ptr`; anything else raises DeviceMemoryError."""
        base = int(ptr)
        tensor = self._tensors.pop(base, None)
        if tensor is None:
            what = "not the start of an allocation" if self._find(base) is not None else "unknown or already freed"
            raise DeviceMemoryError(f"free of {DevicePtr(base)!r}: {what}")
        self._bases.remove(base)
        self._used -= tensor.numel()

    def _find(self, address: int) -> int | None:
        i = bisect.bisect_right(self._bases, address) - 1
        if i >= 0 and address < self._bases[i] + self._tensors[self._bases[i]].numel():
            return self._bases[i]
        return None

    def tensor(self, ptr: DevicePtr, nbytes: int) -> torch.Tensor:
        """The `nbytes` bytes at `ptr` as a uint8 tensor sharing the memory; DeviceMemoryError
        outside a live allocation or past its end."""
        nbytes = check_byte_count(nbytes)
        address = int(ptr)
        base = self._find(address)
        if base is None:
            raise DeviceMemoryError(f"{DevicePtr(address)!r} is not inside any live allocation")
        whole = self._tensors[base]
        start = address - base
        if start + nbytes > whole.numel():
            raise DeviceMemoryError(
                f"range {DevicePtr(address)!r} + {nbytes} bytes runs past the end of the "
                f"{whole.numel()}-byte allocation at {DevicePtr(base)!r}"
            )
        return whole[start : start + nbytes]

    def live_allocations(self) -> int:
        """How many allocations are live."""
        return len(self._tensors)

    def mem_info(self) -> tuple[int, int]:
        """(capacity minus live bytes, capacity)."""
        return self._capacity - self._used, self._capacity

    # -- streams --------------------------------------------------------------------

    def default_stream(self) -> int:
        """Stream 0."""
        return 0

    def create_stream(self) -> int:
        """A new stream handle."""
        handle, self._next_stream = self._next_stream, self._next_stream + 1
        self._streams.add(handle)
        return handle

    def destroy_stream(self, stream: int) -> None:
        """Forget `stream`; the default stream and unknown handles raise ValueError."""
        if stream == 0 or stream not in self._streams:
            raise ValueError(f"cannot destroy stream {stream!r}: not a stream made by create_stream")
        self._streams.discard(stream)

    def synchronize(self, stream: int) -> None:
        """Nothing to wait for; ValueError for an unknown stream."""
        handle = stream_handle(stream)
        if handle not in self._streams:
            raise ValueError(f"unknown stream {handle!r}")

    def synchronize_all(self) -> None:
        """Nothing to wait for on any stream."""

    # -- copies and memset ----------------------------------------------------------

    def memset_async(self, ptr: DevicePtr, value: int, nbytes: int, stream: int) -> None:
        """`fill_` of `nbytes` bytes at `ptr`."""
        value = check_fill_byte(value)
        self.synchronize(stream)
        self.tensor(ptr, nbytes).fill_(value)

    def copy_h2d(self, src: Any, dst: DevicePtr) -> None:
        """Every byte of host buffer `src` copied to `dst`."""
        data = host_bytes(src, writable=False)
        target = self.tensor(dst, data.nbytes)
        if data.nbytes:
            target.copy_(torch.from_numpy(data.copy() if not data.flags.writeable else data))

    def copy_d2h(self, src: DevicePtr, dst: Any) -> None:
        """Writable host buffer `dst` filled from `src`."""
        out = host_bytes(dst, writable=True)
        source = self.tensor(src, out.nbytes)
        if out.nbytes:
            torch.from_numpy(out).copy_(source)

    def copy_d2d(self, src: DevicePtr, dst: DevicePtr, nbytes: int, stream: int) -> None:
        """`nbytes` from `src` to `dst` (overlap behaves as memmove)."""
        nbytes = check_byte_count(nbytes)
        self.synchronize(stream)
        source, target = self.tensor(src, nbytes), self.tensor(dst, nbytes)
        target.copy_(source.clone())

    # -- block calls ----------------------------------------------------------------

    def create_block_regions(self, rows: Sequence[tuple[int, int, int]]) -> BlockRegions:
        """A host-side region table."""
        return BlockRegions.from_rows(rows)

    def destroy_block_regions(self, regions: BlockRegions) -> None:
        """Nothing to release."""

    def _rows(self, regions: BlockRegions, rows: Sequence[int], top: int) -> list[torch.Tensor]:
        """`[top + 1, nbytes]` strided views of the given rows, each checked against its
        allocation before any is written (IndexError past the end)."""
        views = []
        for r in rows:
            base, stride, nbytes = int(regions.bases[r]), int(regions.strides[r]), int(regions.nbytes[r])
            try:
                whole = self.tensor(DevicePtr(base), top * stride + nbytes)
            except DeviceMemoryError as err:
                raise IndexError(f"block {top} of region {r} is past its allocation: {err}") from None
            views.append(whole.as_strided((top + 1, nbytes), (stride, 1)))
        return views

    def fill_blocks(self, regions: BlockRegions, blocks: Sequence[int], value: int, stream: int) -> None:
        """Every listed block of every row set to `value` (an index_fill_ per row)."""
        byte = check_fill_byte(value)
        idx = as_block_array(blocks)
        self.synchronize(stream)
        if idx.size == 0:
            return
        index = torch.from_numpy(idx)
        for view in self._rows(regions, range(len(regions)), int(idx.max())):
            view.index_fill_(0, index, byte)

    def copy_blocks(self, regions: BlockRegions, src: Sequence[int], dst: Sequence[int], stream: int) -> None:
        """Block `src[i]` over `dst[i]` in every row (a gather, then an index_copy_ per row)."""
        s, d = as_block_array(src, "src"), as_block_array(dst, "dst")
        check_copy_pairs(s, d)
        self.synchronize(stream)
        if s.size == 0:
            return
        si, di = torch.from_numpy(s), torch.from_numpy(d)
        for view in self._rows(regions, range(len(regions)), int(max(s.max(), d.max()))):
            view.index_copy_(0, di, view.index_select(0, si))

    def reduce_bf16_blocks(self, regions: BlockRegions, region: int, blocks: Sequence[int], stream: int) -> Bf16Stats:
        """(sum, sum of squares, sum of |x|) of the BF16 values of the listed blocks of row
        `region`, each exact then rounded once (math.fsum over the float64 widening)."""
        region, _, _, nbytes = check_bf16_row(regions, region)
        idx = as_block_array(blocks)
        self.synchronize(stream)
        if idx.size == 0:
            return Bf16Stats(0.0, 0.0, 0.0)
        (view,) = self._rows(regions, [region], int(idx.max()))
        values = view.index_select(0, torch.from_numpy(idx)).contiguous().view(torch.bfloat16).to(torch.float64)
        if not bool(torch.isfinite(values).all()):
            return Bf16Stats(float(values.sum()), float((values * values).sum()), float(values.abs().sum()))
        return Bf16Stats(*(math.fsum(v.flatten().tolist()) for v in (values, values * values, values.abs())))
