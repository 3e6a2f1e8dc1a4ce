"""BlockAllocator: the reclaimer contract (defects 6 and 7), cached blocks never freed by a
stray decrement, events delivered after the operation, and clear errors for bad tables."""

from __future__ import annotations

import pytest

from pagedkv import (
    BlockAllocator,
    BlockReclaimer,
    HostBackend,
    KvCacheConfig,
    KvCacheError,
    KvCacheExhausted,
    PagedKvCache,
    PrefixCache,
    RefCountError,
)

from conftest import HeldSet

BS = 4


def make_cache(num_blocks=8):
    config = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    return PagedKvCache(config, num_blocks, HostBackend(capacity_bytes=1 << 20))


def counts(alloc_or_cache):
    return [alloc_or_cache.ref_count(b) for b in range(alloc_or_cache.num_blocks())]


class Evicting(HeldSet):
    """A reclaimer that evicts its held blocks (lowest first) through `return_evicted_block`,
    queues one event per eviction and delivers the queue in `deliver_events`, where its
    consumer may run anything (allocate, raise)."""

    def __init__(self, allocator: BlockAllocator, consumer=None):
        super().__init__()
        self.allocator = allocator
        self.queue: list[tuple[str, int]] = []
        self.seen: list[tuple[str, int]] = []
        self.consumer = consumer

    def reclaim(self, n: int) -> bool:
        victims = [b for b in sorted(self.held) if self.allocator.ref_count(b) == 1][:n]
        if len(victims) < n:
            return False
        for block in victims:
            self.allocator.return_evicted_block(block)
            self.held.discard(block)
            self.queue.append(("removed", block))
        return True

    def deliver_events(self) -> None:
        super().deliver_events()
        events, self.queue = self.queue, []
        for event in events:
            self.seen.append(event)
            if self.consumer is not None:
                self.consumer(event)

    def hold(self, block: int) -> None:
        self.allocator.inc_ref(block)
        self.held.add(block)


def test_held_set_and_prefix_cache_are_block_reclaimers():
    assert isinstance(HeldSet(), BlockReclaimer)
    assert isinstance(PrefixCache(make_cache()), BlockReclaimer)


def test_attach_refuses_what_is_not_a_reclaimer():
    alloc = BlockAllocator(4)
    with pytest.raises(TypeError, match="object is not a BlockReclaimer .needs reclaim, on_sole_reference, is_cached, deliver_events"):
        alloc.attach_reclaimer(object())
    assert alloc.reclaimer() is None


# -- defect 6: a cached block is never freed by anyone but the prefix cache ------------


def test_cancelling_a_reservation_twice_is_refused_and_changes_nothing():
    cache = make_cache()
    prefix = PrefixCache(cache)
    blocks = cache.alloc_blocks(2)
    prefix.insert(list(range(8)), blocks)
    cache.free_blocks(blocks)
    found = prefix.reserve(list(range(8)))
    assert found.blocks == blocks and counts(cache)[:2] == [2, 2]
    prefix.cancel(found)
    before = (counts(cache), cache.num_free_blocks())
    with pytest.raises(RefCountError, match=r"a reservation is released once"):
        prefix.cancel(found)  # the prefix cache refuses first ...
    with pytest.raises(RefCountError, match=r"would free block 0, which the prefix cache still holds"):
        cache.free_blocks(found.blocks)  # ... and the allocator refuses the same release made directly
    assert (counts(cache), cache.num_free_blocks()) == before == ([1, 1, 0, 0, 0, 0, 0, 0], 6)
    cache.check_invariants(prefix.block_references())
    prefix.check_invariants()


def test_freeing_a_match_twice_is_refused_and_a_later_match_is_still_correct():
    cache = make_cache()
    prefix = PrefixCache(cache)
    blocks = cache.alloc_blocks(2)
    prefix.insert(list(range(8)), blocks)
    cache.free_blocks(blocks)
    found = prefix.match(list(range(8)))
    cache.free_blocks(found.blocks)
    with pytest.raises(RefCountError, match="which the prefix cache still holds"):
        cache.free_blocks(found.blocks)
    with pytest.raises(RefCountError, match="would free block 0, which the prefix cache still holds"):
        cache.free_block(found.blocks[0])
    with pytest.raises(RefCountError, match="would free block 1"):
        cache.dec_ref(found.blocks[1])
    assert counts(cache)[:2] == [1, 1]
    # nothing was freed, so new allocations never hand out the cached blocks
    fresh = cache.alloc_blocks(6)
    assert sorted(fresh) == [2, 3, 4, 5, 6, 7]
    assert prefix.match(list(range(8))).blocks == [0, 1]
    cache.check_invariants({**prefix.block_references(), **{b: 1 for b in fresh}, 0: 2, 1: 2})


def test_free_blocks_checks_cached_blocks_before_changing_any_count():
    alloc = BlockAllocator(6)
    held = HeldSet()
    alloc.attach_reclaimer(held)
    a, b, c = alloc.alloc_blocks(3)
    held.held.add(c)  # c holds only the reclaimer's reference now
    with pytest.raises(RefCountError, match=f"would free block {c}"):
        alloc.free_blocks([a, b, c])  # the fast path meets c first (last first)
    with pytest.raises(RefCountError, match=f"would free block {c}"):
        alloc.free_blocks([c, a, b])  # the fast path frees b and a, then meets c: undone
    assert counts(alloc) == [1, 1, 1, 0, 0, 0] and alloc.num_free_blocks() == 3
    alloc.check_invariants({a: 1, b: 1, c: 1})


def test_a_duplicated_table_may_not_take_a_cached_block_to_zero():
    alloc = BlockAllocator(4)
    held = HeldSet()
    alloc.attach_reclaimer(held)
    block = alloc.alloc_block()
    alloc.inc_ref(block)
    held.held.add(block)
    with pytest.raises(RefCountError, match=f"would free block {block}"):
        alloc.free_blocks([block, block])
    assert alloc.ref_count(block) == 2


def test_return_evicted_block_of_a_block_the_prefix_cache_does_not_hold_raises():
    cache = make_cache()
    seed = cache.alloc_block()
    cache.return_evicted_block(seed)  # no prefix cache attached: the seed contract, one decrement
    assert cache.ref_count(seed) == 0
    block = cache.alloc_block()
    prefix = PrefixCache(cache)
    with pytest.raises(RefCountError, match=f"return_evicted_block of block {block}, which no attached prefix cache holds"):
        cache.return_evicted_block(block)
    with pytest.raises(RefCountError, match="which no attached prefix cache holds"):
        cache.return_evicted_block(block)
    assert cache.ref_count(block) == 1
    blocks = [block, cache.alloc_block()]
    prefix.insert(list(range(8)), blocks)
    cache.free_blocks(blocks)
    assert prefix.evict(2) == [1, 0]  # the prefix cache's own route still works
    cache.check_invariants()


def test_check_invariants_catches_a_free_block_that_is_still_cached():
    alloc = BlockAllocator(4)
    held = HeldSet()
    alloc.attach_reclaimer(held)
    alloc.check_invariants()
    held.held.add(2)  # a reclaimer claiming a block that is on the free list
    with pytest.raises(RefCountError, match="free block 2 is still held by the prefix cache"):
        alloc.check_invariants()


# -- defect 7: events are delivered after the allocating operation ---------------------


def test_alloc_blocks_is_all_or_nothing_when_the_consumer_allocates():
    alloc = BlockAllocator(5)
    taken_inside = []

    def consumer(event):
        if not taken_inside:  # allocate once, from inside the first delivery
            taken_inside.append(None)
            taken_inside[0] = alloc.alloc_block()

    reclaimer = Evicting(alloc, consumer=consumer)
    alloc.attach_reclaimer(reclaimer)
    first = alloc.alloc_blocks(5)
    for block in first[:3]:
        reclaimer.hold(block)
    alloc.free_blocks(first)  # 0, 1, 2 stay cached (count 1); 3 and 4 are free
    assert alloc.num_free_blocks() == 2 and reclaimer.delivered == 0
    got = alloc.alloc_blocks(3)  # evicts block 0, takes 0, 3, 4, then delivers the event
    assert got == [0, 3, 4]
    # the consumer ran after the blocks were taken: its own allocation evicted block 1
    assert taken_inside == [1]
    assert reclaimer.seen == [("removed", 0), ("removed", 1)] and reclaimer.delivered == 2
    assert reclaimer.held == {2}
    alloc.check_invariants({0: 1, 4: 1, 3: 1, 1: 1, 2: 1})


def test_alloc_block_with_an_allocating_consumer_never_pops_an_empty_list():
    alloc = BlockAllocator(2)
    inside = []
    reclaimer = Evicting(alloc, consumer=lambda event: inside.append(alloc.try_alloc_block()))
    alloc.attach_reclaimer(reclaimer)
    a, b = alloc.alloc_blocks(2)
    reclaimer.hold(a)
    alloc.free_block(a)  # a: cached at count 1
    block = alloc.alloc_block()  # evicts a, takes it, then the consumer finds nothing free
    assert block == a and inside == [None]
    # one delivery after alloc_block, one after the consumer's own (refused) allocation
    assert counts(alloc) == [1, 1] and reclaimer.delivered == 2 and reclaimer.seen == [("removed", a)]


def test_a_consumer_that_raises_leaves_nothing_allocated():
    alloc = BlockAllocator(3)

    def consumer(event):
        raise RuntimeError(f"consumer failed on {event}")

    reclaimer = Evicting(alloc, consumer=consumer)
    alloc.attach_reclaimer(reclaimer)
    blocks = alloc.alloc_blocks(3)
    reclaimer.hold(blocks[0])
    alloc.free_blocks(blocks)  # block 0 cached, 1 and 2 free
    with pytest.raises(RuntimeError, match=r"consumer failed on \('removed', 0\)"):
        alloc.alloc_blocks(3)
    # the eviction happened (its event was delivered); the allocation did not
    assert counts(alloc) == [0, 0, 0] and alloc.num_free_blocks() == 3
    alloc.check_invariants()


def test_a_refused_allocation_still_delivers_and_evicts_nothing():
    alloc = BlockAllocator(2)
    reclaimer = Evicting(alloc)
    alloc.attach_reclaimer(reclaimer)
    a, b = alloc.alloc_blocks(2)
    reclaimer.hold(a)
    alloc.free_block(a)
    with pytest.raises(KvCacheExhausted, match=r"asked for 2 block\(s\) but 0 of 2 are free and the prefix cache cannot evict enough"):
        alloc.alloc_blocks(2)
    assert reclaimer.seen == [] and counts(alloc) == [1, 1]


def test_allocation_without_reclaim_does_not_call_deliver():
    alloc = BlockAllocator(4)
    reclaimer = Evicting(alloc)
    alloc.attach_reclaimer(reclaimer)
    alloc.alloc_blocks(2)
    alloc.alloc_block()
    assert reclaimer.delivered == 0


# -- the fast free path ----------------------------------------------------------------


def test_free_blocks_reports_counts_falling_to_one_in_release_order():
    alloc = BlockAllocator(4)
    held = HeldSet()
    alloc.attach_reclaimer(held)
    blocks = alloc.alloc_blocks(4)
    for block in blocks[:3]:
        alloc.inc_ref(block)
        held.held.add(block)
    alloc.free_blocks(blocks)
    assert held.sole == [2, 1, 0]
    assert counts(alloc) == [1, 1, 1, 0] and alloc.num_free_blocks() == 1


class BatchHeldSet(HeldSet):
    """A HeldSet that takes the counts falling to one in one call per free_blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[int]] = []

    def on_sole_references(self, blocks: list[int]) -> None:
        self.batches.append(list(blocks))


def test_free_blocks_reports_counts_falling_to_one_in_one_call_when_offered():
    alloc = BlockAllocator(5)
    held = BatchHeldSet()
    alloc.attach_reclaimer(held)
    blocks = alloc.alloc_blocks(4)
    for block in blocks[:3]:
        alloc.inc_ref(block)
        held.held.add(block)
    alloc.inc_ref(blocks[0])  # count 3: falls to 2, not to one
    alloc.free_blocks(blocks)
    assert held.batches == [[2, 1]] and held.sole == []
    assert counts(alloc) == [2, 1, 1, 0, 0] and alloc.num_free_blocks() == 2


def test_inc_refs_of_valid_checks_every_count_before_changing_any():
    alloc = BlockAllocator(4)
    alloc.alloc_blocks(2)
    with pytest.raises(RefCountError, match="inc_ref of free block 3"):
        alloc.inc_refs_of_valid([0, 1, 3])
    assert counts(alloc) == [1, 1, 0, 0]
    alloc.inc_refs_of_valid([0, 1, 0])
    assert counts(alloc) == [3, 2, 0, 0]
    alloc.inc_refs_of_valid([])
    assert counts(alloc) == [3, 2, 0, 0]


def test_inc_refs_of_valid_records_each_step_when_traced():
    alloc = BlockAllocator(2, trace=True)
    alloc.alloc_block()
    alloc.inc_refs_of_valid([0, 0])
    assert counts(alloc) == [3, 0]
    assert len(alloc.block_history(0)) == 3


# -- defect 12: bad tables named -------------------------------------------------------


@pytest.mark.parametrize("table, shown", [(None, "NoneType None"), ("ab", "str 'ab'"), (3, "int 3")])
def test_free_blocks_of_a_non_table_names_it(table, shown):
    alloc = BlockAllocator(4)
    alloc.alloc_block()
    with pytest.raises(TypeError, match=f"free_blocks takes a sequence of int block indices, got {shown}"):
        alloc.free_blocks(table)
    assert counts(alloc) == [1, 0, 0, 0]


def test_bad_entries_are_named_before_any_count_changes():
    alloc = BlockAllocator(4)
    blocks = alloc.alloc_blocks(2)
    with pytest.raises(TypeError, match="block index must be an int, got None"):
        alloc.free_blocks([blocks[0], None])
    with pytest.raises(IndexError, match="block 9 out of range for a cache of 4 blocks"):
        alloc.free_blocks([9, blocks[1]])
    assert counts(alloc) == [1, 1, 0, 0]


def test_released_allocator_refuses_every_index():
    alloc = BlockAllocator(2)
    alloc.release()
    with pytest.raises(KvCacheError, match="block 0: the cache has been released"):
        alloc.ref_count(0)
    with pytest.raises(KvCacheError, match="released"):
        alloc.free_blocks([0])
    assert alloc.try_alloc_block() is None and alloc.num_blocks() == 0


def test_a_prefix_cache_consumer_allocating_inside_eviction_cannot_shorten_alloc_blocks():
    # PrefixCache may still report evictions from inside reclaim; the allocator re-checks
    # the free list after reclaim, so the call returns all it asked for or nothing.
    cache = make_cache(num_blocks=4)
    inside = []

    def on_event(event):
        if type(event).__name__ == "BlockRemoved" and not inside:
            inside.append(cache.try_alloc_block())

    prefix = PrefixCache(cache, on_event=on_event)
    blocks = cache.alloc_blocks(3)
    prefix.insert(list(range(12)), blocks)
    cache.free_blocks(blocks)  # three cached blocks at count 1, one free block
    # Whether the consumer runs inside reclaim (taking a block the call needed: the call is
    # refused) or after it (the call succeeds), alloc_blocks gives all three or none.
    try:
        got = cache.alloc_blocks(3)
    except KvCacheExhausted:
        got = []
    assert len(got) in (0, 3) and len(inside) == 1 and inside[0] is not None and inside[0] not in got
    cache.check_invariants({**{b: 1 for b in got + inside}, **prefix.block_references()})
