"""Block kernels of CudaBackend: loading the NVRTC-compiled modules, region tables, and
the fill, copy, exact BF16 reduction and exact every-format checksum launches with their
staging slots.

Grids are sized from the occupancy the driver reports for each kernel at its block
size (cuOccupancyMaxActiveBlocksPerMultiprocessor) times the SM count, capped by the
work items; the kernels loop grid-stride beyond that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..backends.protocol import (
    Bf16Stats,
    BlockRegions,
    DevicePtr,
    as_block_array,
    check_bf16_row,
    check_copy_pairs,
    check_fill_byte,
)
from ..core.dtype import KvCacheDtype
from ..core.exact_sum import F32_RESULT_WORDS, RESULT_WORDS, stats_from_f32_words, stats_from_words
from . import nvrtc
from .errors import check
from .kv_kernels import CHECKSUM_KERNELS, FORMAT_CODES, check_kv_side_row, checksum_chunks
from .kv_kernels import KERNEL_TABLE as KV_KERNEL_TABLE
from .launch import CopyArgs, CopyBatchArgs, FillArgs, KernelLauncher, ReduceFinalArgs, ReducePartialArgs
from .staging import StagingRing, StagingSlot

THREADS = 256
"""Threads per CTA of the fill and copy kernels."""

REDUCE_THREADS = nvrtc.REDUCE_THREADS
"""Threads per CTA of the reduction kernels (compiled into reduce_bf16.cu as a -D option)."""

_INT32_MAX = 2**31 - 1
_RESULT_BYTES = 8 * RESULT_WORDS
_F32_RESULT_BYTES = 8 * F32_RESULT_WORDS

# kernel source file -> (kernel name, argument structure, threads per CTA) of each kernel
KERNELS = {
    "fill_blocks.cu": [("pagedkv_fill_blocks", FillArgs, THREADS)],
    "copy_blocks.cu": [("pagedkv_copy_blocks", CopyArgs, THREADS)],
    "copy_batch.cu": [("pagedkv_copy_batch", CopyBatchArgs, THREADS)],
    "reduce_bf16.cu": [
        ("pagedkv_reduce_bf16_partial", ReducePartialArgs, REDUCE_THREADS),
        ("pagedkv_reduce_bf16_final", ReduceFinalArgs, REDUCE_THREADS),
    ],
    "kv_rows.cu": KV_KERNEL_TABLE + [(name, args, REDUCE_THREADS) for name, args in CHECKSUM_KERNELS],
}


def _int32_indices(idx: np.ndarray, what: str) -> np.ndarray:
    if idx.size and int(idx.max()) > _INT32_MAX:
        raise ValueError(f"{what} holds block index {int(idx.max())}, above the kernels' limit {_INT32_MAX}")
    return idx.astype(np.int32)


class LoadedModule:
    """A loaded CUDA module with the CUBIN bytes it was loaded from, kept alive with it."""

    def __init__(self, filename: str, handle: Any, cubin: bytes):
        self.filename = filename
        self.handle = handle
        self.cubin = cubin


class BlockKernels:
    """The kernel half of CudaBackend (a mixin: CudaBackend provides `_enter`, `_lock`,
    `_stream`, `alloc`/`free`/`copy_h2d`, `sm_count` and the state it initialises)."""

    _modules: list[LoadedModule]
    _launchers: dict[str, KernelLauncher]
    _max_grid: dict[str, int]
    _region_limits: dict[int, np.ndarray]
    _staging: StagingRing

    def _load_kernels(self, driver, cache_dir: str | None) -> None:
        arch = nvrtc.arch_option(*self.compute_capability)
        for filename, kernels in KERNELS.items():
            compiled = nvrtc.compile_cached(nvrtc.SOURCE_DIR / filename, arch, Path(cache_dir) if cache_dir else None)
            module = check(driver.cuModuleLoadData(compiled.cubin), "cuModuleLoadData", filename)
            self._modules.append(LoadedModule(filename, module, compiled.cubin))
            for name, args_type, threads in kernels:
                function = check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction", name)
                per_sm = int(check(
                    driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, 0),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor", name,
                ))
                self._launchers[name] = KernelLauncher(name, function, args_type, threads)
                self._max_grid[name] = max(1, per_sm) * self.sm_count

    def _grid(self, kernel: str, items: int) -> int:
        return max(1, min(items, self._max_grid[kernel]))

    def max_grid(self, kernel: str) -> int:
        """The most CTAs one launch of `kernel` uses: its occupancy per SM times the SMs."""
        return self._max_grid[kernel]

    # -- region tables --------------------------------------------------------------

    def create_block_regions(self, rows: Sequence[tuple[int, int, int]]) -> BlockRegions:
        """A region table whose `(base, stride, nbytes)` rows are uploaded once to a device
        buffer (`device_table`); each row inside this backend's allocations also bounds the
        block indices the kernels accept in that row."""
        regions = BlockRegions.from_rows(rows)
        if len(regions) == 0:
            return regions
        if len(regions) > _INT32_MAX:
            raise ValueError(f"{len(regions)} regions is above the kernels' limit {_INT32_MAX}")
        table = np.ascontiguousarray(np.stack([regions.bases, regions.strides, regions.nbytes], axis=1), dtype=np.int64)
        limits = self._block_limits(regions)
        ptr = self.alloc(table.nbytes)
        try:
            self._upload_private(table, ptr)
        except BaseException:
            self.free(ptr)
            raise
        regions.device_table = ptr
        with self._lock:
            self._region_limits[int(ptr)] = limits
        return regions

    def _upload_private(self, host: np.ndarray, ptr: DevicePtr) -> None:
        """Copy `host` to `ptr` through pinned memory on a stream of its own, waited for: no
        synchronous copy on the legacy default stream (it would serialise every blocking
        stream and invalidate another thread's global-mode graph capture)."""
        pinned = self.alloc_pinned(host.nbytes)
        try:
            pinned.array[:] = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
            stream = self.create_stream()
            try:
                self.copy_h2d_async(pinned, ptr, stream)
                self.synchronize(stream)
            finally:
                self.destroy_stream(stream)
        finally:
            pinned.free()

    def _block_limits(self, regions: BlockRegions) -> np.ndarray:
        """Per row, the number of blocks it has room for inside its allocation (rows outside
        this backend's allocations are not bounded: 2**31)."""
        limits = []
        with self._lock:
            for base, stride, nbytes in zip(regions.bases.tolist(), regions.strides.tolist(), regions.nbytes.tolist()):
                end = self._allocation_end(base)
                if end is None:
                    limits.append(_INT32_MAX + 1)
                    continue
                if base + nbytes > end:
                    raise ValueError(f"region at {DevicePtr(base)!r}: one block of {nbytes} bytes runs past its allocation")
                limits.append(min(_INT32_MAX + 1, (end - base - nbytes) // stride + 1))
        return np.asarray(limits, dtype=np.int64)

    def destroy_block_regions(self, regions: BlockRegions) -> None:
        """Free the table's device copy; a second call does nothing."""
        if regions.device_table is None:
            return
        ptr = regions.device_table
        self.free(ptr)  # first: a failed free keeps the table recorded for a retry
        regions.device_table = None
        with self._lock:
            self._region_limits.pop(int(ptr), None)

    def _table(self, regions: BlockRegions, top: int, row: int | None = None) -> int:
        """The device table of `regions`, after checking block index `top` fits every row
        (or only row `row`)."""
        if regions.device_table is None:
            raise ValueError("these BlockRegions have no device table: make them with create_block_regions")
        limits = self._region_limits.get(int(regions.device_table))
        if limits is None:
            raise ValueError("these BlockRegions belong to another backend or were destroyed")
        rows = limits if row is None else limits[row : row + 1]
        if top >= int(rows.min()):
            which = int(np.argmin(rows)) if row is None else row
            raise IndexError(f"block {top} out of range: region {which} holds {int(limits[which])} blocks")
        return int(regions.device_table)

    # -- launches -------------------------------------------------------------------

    def fill_blocks(self, regions: BlockRegions, blocks: Sequence[int], value: int, stream: int) -> None:
        """Every byte of the listed blocks in every region set to `value`: one kernel launch."""
        byte = check_fill_byte(value)
        handle = self._stream(stream)
        idx = _int32_indices(as_block_array(blocks), "blocks")
        if idx.size == 0 or len(regions) == 0:
            return
        table = self._table(regions, int(idx.max()))
        name = "pagedkv_fill_blocks"
        with self._lock:
            self._enter()
            with self._staging.in_use(idx.nbytes, handle) as slot:
                slot.upload([idx], handle)
                self._launchers[name].launch(
                    self._grid(name, len(regions) * idx.size), handle,
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
        name = "pagedkv_copy_blocks"
        with self._lock:
            self._enter()
            with self._staging.in_use(s.nbytes + d.nbytes, handle) as slot:
                slot.upload([s, d], handle)
                self._launchers[name].launch(
                    self._grid(name, len(regions) * s.size), handle,
                    table=table, num_rows=len(regions), src=slot.device, dst=slot.device + s.nbytes, num_pairs=s.size,
                )

    def reduce_bf16_blocks(self, regions: BlockRegions, region: int, blocks: Sequence[int], stream: int) -> Bf16Stats:
        """Exact sum, sum of squares and sum of |x| of the BF16 values in the listed blocks
        of row `region`, each rounded once to float64 (pagedkv.exact_sum): the same on every
        grid and GPU. The row's base, stride and block size must be even. Waits for the
        result without holding the backend's lock."""
        handle = self._stream(stream)
        region, base, stride, nbytes = check_bf16_row(regions, region)
        idx = _int32_indices(as_block_array(blocks), "blocks")
        if idx.size == 0:
            return Bf16Stats(0.0, 0.0, 0.0)
        self._table(regions, int(idx.max()), region)
        partial, final = "pagedkv_reduce_bf16_partial", "pagedkv_reduce_bf16_final"
        grid = self._grid(partial, idx.size)
        partials_at = -(-idx.nbytes // 16) * 16
        out_at = partials_at + _RESULT_BYTES * grid
        with self._lock:
            self._enter()
            with self._staging.in_use(out_at + _RESULT_BYTES, handle) as slot:
                slot.upload([idx], handle)
                self._launchers[partial].launch(
                    grid, handle,
                    base=base, stride=stride, nbytes=nbytes,
                    blocks=slot.device, num_blocks=idx.size, partials=slot.device + partials_at,
                )
                self._launchers[final].launch(
                    1, handle, partials=slot.device + partials_at, num_partials=grid, out=slot.device + out_at,
                )
                slot.download(out_at, _RESULT_BYTES, handle)
            slot.held = True
        return self._reduction_result(slot, out_at)

    def reduce_kv_blocks(
        self, regions: BlockRegions, region: int, blocks: Sequence[int], fmt: KvCacheDtype,
        block_size: int, row_elements: int, stream: int, layout: str = "NHD", heads: int | None = None,
    ) -> Bf16Stats:
        """Exact sum, sum of squares and sum of |x| of every stored value of the listed blocks
        of row `region`, a pool of side format `fmt` with `block_size` tokens of
        `row_elements` values a block (docs/FORMATS.md), decoded without unrotation (fp8 as
        its E4M3 values, without the per-tensor scale): each sum exact, then rounded once to
        float64 (pagedkv.exact_sum), so equal to math.fsum over the host decode on every grid
        and GPU; NaN/inf decoded values follow exact_sum's rules. BF16 runs the BF16
        reduction (`reduce_bf16_blocks`). `layout` ("NHD" or "HND") and `heads` (of
        `row_elements // heads` values; required for HND, ValueError naming it when None;
        NHD does not use it) place the pieces (docs/LAYOUTS.md): the sums are the
        same numbers in both layouts (an HND block of a grouped format goes to the kernel as
        its head chunks, kv_kernels.checksum_chunks). Two launches on `stream` and one copy
        of the result words: the pool bytes never leave the device. Waits for the result
        without holding the backend's lock. No blocks give (0.0, 0.0, 0.0). A block past the
        row's end raises IndexError naming it (before any limit of the chunk indices)."""
        handle = self._stream(stream)
        region, base, stride, fmt = check_kv_side_row(regions, region, fmt, block_size, row_elements)
        block_idx = as_block_array(blocks)
        if block_idx.size:
            self._table(regions, int(block_idx.max()), region)
        idx, stride, row_elements = checksum_chunks(block_idx, fmt, block_size, row_elements, stride, layout, heads)
        if fmt is KvCacheDtype.BF16:
            return self.reduce_bf16_blocks(regions, region, blocks, stream)
        idx = _int32_indices(idx, "blocks")
        if idx.size == 0:
            return Bf16Stats(0.0, 0.0, 0.0)
        partial, final = "pagedkv_kv_checksum_partial", "pagedkv_kv_checksum_final"
        grid = self._grid(partial, idx.size)
        partials_at = -(-idx.nbytes // 16) * 16
        out_at = partials_at + _F32_RESULT_BYTES * grid
        with self._lock:
            self._enter()
            with self._staging.in_use(out_at + _F32_RESULT_BYTES, handle) as slot:
                slot.upload([idx], handle)
                self._launchers[partial].launch(
                    grid, handle,
                    pool=base, block_stride=stride, blocks=slot.device, num_blocks=idx.size,
                    fmt=FORMAT_CODES[fmt], row_elements=row_elements, block_size=block_size,
                    partials=slot.device + partials_at,
                )
                self._launchers[final].launch(
                    1, handle, partials=slot.device + partials_at, num_partials=grid, out=slot.device + out_at,
                )
                slot.download(out_at, _F32_RESULT_BYTES, handle)
            slot.held = True
        return self._reduction_result(slot, out_at, _F32_RESULT_BYTES, stats_from_f32_words)

    def _reduction_result(self, slot: StagingSlot, out_at: int, nbytes: int = _RESULT_BYTES,
                          parse=stats_from_words) -> Bf16Stats:
        """Wait (without the lock) for a held slot's reduction of `nbytes` result bytes at
        `out_at`, read them, let the slot go and turn the words into Bf16Stats with `parse`."""
        try:
            slot.wait()
            with self._lock:
                words = slot.host[out_at : out_at + nbytes].view(np.int64).tolist()
        finally:
            with self._lock:
                slot.held = False
                self._idle.notify_all()
        return parse(words)
