"""ElasticBlockAllocator: a BlockAllocator whose blocks are backed by memory on demand.

Blocks `[0, resident)` have memory; the free list holds the free ones among them, bucketed
by mapping step, and hands out a block of the lowest step that has one, so used blocks
gather at the bottom and the tail empties for `trim` (within a step the most recently freed
block comes first, as in BlockAllocator). NOTE: buckets, not a heap of block ids: a heap
made an alloc+free pair 3.4x the non-elastic one; a bucket is one list op each way, and a
step is the unit memory is given back in anyway. When the free list runs out, the
allocator asks its `BlockBacking` to map the next step (in every layer's pools at once),
then, if the device cannot give the memory, lets the reclaimer evict; when neither works,
KvCacheExhausted with nothing changed. Invariants beyond BlockAllocator's: every free-list entry is below
`resident` and in its step's bucket, and every block at or above `resident` has count 0.
"""

from __future__ import annotations

import bisect
import operator
from typing import Iterable, Iterator, Protocol

from ..errors import DeviceOutOfMemory, KvCacheError, KvCacheExhausted, RefCountError
from .allocator import BlockAllocator, BlockReclaimer
from .validate import non_negative_int, positive_int


class StepFreeLists:
    """The free resident blocks, bucketed by step (`block // step`, the unit memory is mapped
    and unmapped in), each bucket a stack. Allocation takes from the lowest non-empty bucket,
    so used blocks gather in the low steps and the high steps empty for `trim`.

    `low` is the bucket of step `lowest`, at or below the lowest non-empty one, and
    `low_start` its first block: a free below `low_start` moves the mark down, `pop_lowest`
    moves it up past empty buckets. `bucket_of[block]` is the block's bucket, so a free is
    one index and one append. The list methods (`append`, `extend`, `len`, iteration) let
    BlockAllocator's free paths use this as their free list.
    """

    __slots__ = ("step", "buckets", "bucket_of", "lowest", "low", "low_start", "_none")

    def __init__(self, step: int, num_blocks: int):
        self.step = step
        self.buckets: list[list[int]] = [[] for _ in range(-(-num_blocks // step))]
        self.bucket_of = [self.buckets[block // step] for block in range(num_blocks)]
        self._none: list[int] = []  # `low` when no bucket is left: always empty
        self._mark(0)

    def _mark(self, lowest: int) -> None:
        self.lowest = lowest
        self.low = self.buckets[lowest] if lowest < len(self.buckets) else self._none
        self.low_start = lowest * self.step

    def lower_to(self, block: int) -> None:
        """Move the lowest mark down to `block`'s step (a block below `low_start` was freed)."""
        self._mark(block // self.step)

    def __len__(self) -> int:
        return sum(map(len, self.buckets))

    def __iter__(self) -> Iterator[int]:
        for bucket in self.buckets:
            yield from bucket

    def append(self, block: int) -> None:
        """Push one free block."""
        self.bucket_of[block].append(block)
        if block < self.low_start:
            self._mark(block // self.step)

    def extend(self, blocks: Iterable[int]) -> None:
        """Push every block of `blocks` (lower ids come out first within a bucket)."""
        ordered = sorted(blocks, reverse=True)  # a freed table is mostly one run: linear
        if not ordered:
            return
        size, bucket_of, at, n = self.step, self.bucket_of, 0, len(ordered)
        while at < n:
            top = ordered[at]
            start = top - top % size  # every block of `top`'s bucket is >= start
            end = n if ordered[-1] >= start else bisect.bisect_right(ordered, -start, at, key=operator.neg)
            bucket_of[top].extend(ordered[at:end])
            at = end
        if ordered[-1] < self.low_start:
            self._mark(ordered[-1] // size)

    def pop_lowest(self) -> int | None:
        """Take a block from the lowest non-empty bucket, or None when every bucket is empty."""
        buckets, lowest = self.buckets, self.lowest
        while lowest < len(buckets) and not buckets[lowest]:
            lowest += 1
        self._mark(lowest)
        return self.low.pop() if self.low else None

    def take(self, n: int) -> list[int]:
        """`n` blocks, lowest buckets first, in the order `n` `pop_lowest` calls give (the
        caller checked that `n` are free)."""
        taken: list[int] = []
        lowest = self.lowest
        while len(taken) < n:
            bucket = self.buckets[lowest]
            want = n - len(taken)
            if len(bucket) >= want:
                part = bucket[len(bucket) - want :]
                del bucket[len(bucket) - want :]
                part.reverse()
                taken += part
            else:
                taken += reversed(bucket)
                bucket.clear()
                lowest += 1
        self._mark(lowest)
        return taken

    def add_range(self, start: int, stop: int) -> None:
        """Make blocks `[start, stop)` (newly resident, above every bucketed block) free; within
        a bucket the lower ids come out first."""
        size = self.step
        for step in range(start // size, -(-stop // size)):
            lo, hi = max(start, step * size), min(stop, (step + 1) * size)
            self.buckets[step][0:0] = range(hi - 1, lo - 1, -1)  # under what is already there
        if start < stop and start < self.low_start:
            self._mark(start // size)

    def drop_from(self, first: int) -> None:
        """Forget every free block `>= first` (no longer resident)."""
        size = self.step
        for bucket in self.buckets[-(-first // size) :]:
            bucket.clear()
        if first % size:
            partial = self.buckets[first // size]
            partial[:] = [block for block in partial if block < first]


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

    def step_blocks(self) -> int:
        """Blocks of one mapping step (the unit `grow` and `trim` work in)."""
        ...


class ElasticBlockAllocator(BlockAllocator):
    """A BlockAllocator over `num_blocks` blocks (a ceiling) of which only the first
    `resident_blocks()` have memory, provided by `backing` (a `BlockBacking`)."""

    def __init__(self, num_blocks: int, backing: BlockBacking, trace: bool = False):
        super().__init__(num_blocks, trace)
        self._backing = backing
        self._free = StepFreeLists(positive_int(backing.step_blocks(), "step_blocks"), num_blocks)  # type: ignore[assignment]
        self._bucket_of = self._free.bucket_of  # the hot free path's one lookup
        self._resident = min(backing.resident_blocks(), self._num_blocks)  # backed from the start
        self._free.add_range(0, self._resident)

    # -- allocation -------------------------------------------------------------------

    def alloc_block(self) -> int:
        """A free resident block from the lowest step that has one, with count 1; with none
        free, the next step is mapped first, then the reclaimer evicts; KvCacheExhausted when
        neither can."""
        try:
            block = self._free.low.pop()
        except IndexError:
            return self._alloc_slow()
        self._refs[block] = 1
        if self._tracer is not None:
            self._tracer.record(block, "alloc", 1)
        return block

    def _alloc_slow(self) -> int:
        block = self._free.pop_lowest()
        reclaimer = None
        if block is None:
            reclaimer = self._make_free(1)
            block = self._free.pop_lowest()
        self._refs[block] = 1  # type: ignore[index]
        if self._tracer is not None:
            self._tracer.record(block, "alloc", 1)
        if reclaimer is not None:
            self._deliver(reclaimer, [block])  # type: ignore[list-item]
        return block  # type: ignore[return-value]

    def alloc_blocks(self, n: int) -> list[int]:
        """`n` blocks with count 1, lowest steps first (what `n` `alloc_block` calls give).
        All or nothing: when the free resident blocks are short, memory is mapped for the
        rest, then the reclaimer evicts what the ceiling cannot give; KvCacheExhausted with
        nothing taken, mapped or evicted when even that cannot make `n` free."""
        if type(n) is not int or n < 0:
            n = non_negative_int(n, "number of blocks")
        free = self._free
        reclaimer = None
        stack = free.low
        if n <= len(stack):
            taken = stack[len(stack) - n :]
            del stack[len(stack) - n :]
            taken.reverse()
        else:
            if n > len(free):
                reclaimer = self._make_free(n)
            taken = free.take(n)
        return self._hand_out(taken, reclaimer)

    def dec_ref(self, block: int) -> bool:
        """See BlockAllocator.dec_ref; a freed block goes back to its step's bucket."""
        if type(block) is int and block >= 0:
            refs = self._refs
            try:
                count = refs[block]
            except IndexError:
                raise self._block_error(block) from None
            if count == 1:
                if self._watched:
                    self._freeing_watched(block)
                refs[block] = 0
                self._bucket_of[block].append(block)
                if block < self._free.low_start:
                    self._free.lower_to(block)
                return True
        return BlockAllocator.dec_ref(self, block)

    free_block = dec_ref

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
            self._free.add_range(before, resident)
            self._resident = resident

    def _trim_to(self, keep_blocks: int) -> None:
        """Give back memory above `keep_blocks` (every block there must be free)."""
        try:
            self._backing.trim(keep_blocks)
        finally:
            self._drop_above(self._backing.resident_blocks())

    def _drop_above(self, resident: int) -> None:
        if resident < self._resident:
            self._free.drop_from(resident)
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
        self._free = StepFreeLists(1, 0)
        self._bucket_of = self._free.bucket_of
        self._resident = 0

    def check_invariants(self, held=None) -> None:
        """BlockAllocator's invariants, and: every free block sits in its step's bucket, no
        bucket below `lowest` holds one, the buckets cover the resident steps, every free
        block is below `resident_blocks()` and every block at or above it has count 0."""
        free, refs = self._free, self._refs
        for step, bucket in enumerate(free.buckets):
            for block in bucket:
                if block // free.step != step:
                    raise RefCountError(f"free block {block} is in the bucket of step {step}")
            if bucket and step < free.lowest:
                raise RefCountError(f"bucket {step} holds free blocks below the lowest mark {free.lowest}")
        expected = free.buckets[free.lowest] if free.lowest < len(free.buckets) else []
        if free.low is not expected and (free.low or expected) or free.low_start != free.lowest * free.step:
            raise RefCountError(f"the lowest mark {free.lowest} and its bucket disagree")
        for block in free:
            if block >= self._resident:
                raise RefCountError(f"free block {block} is not resident ({self._resident} resident)")
        for block in range(self._resident, self._num_blocks):
            if refs[block] != 0:
                raise RefCountError(f"unbacked block {block} has count {refs[block]}")
        super().check_invariants(held)
