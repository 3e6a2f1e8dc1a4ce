"""PerRangeBlockOps: the block calls of GpuBackend from the required memory calls alone.

A backend that has no kernels of its own mixes this in and gets `create_block_regions`,
`destroy_block_regions`, `fill_blocks`, `copy_blocks` and `reduce_bf16_blocks`, each made
of one `memset_async` / `copy_d2d` per (row, block), or one `copy_d2h` per block for the
reduction. That is slow for many blocks (hence the backend does not state "batched_copy")
but exact. Bounds are the backend's own: its memsets and copies must raise
DeviceMemoryError for a range past an allocation, before writing anything, so every
range is checked before the first is written.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..core.exact_sum import bf16_stats
from .protocol import (
    Bf16Stats,
    BlockRegions,
    DevicePtr,
    as_block_array,
    check_bf16_row,
    check_copy_pairs,
    check_fill_byte,
)


class PerRangeBlockOps:
    """Block calls over `self.memset_async`, `self.copy_d2d`, `self.copy_d2h` and
    `self.mem_range_ok(ptr, nbytes)` (True when the range lies inside one allocation)."""

    def mem_range_ok(self, ptr: DevicePtr, nbytes: int) -> bool:  # pragma: no cover - the backend's
        """True when `[ptr, ptr + nbytes)` lies inside one live allocation of the backend
        (the backend using this mixin provides it)."""
        raise NotImplementedError

    def create_block_regions(self, rows: Sequence[tuple[int, int, int]]) -> BlockRegions:
        """A host-side region table (no device copy is needed)."""
        return BlockRegions.from_rows(rows)

    def destroy_block_regions(self, regions: BlockRegions) -> None:
        """Nothing to release."""

    def _check_blocks(self, regions: BlockRegions, rows: range, blocks: np.ndarray) -> None:
        top = int(blocks.max())
        for r in rows:
            base, stride, nbytes = (int(regions.bases[r]), int(regions.strides[r]), int(regions.nbytes[r]))
            if not self.mem_range_ok(DevicePtr(base), top * stride + nbytes):
                raise IndexError(f"block {top} of region {r} runs past the allocation at {DevicePtr(base)!r}")

    def _block(self, regions: BlockRegions, r: int, block: int) -> DevicePtr:
        return DevicePtr(int(regions.bases[r]) + int(block) * int(regions.strides[r]))

    def fill_blocks(self, regions: BlockRegions, blocks: Sequence[int], value: int, stream: Any) -> None:
        """One memset per (row, block)."""
        byte = check_fill_byte(value)
        idx = as_block_array(blocks)
        self.synchronize(stream)  # validates the stream before anything is written
        if idx.size == 0:
            return
        self._check_blocks(regions, range(len(regions)), idx)
        for r in range(len(regions)):
            for b in idx.tolist():
                self.memset_async(self._block(regions, r, b), byte, int(regions.nbytes[r]), stream)

    def copy_blocks(self, regions: BlockRegions, src: Sequence[int], dst: Sequence[int], stream: Any) -> None:
        """One copy_d2d per (row, pair); no destination is a source, so order does not matter."""
        s, d = as_block_array(src, "src"), as_block_array(dst, "dst")
        check_copy_pairs(s, d)
        self.synchronize(stream)
        if s.size == 0:
            return
        self._check_blocks(regions, range(len(regions)), np.concatenate([s, d]))
        for r in range(len(regions)):
            for a, b in zip(s.tolist(), d.tolist()):
                self.copy_d2d(self._block(regions, r, a), self._block(regions, r, b), int(regions.nbytes[r]), stream)

    def reduce_bf16_blocks(self, regions: BlockRegions, region: int, blocks: Sequence[int], stream: Any) -> Bf16Stats:
        """Each block copied to the host after `synchronize(stream)`, summed exactly."""
        region, _, _, nbytes = check_bf16_row(regions, region)
        idx = as_block_array(blocks)
        self.synchronize(stream)
        if idx.size == 0:
            return Bf16Stats(0.0, 0.0, 0.0)
        self._check_blocks(regions, range(region, region + 1), idx)
        raw = np.empty((idx.size, nbytes), np.uint8)
        for i, b in enumerate(idx.tolist()):
            self.copy_d2h(self._block(regions, region, b), raw[i])
        return bf16_stats(raw.reshape(-1).view("<u2"))  # exact, as every backend (pagedkv.exact_sum)
