"""A device entry stored over a host-held or disk-held entry of its group takes that entry's
place on the SAME trie node: a match finds it, a further store of the same chain caches no
duplicate, every node an entry of any tier is on stays reachable from its root
(`check_invariants`), and the replacement counts as no eviction in `stats()` (nor do
`clear` and `close`: no entry leaves for room). A store with a bad entry changes nothing."""

from __future__ import annotations

import pytest
from test_hybrid_disk_tiers import DiskWorld
from test_hybrid_prefix_tiers import World

from pagedkv.errors import KvCacheError

CHAIN = list(range(200, 209))  # 9 tokens: full and sliding blocks ending at 4 and 8, a checkpoint at 8
OTHER = list(range(300, 309))


def fresh(world) -> dict:
    """Device ids for CHAIN's five entries: group 0 and 1 blocks at 4 and 8, group 2's checkpoint at 8."""
    b = world.cache.group(0).alloc_blocks(2)
    c = world.cache.group(1).alloc_blocks(2)
    (s,) = world.cache.group(2).alloc_blocks(1)
    return {2: [(8, s)], 0: [(4, b[0]), (8, b[1])], 1: [(4, c[0]), (8, c[1])]}


def drop_refs(world, entries: dict) -> None:
    """Give back the caller's references on `entries` (the cache keeps its own on those it cached)."""
    for g, pairs in entries.items():
        world.cache.group(g).free_blocks([e for _, e in pairs])


def checkpoint_only(world, tokens) -> None:
    """Cache only group 2's checkpoint at 8 of `tokens` (its node and the one before hold nothing else)."""
    (slot,) = world.cache.group(2).alloc_blocks(1)
    assert world.prefix.store(tokens, 0, {2: [(8, slot)]}) == 1
    world.cache.group(2).free_blocks([slot])


def restore_on_device_and_check(world) -> dict:
    """Store CHAIN's five device entries over what the lower tiers hold; assert the match finds
    them all on the device and a second store caches none. Returns the entries."""
    entries = fresh(world)
    assert world.prefix.store(CHAIN, 0, entries) == 5
    world.prefix.check_invariants()
    found = world.prefix.match(CHAIN)
    try:
        assert found.num_tokens == 8
        assert found.group_blocks[0] == [e for _, e in entries[0]]
        assert found.group_blocks[1] == [e for _, e in entries[1]]
        assert found.checkpoints[2] == entries[2][0][1]
        assert found.host_entries == ((), (), ()) and found.disk_entries == ((), (), ())
    finally:
        world.prefix.release(found)
    again = fresh(world)
    assert world.prefix.store(CHAIN, 0, again) == 0  # every position holds its entry already
    drop_refs(world, again)
    assert [world.prefix.num_cached(g) for g in range(3)] == [2, 2, 1]
    drop_refs(world, entries)
    world.prefix.check_invariants()
    return entries


def test_a_device_entry_replaces_a_host_entry_on_its_own_node():
    world = World()
    checkpoint_only(world, CHAIN)
    world.prefix.evict(2, 99)
    assert [world.prefix.num_host_entries(g) for g in range(3)] == [0, 0, 1]
    world.events.clear()
    restore_on_device_and_check(world)
    assert [world.prefix.num_host_entries(g) for g in range(3)] == [0, 0, 0]
    assert [(type(e).__name__, e.group, e.medium) for e in world.events][:2] == \
        [("GroupBlockRemoved", 2, "CPU"), ("GroupBlockStored", 2, "GPU")]
    s = world.prefix.stats()
    assert s.evictions == (0, 0, 1) and s.demotions == (0, 0, 1) and s.promotions == (0, 0, 0)
    assert s.host_evictions == (0, 0, 0)  # replaced by a device copy: not an eviction
    assert s.cached_entries == (2, 2, 1) and s.host_cached_entries == (0, 0, 0)
    assert world.prefix.tier_counts()["host_drops"] == 0
    assert world.table.add("a", CHAIN) == 8  # the table hits the device entries too
    world.table.free("a")
    world.table.check_invariants()


def test_a_device_entry_replaces_a_disk_entry_on_its_own_node(tmp_path):
    world = DiskWorld(tmp_path / "tier", host=(4, 2, 1))
    try:
        checkpoint_only(world, CHAIN)
        checkpoint_only(world, OTHER)
        world.prefix.evict(2, 99)  # one host slot: CHAIN's checkpoint (the older) goes on to disk
        assert [len(t) for _, t, _, _ in world.prefix.disk_entries()] == [8]
        assert world.prefix.disk_entries()[0][1] == tuple(CHAIN[:8])
        world.disk.flush()
        world.events.clear()
        restore_on_device_and_check(world)
        assert [world.prefix.num_disk_entries(g) for g in range(3)] == [0, 0, 0]
        assert [(type(e).__name__, e.group, e.medium) for e in world.events][:2] == \
            [("GroupBlockRemoved", 2, "DISK"), ("GroupBlockStored", 2, "GPU")]
        s = world.prefix.stats()
        assert s.evictions == (0, 0, 2) and s.demotions == (0, 0, 2)
        assert s.host_evictions == (0, 0, 1) and s.disk_demotions == (0, 0, 1)  # CHAIN's, host -> disk
        assert s.disk_evictions == (0, 0, 0) and s.disk_promotions == (0, 0, 0)  # the replacement: neither
        assert s.disk_cached_entries == (0, 0, 0) and s.host_cached_entries == (0, 0, 1)
    finally:
        world.close()


def test_check_invariants_names_an_entry_on_a_node_no_root_reaches():
    world = World()
    checkpoint_only(world, CHAIN)
    world.prefix.evict(2, 99)
    ((_, _, _, host),) = world.prefix.host_entries()
    node = world.prefix._tiering.by_host[2][host]
    del node.parent.children[node.key]  # detach it, as the old store did
    with pytest.raises(KvCacheError, match=r"group 2 host entry \d+ is on a node no root reaches \(depth 2\)"):
        world.prefix.check_invariants()


def test_a_store_with_a_bad_position_changes_nothing():
    world = World()
    checkpoint_only(world, OTHER)
    before = (sorted(world.prefix.entries()), [world.prefix.num_cached(g) for g in range(3)])
    (block,) = world.cache.group(0).alloc_blocks(1)
    (slot,) = world.cache.group(2).alloc_blocks(1)
    with pytest.raises(ValueError, match="group 2 entry at position 6: not a positive multiple of the unit 4"):
        world.prefix.store(CHAIN, 0, {0: [(4, block)], 2: [(6, slot)]})
    with pytest.raises(IndexError, match="group"):
        world.prefix.store(CHAIN, 0, {0: [(4, block)], 3: [(8, slot)]})
    assert (sorted(world.prefix.entries()), [world.prefix.num_cached(g) for g in range(3)]) == before
    assert world.cache.group(0).ref_count(block) == 1  # the caller's only
    world.prefix.check_invariants()  # no empty node left behind
    world.cache.group(0).free_blocks([block])
    world.cache.group(2).free_blocks([slot])


def test_clear_and_close_count_no_host_eviction():
    world = World()
    checkpoint_only(world, CHAIN)
    checkpoint_only(world, OTHER)
    world.prefix.evict(2, 99)
    world.prefix.clear()  # the host entries go, but not for room
    s = world.prefix.stats()
    assert s.host_cached_entries == (0, 0, 0) and s.demotions == (0, 0, 2) and s.host_evictions == (0, 0, 0)
    checkpoint_only(world, CHAIN)
    world.prefix.evict(2, 99)
    world.prefix.close()
    s = world.prefix.stats()
    assert s.demotions == (0, 0, 3) and s.host_evictions == (0, 0, 0)
