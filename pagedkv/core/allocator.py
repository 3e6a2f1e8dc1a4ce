"""BlockAllocator: the free list and the reference count of every block, nothing else.

Invariants (checked by `check_invariants`):
- a block is on the free list exactly when its count is 0, and at most once;
- free blocks plus referenced blocks make `num_blocks`;
- no free block is still held by the attached reclaimer (the prefix cache);
- a fresh allocator hands out 0, 1, 2, ...; the last block freed is the first reused (a stack).

Every call touches no memory and runs in O(1) per block. A prefix cache plugs in as a
`BlockReclaimer`: it evicts for allocation, hears of counts falling to 1, and keeps its own
reference on every block it caches, which only its `return_evicted_block` may drop.
"""

from __future__ import annotations

import collections
import operator
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

from ..errors import KvCacheError, KvCacheExhausted, RefCountError
from .log import get_logger
from .trace import BlockTracer
from .validate import as_int, block_list, non_negative_int, positive_int

_log = get_logger("allocator")


@runtime_checkable
class BlockReclaimer(Protocol):
    """What a `BlockAllocator` asks of an attached prefix cache."""

    def reclaim(self, n: int) -> bool:
        """Free exactly `n` blocks (through `return_evicted_block`) and return True, or free
        nothing and return False."""
        ...

    def on_sole_reference(self, block: int) -> None:
        """`block`'s count has just fallen to 1 (it may have become evictable)."""
        ...

    def is_cached(self, block: int) -> bool:
        """True when the reclaimer holds `block` (its own reference is among the count).
        A reclaimer may also offer `cached_index`: a container of the blocks it holds, the
        same object for its life, that the free paths test with `in` instead of a call."""
        ...

    def deliver_events(self) -> None:
        """Deliver what `reclaim` queued; called once the allocating operation is complete."""
        ...


class BlockAllocator:
    """A free list and reference counts over `num_blocks` blocks, with an optional
    `BlockReclaimer` that evicts when the free list runs short."""

    def __init__(self, num_blocks: int, trace: bool = False):
        num_blocks = positive_int(num_blocks, "num_blocks")
        self._num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks
        self._tracer: BlockTracer | None = BlockTracer() if trace else None
        self._reclaimer: BlockReclaimer | None = None
        self._watched = self._tracer is not None  # a reclaimer or a tracer: dec_ref's slower path
        self._index = None  # the reclaimer's `cached_index` (a container of its blocks) when untraced
        self._released = False

    # -- validation -------------------------------------------------------------------

    def block(self, block: object) -> int:
        """`block` as an in-range int index; TypeError for a non-int, IndexError naming it
        when out of range, KvCacheError once released."""
        if type(block) is not int:
            block = as_int(block, "block index")
        if not 0 <= block < self._num_blocks:  # type: ignore[operator]
            if self._released:
                raise KvCacheError(f"block {block}: the cache has been released")
            raise IndexError(f"block {block} out of range for a cache of {self._num_blocks} blocks")
        return block  # type: ignore[return-value]

    def blocks(self, blocks: Iterable[int], what: str = "blocks") -> list[int]:
        """`blocks` as a list of in-range int indices (see `validate.block_list`); the first bad
        entry is named, KvCacheError once released."""
        try:
            return block_list(blocks, self._num_blocks, what)
        except IndexError:
            if self._released:
                raise KvCacheError("the cache has been released: no block index is valid") from None
            raise

    def check_writable(self, blocks: Iterable[int]) -> None:
        """Raise naming the first block of `blocks` that may not be written: RefCountError for
        a free block (count 0), KvCacheError for a block the reclaimer holds (shared KV is
        read-only: copy it first). `blocks` must be valid indices."""
        refs = self._refs
        cached = None if self._reclaimer is None else self._reclaimer.is_cached
        for block in blocks:
            block = int(block)
            if refs[block] == 0:
                raise RefCountError(f"write into free block {block} (count 0): allocate it first")
            if cached is not None and cached(block):
                raise KvCacheError(
                    f"write into block {block}, which the prefix cache holds: shared KV is read-only, "
                    f"copy the block first"
                )

    # -- allocation -------------------------------------------------------------------

    def alloc_block(self) -> int:
        """Pop a free block and give it count 1. With an empty free list the reclaimer evicts
        one block first; KvCacheExhausted when none is free or evictable."""
        try:
            block = self._free.pop()
        except IndexError:
            return self._alloc_after_reclaim()
        self._refs[block] = 1
        if self._tracer is not None:
            self._tracer.record(block, "alloc", 1)
        return block

    def _alloc_after_reclaim(self) -> int:
        reclaimer = self._reclaimer
        if reclaimer is None:
            raise self._exhausted(1) from None
        if not reclaimer.reclaim(1) or not self._free:
            self._deliver(reclaimer, [])
            raise self._exhausted(1) from None
        block = self._free.pop()
        self._refs[block] = 1
        if self._tracer is not None:
            self._tracer.record(block, "alloc", 1)
        self._deliver(reclaimer, [block])
        return block

    def _deliver(self, reclaimer: BlockReclaimer, taken: list[int]) -> None:
        """Let the reclaimer deliver its events; if that raises, `taken` goes back first, so
        the failed call leaves nothing allocated."""
        try:
            reclaimer.deliver_events()
        except BaseException:
            for block in reversed(taken):
                self._refs[block] = 0
                self._free.append(block)
            raise

    def try_alloc_block(self) -> int | None:
        """Like `alloc_block`, but None when no block is free or evictable (or after `release`)."""
        if self._released:
            return None
        try:
            return self.alloc_block()
        except KvCacheExhausted:
            return None

    def alloc_blocks(self, n: int) -> list[int]:
        """`n` blocks, each with count 1, in the order `n` `alloc_block` calls would give.
        When the free list is short the reclaimer evicts just enough first, and delivers its
        events once the blocks are taken. All or nothing: KvCacheExhausted, nothing taken
        and nothing evicted when even eviction cannot make `n` free (a reclaimer that lets
        its consumer allocate from inside `reclaim` can leave its eviction done and the call
        refused, never a short list)."""
        if type(n) is not int or n < 0:
            n = non_negative_int(n, "number of blocks")
        free = self._free
        reclaimer = None
        if n > len(free):
            reclaimer = self._reclaimer
            if reclaimer is None:
                raise self._exhausted(n)
            if not reclaimer.reclaim(n - len(free)) or n > len(free):
                self._deliver(reclaimer, [])
                raise self._exhausted(n)
        if n == 0:
            return []
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        return self._hand_out(taken, reclaimer)

    def _hand_out(self, taken: list[int], reclaimer: BlockReclaimer | None) -> list[int]:
        """Give each block just taken off the free list count 1 (traced), then let the
        reclaimer, when one evicted for this call, deliver its events; returns `taken`."""
        refs = self._refs
        for block in taken:
            refs[block] = 1
        if self._tracer is not None:
            for block in taken:
                self._tracer.record(block, "alloc", 1)
        if reclaimer is not None:
            self._deliver(reclaimer, taken)
        return taken

    def _exhausted(self, wanted: int) -> KvCacheError:
        if self._released:
            return KvCacheError("the cache has been released: no block can be allocated")
        evicting = "" if self._reclaimer is None else " and the prefix cache cannot evict enough"
        return KvCacheExhausted(
            f"asked for {wanted} block(s) but {len(self._free)} of {self._num_blocks} are free{evicting}"
        )

    # -- reference counts -------------------------------------------------------------

    def inc_ref(self, block: int) -> None:
        """Add a reference to an allocated block; a free block raises RefCountError."""
        if type(block) is not int or not 0 <= block < self._num_blocks:
            block = self.block(block)
        count = self._refs[block]
        if count == 0:
            raise RefCountError(f"inc_ref of free block {block}{self._history_suffix(block)}")
        self._refs[block] = count + 1
        if self._tracer is not None:
            self._tracer.record(block, "inc_ref", count + 1)

    def inc_refs(self, blocks: Sequence[int]) -> None:
        """`inc_ref` of every block of `blocks`; all are checked before any count changes."""
        blocks = self.blocks(blocks)
        refs = self._refs
        for block in blocks:
            if refs[block] == 0:
                raise RefCountError(f"inc_ref of free block {block}{self._history_suffix(block)}")
        if self._tracer is not None:
            for block in blocks:
                self.inc_ref(block)
            return
        for block in blocks:
            refs[block] += 1

    def inc_refs_of_valid(self, blocks: list[int]) -> None:
        """`inc_refs` of a list the caller vouches holds only in-range Python int indices
        (blocks it read from its own records): every count is still checked non-zero
        before any changes."""
        refs = self._refs
        if self._tracer is not None or 0 in map(refs.__getitem__, blocks):
            self.inc_refs(blocks)  # records each step, or raises naming the free block
            return
        for block in blocks:
            refs[block] += 1

    def dec_ref(self, block: int) -> bool:
        """Drop a reference; True when the count reached 0 and the block went back on the
        free list. A block the reclaimer holds is never taken from 1 to 0 here
        (RefCountError, nothing changed: only `return_evicted_block` may). At count 0
        nothing changes: an error event, False (RefCountError while Python assertions are
        on). A count falling to 1 is reported to the reclaimer."""
        if type(block) is not int or block < 0:
            block = self.block(block)
        refs = self._refs
        try:
            count = refs[block]
        except IndexError:
            raise self._block_error(block) from None
        if count == 1:
            if self._watched:
                index = self._index
                if index is None:
                    self._freeing_watched(block)
                elif block in index:  # (no call: the reclaimer's own container)
                    raise self._cached_error(block)
            refs[block] = 0
            self._free.append(block)
            return True
        if count == 0:
            return self._dec_at_zero(block)
        refs[block] = count - 1
        if self._tracer is not None:
            self._tracer.record(block, "dec_ref", count - 1)
        if count == 2 and self._reclaimer is not None:
            self._reclaimer.on_sole_reference(block)
        return False

    free_block = dec_ref  # the owner's release is one dec_ref; an alias keeps the hot path one call

    def _freeing_watched(self, block: int) -> None:
        """Before `block` goes from 1 to 0 with a reclaimer or tracer present: refuse a block
        the reclaimer holds, record the event."""
        if self._reclaimer is not None and self._reclaimer.is_cached(block):
            raise self._cached_error(block)
        if self._tracer is not None:
            self._tracer.record(block, "dec_ref", 0)

    def _cached_error(self, block: int) -> RefCountError:
        return RefCountError(
            f"dec_ref would free block {block}, which the prefix cache still holds: only the prefix "
            f"cache's return_evicted_block drops its reference (released twice?){self._history_suffix(block)}"
        )

    def _block_error(self, block: int) -> Exception:
        try:
            self.block(block)
        except (IndexError, KvCacheError) as err:
            return err
        return IndexError(f"block {block} out of range for a cache of {self._num_blocks} blocks")

    def _dec_at_zero(self, block: int) -> bool:
        _log.error("kv_dec_ref_at_zero", block=block, history=self._history(block))
        if __debug__:
            raise RefCountError(f"dec_ref of block {block} at count 0{self._history_suffix(block)}")
        return False

    def _history(self, block: int) -> list[str] | None:
        return None if self._tracer is None else [str(e) for e in self._tracer.history(block)]

    def _history_suffix(self, block: int) -> str:
        history = self._history(block)
        return f"; history: {', '.join(history)}" if history else ""

    def free_blocks(self, table: Sequence[int]) -> None:
        """Drop one reference to each block of `table`, last first, so the blocks come back
        in the order they were allocated. Every index is checked before any count changes,
        and so is every block the reclaimer holds (none may fall to 0: RefCountError), and
        while Python assertions are on so is every count (a block listed more often than it
        is referenced raises RefCountError with nothing changed)."""
        if table is None or isinstance(table, (str, bytes)) or not hasattr(table, "__iter__"):
            raise TypeError(f"free_blocks takes a sequence of int block indices, got {type(table).__name__} {table!r:.80}")
        blocks = list(table)
        refs, done, n = self._refs, 0, len(blocks)
        reclaimer = self._reclaimer
        if self._tracer is None:
            try:  # the common case first: every block at count 1 (and not cached), tightly
                if reclaimer is None:
                    for block in reversed(blocks):
                        if type(block) is not int or block < 0 or refs[block] != 1:
                            break
                        refs[block] = 0
                        done += 1
                elif self._index is not None:
                    index = self._index
                    for block in reversed(blocks):
                        if type(block) is not int or block < 0 or refs[block] != 1 or block in index:
                            break
                        refs[block] = 0
                        done += 1
                else:
                    cached = reclaimer.is_cached
                    for block in reversed(blocks):
                        if type(block) is not int or block < 0 or refs[block] != 1 or cached(block):
                            break
                        refs[block] = 0
                        done += 1
            except IndexError:
                pass
        ones = done
        if ones == n:
            self._free.extend(reversed(blocks))
            return
        freed: list[int] = []
        sole: list[int] = []
        if self._tracer is None:
            cached = None if reclaimer is None else reclaimer.is_cached
            try:  # then shared blocks (count > 1) too, still without a call per block
                for block in reversed(blocks[: n - ones]):
                    if type(block) is not int or block < 0:
                        break
                    count = refs[block]
                    if count == 1:
                        if cached is not None and cached(block):
                            break
                        refs[block] = 0
                        freed.append(block)
                    elif count == 0:
                        break
                    else:
                        refs[block] = count - 1
                        if count == 2:
                            sole.append(block)
                    done += 1
            except IndexError:
                pass
        if done == n:
            self._free.extend(blocks[: n - ones - 1 : -1] + freed if ones else freed)  # one push: one order
            if sole and reclaimer is not None:
                self._report_sole(reclaimer, sole)
            return
        for block in blocks[n - done :]:
            refs[block] += 1  # undo the partial fast paths; the general path below redoes it
        blocks = self.blocks(blocks, "free_blocks table")  # raises naming the bad entry
        times = collections.Counter(blocks) if len(set(blocks)) != len(blocks) else None
        if __debug__ and (times is not None or 0 in _counts_of(refs, blocks)):
            for block, listed in (times or collections.Counter(blocks)).items():
                if refs[block] < listed:
                    self._dec_at_zero(block)  # logs and raises before any count changes
        if reclaimer is not None:
            for block, listed in (times or dict.fromkeys(blocks, 1)).items():
                if 0 < refs[block] <= listed and reclaimer.is_cached(block):
                    raise self._cached_error(block)
        zeros: list[int] = []  # pushed in one go, as the fast paths do: tracing must not change the order
        try:
            for block in reversed(blocks):
                if self._drop_ref(block):
                    zeros.append(block)
        finally:
            self._free.extend(zeros)

    def _drop_ref(self, block: int) -> bool:
        """`dec_ref` of a checked index without pushing the block when it reaches 0 (True
        then; the caller pushes it)."""
        refs = self._refs
        count = refs[block]
        if count == 1:
            if self._watched:
                self._freeing_watched(block)
            refs[block] = 0
            return True
        if count == 0:
            self._dec_at_zero(block)
            return False
        refs[block] = count - 1
        if self._tracer is not None:
            self._tracer.record(block, "dec_ref", count - 1)
        if count == 2 and self._reclaimer is not None:
            self._reclaimer.on_sole_reference(block)
        return False

    @staticmethod
    def _report_sole(reclaimer: BlockReclaimer, blocks: list[int]) -> None:
        """`on_sole_reference` of each of `blocks` in order, in one call when the reclaimer
        offers `on_sole_references`."""
        many = getattr(reclaimer, "on_sole_references", None)
        if many is not None:
            many(blocks)
            return
        for block in blocks:
            reclaimer.on_sole_reference(block)

    def return_evicted_block(self, block: int) -> None:
        """A prefix cache handing back its own reference to a block it evicted: one
        decrement, pushed onto the free list on 1 -> 0; at count 0 a warning and nothing
        else. With no reclaimer attached this is the seed contract, for an engine whose own
        prefix cache evicts. With one attached, the block must be one it holds:
        RefCountError, nothing changed, otherwise."""
        block = self.block(block)
        if self._reclaimer is not None and not self._reclaimer.is_cached(block):
            raise RefCountError(
                f"return_evicted_block of block {block}, which no attached prefix cache holds"
                f"{self._history_suffix(block)}"
            )
        count = self._refs[block]
        if count == 0:
            _log.warning("kv_return_evicted_at_zero", block=block, history=self._history(block))
            return
        count -= 1
        self._refs[block] = count
        if self._tracer is not None:
            self._tracer.record(block, "return_evicted", count)
        if count == 0:
            self._free.append(block)

    # -- introspection ----------------------------------------------------------------

    def ref_count(self, block: int) -> int:
        """The block's reference count (0 = free)."""
        return self._refs[self.block(block)]

    def num_free_blocks(self) -> int:
        """How many blocks are on the free list."""
        return len(self._free)

    def num_blocks(self) -> int:
        """Blocks managed (0 after `release`)."""
        return self._num_blocks

    def _unbacked_blocks(self) -> int:
        """Blocks with no memory behind them (none here; see ElasticBlockAllocator)."""
        return 0

    def released(self) -> bool:
        """True once `release` has run."""
        return self._released

    def block_history(self, block: int) -> list[str]:
        """The block's refcount events (`op->count@file:line`) when tracing is on, else []."""
        return self._history(self.block(block)) or []

    def attach_reclaimer(self, reclaimer: BlockReclaimer) -> None:
        """Register the `BlockReclaimer` (one per allocator); TypeError for an object that
        is not one, KvCacheError when another is attached."""
        if not isinstance(reclaimer, BlockReclaimer):
            raise TypeError(
                f"{type(reclaimer).__name__} is not a BlockReclaimer "
                f"(needs reclaim, on_sole_reference, is_cached, deliver_events)"
            )
        if self._reclaimer is not None and self._reclaimer is not reclaimer:
            raise KvCacheError("this cache already has a prefix cache attached")
        self._reclaimer = reclaimer
        self._watched = True
        index = getattr(reclaimer, "cached_index", None)
        self._index = index if self._tracer is None and hasattr(index, "__contains__") else None

    def detach_reclaimer(self, reclaimer: BlockReclaimer) -> None:
        """Undo `attach_reclaimer` (a no-op for one that is not attached)."""
        if self._reclaimer is reclaimer:
            self._reclaimer = None
            self._watched = self._tracer is not None
            self._index = None

    def reclaimer(self) -> BlockReclaimer | None:
        """The attached reclaimer, or None."""
        return self._reclaimer

    def release(self) -> None:
        """Forget every block: afterwards allocation fails and every index is refused."""
        self._released = True
        self._free, self._refs, self._num_blocks = [], [], 0

    def check_invariants(self, held: Mapping[int, int] | None = None) -> None:
        """Raise RefCountError if the free list and counts disagree or a free block is still
        held by the reclaimer (O(num_blocks)). With `held` (block -> references its holders
        account for), every block's count must equal its entry (0 when absent)."""
        free, refs = self._free, self._refs
        if len(set(free)) != len(free):
            raise RefCountError(f"free list holds duplicates: {sorted(free)}")
        for block in free:
            if refs[block] != 0:
                raise RefCountError(f"free block {block} has count {refs[block]}")
            if self._reclaimer is not None and self._reclaimer.is_cached(block):
                raise RefCountError(f"free block {block} is still held by the prefix cache")
        if any(c < 0 for c in refs):
            raise RefCountError("a block has a negative count")
        referenced = sum(1 for c in refs if c > 0)
        unbacked = self._unbacked_blocks()
        if referenced + len(free) + unbacked != self._num_blocks:
            raise RefCountError(
                f"{len(free)} free + {referenced} referenced + {unbacked} unbacked != {self._num_blocks} blocks"
            )
        if held is None:
            return
        for block in held:
            if not 0 <= block < self._num_blocks:
                raise RefCountError(f"holders account for block {block}, outside a cache of {self._num_blocks}")
        for block, count in enumerate(refs):
            expected = held.get(block, 0)
            if count != expected:
                raise RefCountError(
                    f"block {block} has count {count} but its holders account for {expected}"
                    f"{self._history_suffix(block)}"
                )


def _counts_of(refs: list[int], blocks: list[int]) -> tuple[int, ...]:
    """The counts of `blocks` (valid indices), gathered at C speed."""
    return operator.itemgetter(*blocks)(refs) if len(blocks) > 1 else tuple(refs[b] for b in blocks)
