"""ElasticBlockAllocator: a BlockAllocator whose blocks are backed by memory on demand.

Blocks `[0, resident)` have memory; the free list holds the free ones among them and hands
out the lowest id first (a min-heap), so used blocks gather at the bottom and the tail
empties for `trim`. When the free list runs out, the allocator asks its `grow` callback to
back the next step of blocks (in every layer's pools at once), then, if the device cannot
give the memory, lets the reclaimer evict; when neither works, KvCacheExhausted with
nothing changed. Invariants beyond BlockAllocator's: every free-list entry is below
`resident`, every block at or above it has count 0, and the free list is a min-heap.
"""

from __future__ import annotations

import functools
import heapq
from typing import Iterable, Protocol

from .allocator import BlockAllocator, BlockReclaimer
from .errors import DeviceOutOfMemory, KvCacheError, KvCacheExhausted, RefCountError
from .validate import non_negative_int


class LowestFirst(list):
    """A free list kept as a min-heap: `pop` takes the lowest block, `append` and `extend`
    push. NOTE: the push and pop are instance attributes bound to `heapq` (C functions), so
    BlockAllocator's free paths (`self._free.append(b)`) keep one C call per block."""

    def __init__(self, blocks: Iterable[int] = ()):
        super().__init__(blocks)
        heapq.heapify(self)
        self.pop = functools.partial(heapq.heappop, self)  # type: ignore[method-assign]
        self.append = functools.partial(heapq.heappush, self)  # type: ignore[method-assign]

    def extend(self, blocks: Iterable[int]) -> None:  # type: ignore[override]
        """Push every block of `blocks`."""
        push = heapq.heappush
        for block in blocks:
            push(self, block)


class BlockBacking(Protocol):
    """The memory behind an ElasticBlockAllocator's blocks (KvPools in elastic mode)."""

    def grow(self, min_blocks: int) -> int:
        """Back at least `min_blocks` blocks (capped at the ceiling) and return how many are
        backed; DeviceOutOfMemory having backed nothing new when the device has no memory."""
        ...

    def trim(self, keep_blocks: int) -> int:
        """Give back memory above what `keep_blocks` blocks need; return how many are backed."""
        ...

    def resident_blocks(self) -> int:
        """How many blocks are backed now (also after a failed `trim`)."""
        ...


class ElasticBlockAllocator(BlockAllocator):
    """A BlockAllocator over `num_blocks` blocks (a ceiling) of which only the first
    `resident_blocks()` have memory, provided by `backing` (a `BlockBacking`)."""

    def __init__(self, num_blocks: int, backing: BlockBacking, trace: bool = False):
        super().__init__(num_blocks, trace)
        self._free = LowestFirst()
        self._backing = backing
        self._resident = min(backing.resident_blocks(), self._num_blocks)  # backed from the start
        list.extend(self._free, range(self._resident))

    # -- allocation -------------------------------------------------------------------

    def alloc_block(self) -> int:
        """The lowest free resident block, with count 1; with none free, the next step of
        blocks is mapped first, then the reclaimer evicts; KvCacheExhausted when neither can."""
        try:
            block = heapq.heappop(self._free)
        except IndexError:
            return self._alloc_after_growth()
        self._refs[block] = 1
        if self._tracer is not None:
            self._tracer.record(block, "alloc", 1)
        return block

    def _alloc_after_growth(self) -> int:
        reclaimer = self._make_free(1)
        block = heapq.heappop(self._free)
        self._refs[block] = 1
        if self._tracer is not None:
            self._tracer.record(block, "alloc", 1)
        if reclaimer is not None:
            self._deliver(reclaimer, [block])
        return block

    def alloc_blocks(self, n: int) -> list[int]:
        """`n` blocks with count 1, lowest ids first (what `n` `alloc_block` calls give).
        All or nothing: when the free resident blocks are short, memory is mapped for the
        rest, then the reclaimer evicts what the ceiling cannot give; KvCacheExhausted with
        nothing taken, mapped or evicted when even that cannot make `n` free."""
        if type(n) is not int or n < 0:
            n = non_negative_int(n, "number of blocks")
        free = self._free
        reclaimer = self._make_free(n) if n > len(free) else None
        pop = heapq.heappop
        taken = [pop(free) for _ in range(n)]
        refs = self._refs
        for block in taken:
            refs[block] = 1
        if self._tracer is not None:
            for block in taken:
                self._tracer.record(block, "alloc", 1)
        if reclaimer is not None:
            self._deliver(reclaimer, taken)
        return taken

    def _make_free(self, n: int) -> BlockReclaimer | None:
        """Make at least `n` blocks free and resident: map more first, then evict. Returns
        the reclaimer when it evicted (its events are due), None otherwise. On failure
        whatever this call mapped is given back and KvCacheExhausted is raised."""
        free = self._free
        before = self._resident
        device_error: DeviceOutOfMemory | None = None
        if self._resident < self._num_blocks:
            try:
                self._grow_to(self._resident + n - len(free))
            except DeviceOutOfMemory as err:
                device_error = err
        if n <= len(free):
            return None
        reclaimer = self._reclaimer
        if reclaimer is not None:
            if reclaimer.reclaim(n - len(free)) and n <= len(free):
                return reclaimer
        try:
            if self._resident > before:
                self._trim_to(before)
        finally:
            if reclaimer is not None:
                self._deliver(reclaimer, [])
        raise self._exhausted_elastic(n, device_error)

    def _grow_to(self, min_blocks: int) -> None:
        before = self._resident
        resident = self._backing.grow(min_blocks)
        if resident > before:
            list.extend(self._free, range(before, resident))  # larger than every entry: still a heap
            self._resident = resident

    def _trim_to(self, keep_blocks: int) -> None:
        """Give back memory above `keep_blocks` (every block there must be free)."""
        try:
            self._backing.trim(keep_blocks)
        finally:
            self._drop_above(self._backing.resident_blocks())

    def _drop_above(self, resident: int) -> None:
        if resident < self._resident:
            kept = [block for block in self._free if block < resident]
            self._free[:] = kept
            heapq.heapify(self._free)
            self._resident = resident

    def _exhausted_elastic(self, wanted: int, device_error: Exception | None) -> KvCacheError:
        if self._released:
            return KvCacheError("the cache has been released: no block can be allocated")
        evicting = "" if self._reclaimer is None else " and the prefix cache cannot evict enough"
        device = f"; the device could not map more: {device_error}" if device_error is not None else ""
        return KvCacheExhausted(
            f"asked for {wanted} block(s) but {len(self._free)} resident block(s) are free, "
            f"{self._resident} of {self._num_blocks} resident{evicting}{device}"
        )

    # -- memory -----------------------------------------------------------------------

    def resident_blocks(self) -> int:
        """Blocks backed by memory: `[0, resident_blocks())`."""
        return self._resident

    def reserve(self, n: int) -> None:
        """Map ahead until at least `n` free blocks are resident; KvCacheExhausted, nothing
        mapped, when the ceiling or the device cannot give them."""
        n = non_negative_int(n, "number of blocks")
        free = self._free
        if n <= len(free):
            return
        before = self._resident
        if n > len(free) + self._num_blocks - self._resident:
            raise self._exhausted_elastic(n, None)
        try:
            self._grow_to(self._resident + n - len(free))
        except DeviceOutOfMemory as err:
            raise self._exhausted_elastic(n, err) from None
        if n > len(free):  # the pools could not back as much as the ceiling promised
            self._trim_to(before)
            raise self._exhausted_elastic(n, None)

    def shrink(self) -> None:
        """Give back the memory of every step above the highest block in use (count > 0)."""
        refs = self._refs
        top = self._resident
        while top > 0 and refs[top - 1] == 0:
            top -= 1
        self._trim_to(top)

    # -- introspection ----------------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Blocks with count 0 up to the ceiling, resident or not (what allocation can give
        while the device has memory)."""
        return len(self._free) + self._num_blocks - self._resident

    def num_free_resident_blocks(self) -> int:
        """Free blocks that have memory now (allocation takes them without mapping)."""
        return len(self._free)

    def _unbacked_blocks(self) -> int:
        return self._num_blocks - self._resident

    def release(self) -> None:
        """Forget every block (see BlockAllocator.release); nothing is resident afterwards."""
        super().release()
        self._resident = 0

    def check_invariants(self, held=None) -> None:
        """BlockAllocator's invariants, and: the free list is a min-heap of blocks below
        `resident_blocks()`, and every block at or above it has count 0."""
        free, refs = self._free, self._refs
        for i in range(1, len(free)):
            if free[(i - 1) // 2] > free[i]:
                raise RefCountError(f"free list is not a min-heap at position {i}: {list(free)[:16]}")
        for block in free:
            if block >= self._resident:
                raise RefCountError(f"free block {block} is not resident ({self._resident} resident)")
        for block in range(self._resident, self._num_blocks):
            if refs[block] != 0:
                raise RefCountError(f"unbacked block {block} has count {refs[block]}")
        super().check_invariants(held)
