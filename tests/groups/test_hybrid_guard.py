"""A hybrid cache's groups take the HybridPrefixCache's guard while it is attached: a
call that changes a group (an attention group's allocation, counts, fills, writes; a state
group's slots) from a second thread while another thread is inside raises
ConcurrentUseError and changes nothing; once the prefix cache is closed nothing is guarded."""

from __future__ import annotations

import pytest
from shared_helpers import from_other_thread

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache
from pagedkv.core.layer_groups import LayerGroup

CONFIG = KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
    LayerGroup("full", (0,)),
    LayerGroup("sliding", (1,), window=8),
    LayerGroup("state", (2,), state=(((4,), "float32"),)),
))

CALLS = {
    "full alloc_blocks": lambda c, g: c.group(0).alloc_blocks(2),
    "full free_block": lambda c, g: c.group(0).free_block(0),
    "full inc_ref": lambda c, g: c.group(0).inc_ref(0),
    "full fill_blocks": lambda c, g: c.group(0).fill_blocks([0], 7, g, 0),
    "sliding alloc_block": lambda c, g: c.group(1).alloc_block(),
    "state alloc_block": lambda c, g: c.group(2).alloc_block(),
    "state free_slots": lambda c, g: c.group(2).free_slots([0], g, 0),
    "state fill_slots": lambda c, g: c.group(2).fill_slots([0], 7, g, 0),
    "cache write_state": lambda c, g: c.write_state(2, 0, [1.0, 2.0, 3.0, 4.0], g),
    "cache copy_state by keyword": lambda c, g: c.copy_state([0], [1], g, 0, group=2),
}


def world():
    gpu = HostBackend()
    cache = PagedKvCache(CONFIG, [8, 8, None], gpu, num_state_slots=4)
    prefix = PrefixCache(cache)
    for g in range(3):
        assert cache.group(g).alloc_blocks(1) == [0]  # block / slot 0 held by the caller
    assert cache.group(2).alloc_blocks(1) == [1]  # a second slot: a copy_state destination
    return gpu, cache, prefix


def state(cache, gpu):
    counts = [[cache.group(g).ref_count(b) for b in range(cache.group(g).num_blocks())] for g in range(3)]
    return counts, cache.group(0).read_block(0, 0, gpu)[0].tobytes(), cache.read_state(2, 0, gpu).tobytes()




@pytest.mark.parametrize("name", CALLS)
def test_a_group_call_from_a_second_thread_is_refused_and_changes_nothing(name):
    gpu, cache, prefix = world()
    before = state(cache, gpu)
    guard = prefix._guard
    guard.enter()  # this thread is inside the prefix cache (as during a match)
    try:
        kind, message = from_other_thread(lambda: CALLS[name](cache, gpu))
    finally:
        guard.exit()
    assert kind == "ConcurrentUseError", (kind, message)
    assert state(cache, gpu) == before
    assert guard.token == [True] and guard.depth == 0 and guard.owner is None


@pytest.mark.parametrize("name", CALLS)
def test_the_thread_inside_re_enters_and_a_closed_prefix_cache_guards_nothing(name):
    gpu, cache, prefix = world()
    guard = prefix._guard
    guard.enter()
    try:
        CALLS[name](cache, gpu)  # re-entry by the thread inside
    finally:
        guard.exit()
    gpu2, cache2, prefix2 = world()
    prefix2.close()
    assert from_other_thread(lambda: CALLS[name](cache2, gpu2))[0] == "ok"


def test_reads_stay_unguarded():
    gpu, cache, prefix = world()
    prefix._guard.enter()
    try:
        kind, counts = from_other_thread(lambda: (cache.group(0).ref_count(0), cache.group(2).num_free_blocks()))
    finally:
        prefix._guard.exit()
    assert (kind, counts) == ("ok", (1, 2))
