"""PagedKvCache's mutating methods take the attached prefix cache's guard: a call from a
second thread while another thread is inside raises ConcurrentUseError and changes nothing;
the thread inside re-enters; reads stay unguarded; without a prefix cache (or once it is
detached or the cache released) nothing is guarded."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from shared_helpers import from_other_thread

from pagedkv import ConcurrentUseError, HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable

BS = 4


def world(elastic=False):
    gpu = HostBackend()
    cache = PagedKvCache(KvCacheConfig(BS, 1, 16, 2, "bf16"), 8, gpu, elastic=elastic)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(9)))
    table.free("a")  # blocks 0, 1 cached, block 2 free again
    held = cache.alloc_blocks(2)  # [2, 3]: blocks the caller holds
    return gpu, cache, prefix, table, held


def state(cache, gpu):
    counts = [cache.ref_count(b) for b in range(cache.num_blocks())]
    k, v = cache.read_block(0, 2, gpu)
    return counts, cache.num_free_blocks(), k.tobytes(), v.tobytes()


CALLS = {
    "alloc_block": lambda c, g, h: c.alloc_block(),
    "try_alloc_block": lambda c, g, h: c.try_alloc_block(),
    "alloc_blocks": lambda c, g, h: c.alloc_blocks(2),
    "inc_ref": lambda c, g, h: c.inc_ref(h[0]),
    "inc_refs": lambda c, g, h: c.inc_refs(h),
    "dec_ref": lambda c, g, h: c.dec_ref(h[0]),
    "free_block": lambda c, g, h: c.free_block(h[0]),
    "free_blocks": lambda c, g, h: c.free_blocks(h),
    "zero_blocks": lambda c, g, h: c.zero_blocks(h, g, 0),
    "fill_blocks": lambda c, g, h: c.fill_blocks(h, 7, g, 0),
    "copy_blocks": lambda c, g, h: c.copy_blocks([(0, h[0])], g, 0),
    "write_block": lambda c, g, h: c.write_block(0, h[0], b"\x01" * 8, None, g),
    "write_tokens": lambda c, g, h: c.write_tokens(0, [h[0] * BS], np.ones((1, 1, 16), np.float32),
                                                    np.ones((1, 1, 16), np.float32), g, 0),
    "reserve": lambda c, g, h: c.reserve(1, g),
    "shrink": lambda c, g, h: c.shrink(g),
    # keyword arguments pass through the guard as they do without it
    "write_tokens by keyword": lambda c, g, h: c.write_tokens(0, [h[0] * BS], np.ones((1, 1, 16), np.float32),
                                                               np.ones((1, 1, 16), np.float32), g, 0, k_scale=1.0),
    "shrink by keyword": lambda c, g, h: c.shrink(g, streams=()),
    "fill_blocks by keyword": lambda c, g, h: c.fill_blocks(h, 7, gpu=g, stream=0),
    "release": lambda c, g, h: c.release(g),
}




@pytest.mark.parametrize("name", CALLS)
def test_a_mutating_call_from_a_second_thread_is_refused_and_changes_nothing(name):
    gpu, cache, prefix, table, held = world()
    fill = np.arange(128, dtype=np.uint8)
    cache.write_block(0, 2, fill, fill, gpu)
    before = state(cache, gpu)
    guard = cache.guard()
    assert guard is prefix._guard
    guard.enter()  # this thread is inside the prefix cache (as during a match)
    try:
        kind, message = from_other_thread(lambda: CALLS[name](cache, gpu, held))
    finally:
        guard.exit()
    assert kind == "ConcurrentUseError", (kind, message)
    assert "is in use by another thread" in message
    assert state(cache, gpu) == before
    assert guard.token == [True] and guard.depth == 0 and guard.owner is None


@pytest.mark.parametrize("name", CALLS)
def test_the_same_call_from_the_thread_inside_or_with_the_guard_free_goes_through(name):
    gpu, cache, prefix, table, held = world()
    guard = cache.guard()
    guard.enter()
    try:
        CALLS[name](cache, gpu, held)  # re-entry by the thread inside
    finally:
        guard.exit()
    assert guard.token == [True] and guard.depth == 0
    gpu2, cache2, _, _, held2 = world()
    assert from_other_thread(lambda: CALLS[name](cache2, gpu2, held2))[0] == "ok"  # nobody inside


def test_a_second_thread_inside_a_cache_call_keeps_the_table_out():
    gpu, cache, prefix, table, held = world()
    inside, leave = threading.Event(), threading.Event()
    real = cache.allocator().alloc_blocks

    def slow_alloc(n):  # the allocator call of the other thread, paused inside the guard
        inside.set()
        leave.wait(30)
        return real(n)

    cache.allocator().alloc_blocks = slow_alloc
    cache._drop_guard()
    cache._take_guard(prefix._guard, prefix._events.pending, prefix.deliver_events)  # rebind to the patched allocator
    got = []
    thread = threading.Thread(target=lambda: got.append(cache.alloc_blocks(1)))
    thread.start()
    assert inside.wait(30)
    try:
        with pytest.raises(ConcurrentUseError):
            table.add("b", list(range(5)))
        with pytest.raises(ConcurrentUseError):
            prefix.match(list(range(9)))
    finally:
        leave.set()
        thread.join(30)
    assert got == [[4]] and "b" not in table
    table.add("b", list(range(5)))  # the guard is free again


def test_reads_are_not_guarded_and_an_eviction_from_a_direct_call_delivers_its_events():
    events = []
    gpu = HostBackend()
    cache = PagedKvCache(KvCacheConfig(BS, 1, 16, 2, "bf16"), 4, gpu)
    prefix = PrefixCache(cache, on_event=events.append)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(9)))
    table.free("a")
    events.clear()
    guard = cache.guard()
    guard.enter()
    try:
        assert from_other_thread(lambda: (cache.ref_count(0), cache.num_free_blocks())) == ("ok", (1, 2))
    finally:
        guard.exit()
    got = cache.alloc_blocks(4)  # two free, two evicted: delivered once the allocation is done
    assert sorted(got) == [0, 1, 2, 3] and cache.num_free_blocks() == 0
    assert [(type(e).__name__, e.block_ids) for e in events] == [("BlockRemoved", (1, 0))]


def test_no_prefix_cache_no_guard_and_detach_or_release_drops_it():
    gpu = HostBackend()
    cache = PagedKvCache(KvCacheConfig(BS, 1, 16, 2, "bf16"), 8, gpu)
    assert cache.guard() is None and cache.alloc_block == cache.allocator().alloc_block
    prefix = PrefixCache(cache)
    assert cache.guard() is prefix._guard
    cache.detach_prefix_cache(prefix)
    assert cache.guard() is None and cache.alloc_block == cache.allocator().alloc_block
    assert "release" not in vars(cache)
    gpu2, cache2, prefix2, _, _ = world()
    cache2.release(gpu2)
    assert cache2.guard() is None and "release" not in vars(cache2)
