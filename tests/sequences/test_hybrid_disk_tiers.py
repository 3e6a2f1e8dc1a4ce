"""The hybrid prefix cache over a HybridHostTier and a HybridDiskTier: host entries the host
LRU drops are written to their group's disk tier (blocks and checkpoint slots), the match
rule counts disk-held entries, `SequenceTable.add` promotes disk -> host -> device byte for
byte with nothing changed when a step fails, events carry group and medium "DISK", a
directory comes back warm in a new cache and one of another grouping is refused naming the
field, and `stats()` counts every move per group exactly."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from shared_helpers import HYBRID_STATE, counting_host, hybrid_tier_config
from test_hybrid_prefix_tiers import PROMPT, World

from pagedkv import HybridDiskTier, HybridHostTier, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.sequences.hybrid_prefix import GroupBlockRemoved, GroupBlockStored
from pagedkv.tiers.disk_layout import DiskLayoutMismatch

CKPT8 = (tuple(PROMPT[:8]), 2)  # the checkpoint at 8: no hit of PROMPT up to 16 uses it


class DiskWorld(World):
    """World (test_hybrid_prefix_tiers) with a host tier of `host` and a disk tier in `directory`."""

    def __init__(self, directory, host=(4, 2, 1), blocks=(16, 16, None), slots=8, disk_bytes=1 << 20, config=None,
                 gpu=None):
        self.gpu = gpu or counting_host()
        self.cache = PagedKvCache(config or hybrid_tier_config(), list(blocks), self.gpu, num_state_slots=slots)
        self.tier = HybridHostTier(self.cache, [host[0], host[1], None], self.gpu, num_state_slots=host[2])
        self.disk = HybridDiskTier(directory, disk_bytes)
        self.events: list = []
        self.prefix = PrefixCache(self.cache, on_event=self.events.append, host_tier=self.tier, disk_tier=self.disk)
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)
        self.rng = np.random.default_rng(7)

    def push_down(self) -> None:
        """Every entry only the cache holds to the host, the host's overflow to disk."""
        for g in range(3):
            self.prefix.evict(g, 99)

    def tiers(self) -> list:
        """(tier, tokens, group) of every cached entry."""
        return sorted([("device", t, g) for _, t, g, _ in self.prefix.entries()]
                      + [("host", t, g) for _, t, g, _ in self.prefix.host_entries()]
                      + [("disk", t, g) for _, t, g, _ in self.prefix.disk_entries()])

    def close(self) -> None:
        self.prefix.close()
        self.disk.close()


@pytest.fixture
def world(tmp_path):
    w = DiskWorld(tmp_path / "tier")
    yield w
    w.close()


def where(world) -> dict:
    """(len(tokens), group) -> tier of every cached entry."""
    return {(len(t), g): tier for tier, t, g in world.tiers()}


def test_every_group_round_trips_through_disk_and_back_byte_for_byte(world):
    before = world.cached_prompt()
    world.events.clear()
    world.push_down()
    # host tiers of (4, 2, 1): group 0 keeps its 4 blocks on the host; the state group's one host
    # slot keeps the checkpoint demoted last, the other goes to disk
    assert where(world) == {(4, 0): "host", (8, 0): "host", (12, 0): "host", (16, 0): "host",
                            (12, 1): "host", (16, 1): "host", (8, 2): "host", (16, 2): "disk"}
    disk_events = [(type(e).__name__, e.group_idx) for e in world.events if e.medium == "DISK"]
    assert disk_events == [("GroupBlockStored", 2)]
    world.prefix.evict(0, 0)
    world.cached_prompt("c", list(range(500, 517)))  # another prompt's entries push PROMPT's host entries down
    world.push_down()
    assert sorted((len(t), g) for tier, t, g in world.tiers() if t[0] == 100 and tier == "disk") == \
        sorted((len(t), g) for t, g in before)
    world.disk.flush()
    world.garble_free()
    world.prefix.check_invariants()

    world.events.clear()
    batches = world.gpu.batches
    assert world.table.add("b", PROMPT) == 16
    assert world.gpu.batches == batches + 1  # read into host blocks, then every group in ONE swap
    after = world.contents()
    prompt_keys = {k for k in after if k[0][0] == 100}
    assert prompt_keys == set(before) - {CKPT8}
    for key in prompt_keys:
        assert after[key] == before[key], key
    (live,) = np.asarray(world.table.state_slots(["b"])).tolist()
    assert [world.cache.read_state(2, live, world.gpu, tensor=t).tobytes() for t in range(2)] == \
        before[tuple(PROMPT[:16]), 2]
    moved = [(type(e).__name__, e.medium) for e in world.events]
    assert moved.count(("GroupBlockRemoved", "DISK")) == 7 and moved.count(("GroupBlockStored", "GPU")) == 7
    world.table.check_invariants()


def test_a_match_counts_disk_entries_for_every_group_and_stats_count_each_move(tmp_path):
    world = DiskWorld(tmp_path / "t", host=(1, 1, 1))
    before = world.cached_prompt()
    world.push_down()
    # host tiers of one entry each: group 0 demotes 4 blocks in rounds of one (3 to disk), group
    # 1 demotes 2 (1 to disk), group 2 demotes 2 (1 to disk)
    assert where(world) == {(4, 0): "host", (8, 0): "disk", (12, 0): "disk", (16, 0): "disk",
                            (12, 1): "host", (16, 1): "disk", (8, 2): "host", (16, 2): "disk"}
    found = world.prefix.match(PROMPT, limit=16)
    assert (found.num_tokens, found.host_num_tokens, found.disk_num_tokens) == (16, 0, 16)
    assert [len(p) for p in found.disk_entries] == [3, 1, 1] and [len(p) for p in found.host_entries] == [1, 1, 0]
    assert [i for i, _ in found.disk_entries[0]] == [1, 2, 3] and found.group_blocks[0] == [-1, -1, -1, -1]
    assert [i for i, _ in found.host_entries[0]] == [0] and found.checkpoints[2] == -1
    world.prefix.release(found)
    s = world.prefix.stats()
    assert (s.queries, s.hit_tokens, s.device_hit_tokens, s.host_hit_tokens, s.disk_hit_tokens) == (2, 16, 0, 0, 16)
    assert s.evictions == (4, 2, 2) and s.demotions == (4, 2, 2) and s.host_evictions == (3, 1, 1)
    assert s.disk_demotions == (3, 1, 1) and s.disk_cached_entries == (3, 1, 1) and s.host_cached_entries == (1, 1, 1)
    assert s.cached_entries == (0, 0, 0) and s.disk_promotions == (0, 0, 0)

    world.garble_free()
    assert world.table.add("b", PROMPT) == 16  # host tiers full of the match's own: host first, then disk
    after = world.contents()
    assert {k: after[k] for k in before if k != CKPT8} == {k: before[k] for k in before if k != CKPT8}
    s = world.prefix.stats()
    assert s.promotions == (1, 1, 0) and s.disk_promotions == (3, 1, 1)
    assert s.queries == 3 and s.disk_hit_tokens == 32 and s.hit_rate == 32 / 51
    # staging the checkpoint at 16 took the state group's one host slot: the one at 8 went to disk
    assert s.disk_cached_entries == (0, 0, 1) and s.host_cached_entries == (0, 0, 0)
    assert s.cached_entries == (4, 2, 1) and s.disk_demotions == (3, 1, 2) and s.host_evictions == (3, 1, 2)
    world.table.check_invariants()
    world.close()


def test_stats_without_a_disk_tier_count_device_hits_and_evictions():
    world = World()
    s = world.prefix.stats()
    assert (s.queries, s.hit_tokens, s.disk_hit_tokens) == (0, 0, 0) and s.disk_demotions == (0, 0, 0)
    world.cached_prompt()
    assert world.table.add("b", PROMPT) == 16
    s = world.prefix.stats()
    assert (s.queries, s.queried_tokens, s.hit_tokens, s.device_hit_tokens) == (2, 34, 16, 16)
    assert s.cached_entries == (4, 2, 2) and s.evictions == (0, 0, 0)
    world.table.free("b")
    world.prefix.evict(1, 1)
    assert world.prefix.stats().evictions == (0, 1, 0) and world.prefix.stats().demotions == (0, 1, 0)


def sliding_spill(directory, lose_anchor: bool) -> tuple:
    """A sliding block of PROMPT on the host (one host block), the checkpoints then lost
    (`lose_anchor`: their disk writes fail) or kept on the device, then another prompt's
    sliding block pushes it off the host: (disk_demotions, host_evictions) of group 1, and
    where PROMPT's sliding blocks are."""
    world = DiskWorld(directory, host=(8, 1, 1))
    world.cached_prompt()
    world.prefix.evict(1, 1)  # one of the window's blocks to the host, while the checkpoints anchor it
    if lose_anchor:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        world.disk.group(2)._io.ops.pwritev = full
        world.prefix.evict(2, 99)  # checkpoint 16 is written to disk (and fails), 8 stays on the host
        world.disk.flush()
        world.prefix.check_invariants()
    world.cached_prompt("c", list(range(300, 317)))
    world.prefix.evict(1, 2)  # PROMPT's other block and a newcomer's, through the one host block
    world.disk.flush()
    world.prefix.check_invariants()
    s = world.prefix.stats()
    out = s.disk_demotions[1], s.host_evictions[1], sorted((tier, len(t)) for tier, t, g in world.tiers()
                                                           if g == 1 and t[0] == 100)
    world.close()
    return out


def test_sliding_blocks_no_hit_can_use_are_not_written_to_disk(tmp_path):
    assert sliding_spill(tmp_path / "a", lose_anchor=False) == (2, 2, [("disk", 12), ("disk", 16)])
    # without a checkpoint within a window after them, no hit can use them: the one on the
    # device is dropped (as without a disk tier), the one on the host is not written
    assert sliding_spill(tmp_path / "b", lose_anchor=True) == (0, 1, [])


def test_a_failing_promotion_swap_changes_nothing(world):
    world.cached_prompt()
    world.push_down()
    world.cached_prompt("c", list(range(500, 517)))
    world.push_down()
    world.disk.flush()
    state = (world.tiers(), [world.cache.num_free_blocks(group=g) for g in range(3)])
    world.events.clear()
    world.gpu.fail = True
    with pytest.raises(IndexError, match="planted failure"):
        world.table.add("b", PROMPT)
    assert "b" not in world.table
    tiers, free = world.tiers(), [world.cache.num_free_blocks(group=g) for g in range(3)]
    assert free == state[1]
    # PROMPT's entries are where they were; the host room made for staging stays made: the
    # other prompt's host entries went to disk, none was lost
    assert [x for x in tiers if x[1][0] == 100] == [x for x in state[0] if x[1][0] == 100]
    assert sorted(x[1:] for x in tiers) == sorted(x[1:] for x in state[0])
    assert {x[0] for x in tiers if x[1][0] == 500} == {"disk"}
    world.table.check_invariants()
    world.gpu.fail = False
    assert world.table.add("b", PROMPT) == 16
    world.table.check_invariants()


def test_a_failing_read_drops_the_entry_and_the_add_matches_again(world):
    before = world.cached_prompt()
    world.push_down()
    world.cached_prompt("c", list(range(500, 517)))
    world.push_down()
    world.disk.flush()
    (slot,) = [e for _, t, g, e in world.prefix.disk_entries() if g == 0 and len(t) == 16]
    tier = world.disk.group(0)
    with open(os.path.join(tier.directory(), "slots.bin"), "r+b") as f:  # the block at 16's bytes, torn
        f.seek(slot * tier.slot_bytes())
        f.write(b"\xff" * 64)
    world.events.clear()
    queries = world.prefix.stats().queries
    # the block at 16 is dropped; without it no hit is left (a hit at 8 needs sliding blocks
    # of [0, 8), never cached): the add goes on without one, nothing raised
    assert world.table.add("b", PROMPT) == 0
    s = world.prefix.stats()
    assert s.disk_failed_reads == (1, 0, 0) and s.queries == queries + 2  # matched again
    assert [(e.medium, e.group, e.block_id) for e in world.events
            if isinstance(e, GroupBlockRemoved) and e.medium == "DISK"] == [("DISK", 0, slot)]
    assert sorted((len(t), g) for tier, t, g in world.tiers() if t[0] == 100 and tier == "disk") == \
        sorted((len(t), g) for t, g in before if (len(t), g) != (16, 0))
    assert [world.tier.num_free_blocks(g) for g in range(3)] == [4, 2, 1]  # the staged host blocks freed
    world.table.check_invariants()


def test_a_full_disk_degrades_to_not_cached_and_is_counted(tmp_path):
    world = DiskWorld(tmp_path / "t", host=(1, 1, 1))
    for g in range(3):
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        world.disk.group(g)._io.ops.pwritev = full
    world.cached_prompt()
    world.push_down()  # nothing raised into the engine's step
    world.disk.flush()
    world.prefix.check_invariants()  # takes the failed writes: their entries are gone
    s = world.prefix.stats()
    assert s.disk_failed_writes == (3, 1, 1) and s.disk_cached_entries == (0, 0, 0)
    assert world.prefix.match(PROMPT, limit=16).num_tokens == 0
    world.close()


def test_a_directory_comes_back_warm_in_a_new_cache(tmp_path):
    first = DiskWorld(tmp_path / "t", host=(1, 1, 1))
    before = first.cached_prompt()
    first.cached_prompt("c", list(range(500, 517)))
    first.push_down()
    first.cached_prompt("d", list(range(700, 717)))  # PROMPT's host entries go to disk too
    first.push_down()
    first.disk.flush()
    assert sum(1 for tier, t, g in first.tiers() if tier == "disk" and t[0] == 100) == 8
    first.close()

    second = DiskWorld(tmp_path / "t", host=(8, 4, 4))
    restored = [x for x in second.tiers() if x[1][0] == 100]
    second.prefix.deliver_events()
    assert restored == sorted(("disk", t, g) for t, g in before)
    assert [e.medium for e in second.events if isinstance(e, GroupBlockStored)] == ["DISK"] * len(second.tiers())
    second.garble_free()
    assert second.table.add("b", PROMPT) == 16
    after = second.contents()
    for key in set(before) - {CKPT8}:
        assert after[key] == before[key], key
    second.table.check_invariants()
    second.close()


def test_a_directory_of_another_grouping_or_layout_is_refused_naming_the_field(tmp_path):
    DiskWorld(tmp_path / "t").close()
    groups = hybrid_tier_config().layer_groups
    other = KvCacheConfig(4, 1, 16, 4, "bf16", layer_groups=(
        groups[0], LayerGroup("sliding", (1,), window=16), groups[2]))
    gpu = counting_host()
    cache = PagedKvCache(other, [8, 8, None], gpu, num_state_slots=4)
    tier = HybridHostTier(cache, 2, gpu)
    with pytest.raises(DiskLayoutMismatch, match="group 1 window: here 16, directory 8"):
        PrefixCache(cache, host_tier=tier, disk_tier=HybridDiskTier(tmp_path / "t"))
    prefix = PrefixCache(cache, host_tier=tier)  # nothing was left attached by the refusal
    prefix.close()
    fp8 = KvCacheConfig(4, 1, 16, 4, "fp8", layer_groups=groups)
    cache = PagedKvCache(fp8, [8, 8, None], gpu, num_state_slots=4)
    with pytest.raises(DiskLayoutMismatch, match="group 0: .*dtype: here 'fp8', directory 'bf16'"):
        PrefixCache(cache, host_tier=HybridHostTier(cache, 2, gpu), disk_tier=HybridDiskTier(tmp_path / "t"))
    assert sorted(os.listdir(tmp_path / "t")) == ["group0", "group1", "group2", "groups.json"]


def test_construction_checks(tmp_path):
    gpu = counting_host()
    cache = PagedKvCache(hybrid_tier_config(), [8, 8, None], gpu, num_state_slots=4)
    with pytest.raises(ValueError, match="sits below a host tier"):
        PrefixCache(cache, disk_tier=HybridDiskTier(tmp_path / "a", 1 << 20))
    with pytest.raises(ValueError, match="capacity_bytes must be a positive int, got 0"):
        HybridDiskTier(tmp_path / "a", 0)
    with pytest.raises(ValueError, match="capacity_bytes lists 2 groups, the cache has 3"):
        PrefixCache(cache, host_tier=HybridHostTier(cache, 2, gpu), disk_tier=HybridDiskTier(tmp_path / "a", [1, 2]))
    disk = HybridDiskTier(tmp_path / "b", [1 << 20, 8192, None])  # per group; None: the whole int's default
    with pytest.raises(ValueError, match="holds no disk tier yet: give capacity_bytes for group 2"):
        PrefixCache(cache, host_tier=HybridHostTier(cache, 2, gpu), disk_tier=disk)
    assert not (tmp_path / "b").exists()  # nothing written
    disk = HybridDiskTier(tmp_path / "b", [1 << 20, 8192, 3 * 4096])
    prefix = PrefixCache(cache, host_tier=HybridHostTier(cache, 2, gpu), disk_tier=disk)
    assert [disk.group(g).num_slots() for g in range(3)] == [256, 2, 3]
    assert HYBRID_STATE == (((4,), "float32"), ((2, 3), "float16")) and disk.group(2).slot_bytes() == 4096
    prefix.close()
    disk.close()
    reopened = HybridDiskTier(tmp_path / "b")  # a reopening keeps each group's size
    prefix = PrefixCache(cache, host_tier=HybridHostTier(cache, 2, gpu), disk_tier=reopened)
    assert [reopened.group(g).num_slots() for g in range(3)] == [256, 2, 3]
    prefix.close()
    reopened.close()


def test_a_keyed_chain_is_demoted_and_promoted_but_not_restored_as_an_unkeyed_one(tmp_path):
    first = DiskWorld(tmp_path / "t", host=(1, 1, 1))
    first.table.add("a", PROMPT, extra_keys=[(9, 2, "image-1")])  # keys the unit [8, 12) and all after
    first.scribble("a")
    first.table.free("a")
    first.push_down()
    first.table.add("s", list(range(600, 617)), cache_salt="tenant-1")  # a salted chain
    first.scribble("s")
    first.table.free("s")
    first.push_down()
    first.cached_prompt("x", list(range(300, 317)))
    first.push_down()  # the rest of the chains to disk too
    first.disk.flush()
    assert sum(1 for tier, t, g in first.tiers() if t[0] == 100 and tier == "disk") == 8
    assert sum(1 for tier, t, g in first.tiers() if t[0] == 600 and tier == "disk") == 8
    salted = first.prefix.match(list(range(600, 617)), limit=16, cache_salt="tenant-1")
    assert (salted.num_tokens, salted.disk_num_tokens) == (16, 16)
    first.prefix.release(salted)
    found = first.prefix.match(PROMPT, limit=16, extra_keys=[(9, 2, "image-1")])
    assert (found.num_tokens, found.disk_num_tokens) == (16, 16)  # in this process the disk serves it
    first.prefix.release(found)
    assert first.prefix.match(PROMPT, limit=16).num_tokens == 0
    first.close()

    second = DiskWorld(tmp_path / "t", host=(4, 2, 2))
    # the entries of [0, 8) come back; those from the keyed unit on hash with keys their
    # records do not hold: not restored (never as the unkeyed tokens' entries)
    assert [(tier, len(t), g) for tier, t, g in second.tiers() if t[0] == 100] == \
        [("disk", 4, 0), ("disk", 8, 0), ("disk", 8, 2)]
    assert second.prefix.match(PROMPT, limit=16).num_tokens == 0
    assert not any(t[0] == 600 for _, t, _ in second.tiers())  # the salted chain: not restored either
    assert second.prefix.match(list(range(600, 617)), limit=16, cache_salt="tenant-1").num_tokens == 0
    second.close()


def test_a_disk_entry_a_match_pins_is_never_reused(tmp_path):
    world = DiskWorld(tmp_path / "t", host=(4, 2, 2), disk_bytes=6 * 4096)  # six slots a group
    world.cached_prompt()
    world.push_down()
    world.cached_prompt("x", list(range(300, 317)))
    world.push_down()  # PROMPT's entries to disk, the newcomer's on the host
    found = world.prefix.match(PROMPT, limit=16)  # pins its disk entries
    pinned = sorted(x for x in world.prefix.disk_entries() if x[1][0] == 100)
    assert found.num_tokens == 16 and [len(p) for p in found.disk_entries] == [4, 2, 1]
    assert len(pinned) == 8
    for n, base in enumerate((500, 700)):
        world.cached_prompt(f"c{n}", list(range(base, base + 17)))
        world.push_down()  # full disk tiers: only the unpinned slots are reused (once written)
        world.disk.flush()
    assert sorted(x for x in world.prefix.disk_entries() if x[1][0] == 100) == pinned
    assert world.prefix.stats().disk_evictions[0] >= 1
    world.prefix.release(found)
    world.cached_prompt("d", list(range(900, 917)))
    world.push_down()
    assert sorted(x for x in world.prefix.disk_entries() if x[1][0] == 100) != pinned  # released: reusable
    world.close()


def test_a_second_writer_is_refused_with_nothing_left_locked_and_a_reader_shares_the_directory(tmp_path):
    first = DiskWorld(tmp_path / "t", host=(1, 1, 1))
    before = first.cached_prompt()
    first.cached_prompt("x", list(range(300, 317)))
    first.push_down()
    first.cached_prompt("y", list(range(500, 517)))
    first.push_down()
    first.disk.flush()
    gpu = counting_host()
    cache = PagedKvCache(hybrid_tier_config(), [16, 16, None], gpu, num_state_slots=8)
    tier = HybridHostTier(cache, 4, gpu)
    with pytest.raises(Exception, match="in use by another writer"):
        PrefixCache(cache, host_tier=tier, disk_tier=HybridDiskTier(tmp_path / "t"))
    reader = HybridDiskTier(tmp_path / "t", read_only=True)
    prefix = PrefixCache(cache, host_tier=tier, disk_tier=reader)  # hits from the writer's directory
    table = SequenceTable(cache, prefix, gpu)
    assert table.add("b", PROMPT) == 16
    for (tokens, g), value in before.items():
        if (tokens, g) != CKPT8 and g != 2:
            group = cache.group(g)
            entry = {t: e for _, t, gg, e in prefix.entries() if gg == g}[tokens]
            assert [tuple(x.tobytes() for x in group.read_block(layer, entry, gpu))
                    for layer in range(group.num_layers())] == value
    assert [s.degraded for s in reader.stats()] == ["read_only"] * 3
    table.free("b")
    prefix.close()
    reader.close()
    first.close()
    again = DiskWorld(tmp_path / "t")  # the refused writer left no lock behind
    again.close()


def test_clear_forgets_the_directory_too_and_close_keeps_it(tmp_path):
    for wipe in (False, True):
        world = DiskWorld(tmp_path / str(wipe), host=(1, 1, 1))
        world.cached_prompt()
        world.cached_prompt("x", list(range(300, 317)))
        world.push_down()
        world.disk.flush()
        kept = sorted(x for x in world.tiers() if x[0] == "disk")
        if wipe:
            world.prefix.clear()
            assert world.tiers() == [] and [world.disk.group(g).num_free_slots() for g in range(3)] == [256] * 3
        world.close()
        again = DiskWorld(tmp_path / str(wipe), host=(1, 1, 1))
        restored = sorted(x for x in again.tiers() if x[0] == "disk")
        assert restored == ([] if wipe else [x for x in kept if x[1][0] == 100])  # x's chain lacks its start
        again.close()


DISK_ON_STUB = '''
import tempfile
from pagedkv import HostBackend, HybridDiskTier, HybridHostTier, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.driver import CudaBackend

CONFIG = KvCacheConfig(4, 1, 16, 4, "bf16", layer_groups=(
    LayerGroup("full", (0, 3)), LayerGroup("sliding", (1,), window=8),
    LayerGroup("state", (2,), state=(((4,), "float32"), ((2, 3), "float16")), checkpoint_every=8)))
PROMPT = list(range(100, 117))

def batches():
    names = [launch(i)[0].name for i in range(STUB.stub_launch_count())]
    return calls("cuMemcpyBatchAsync") + names.count(b"pagedkv_copy_batch")

def run(gpu, cuda):
    directory = tempfile.mkdtemp()
    cache = PagedKvCache(CONFIG, [12, 12, None], gpu, num_state_slots=8)
    tier = HybridHostTier(cache, [4, 2, None], gpu, num_state_slots=1)
    disk = HybridDiskTier(directory, 1 << 20)
    prefix = PrefixCache(cache, host_tier=tier, disk_tier=disk)
    table = SequenceTable(cache, prefix, gpu)
    s = gpu.default_stream()
    table.add("a", PROMPT)
    rows = np.random.default_rng(4).standard_normal((17, 1, 16)).astype(np.float32)
    for layer in (0, 1, 3):
        g = cache.group_of_layer(layer)
        held, first = table.blocks("a", g), table.first_block_position("a", g) // 4
        slots = [held[p // 4 - first] * 4 + p % 4 if p // 4 >= first else -1 for p in range(17)]
        cache.write_tokens(layer, slots, rows * (layer + 1), rows - layer, gpu, s)
    for pos, slot in table.step_checkpoints("a"):
        cache.write_state(2, slot, [pos, -2, 3, 4], gpu)
        cache.write_state(2, slot, np.full((2, 3), pos / 8), gpu, tensor=1)
    gpu.synchronize(s)
    table.free("a")
    table.add("x", list(range(300, 317)))
    table.free("x")
    for _ in range(2):
        for g in range(3):
            prefix.evict(g, 99)  # device -> host -> disk, in rounds of the host tiers' size
    disk.flush()
    assert sum(1 for _, t, _, _ in prefix.disk_entries() if t[0] == 100) == 8
    before = batches() if cuda else 0
    assert table.add("b", PROMPT) == 16
    gpu.synchronize(s)
    if cuda:
        assert batches() == before + 1, (before, batches())  # staged through host blocks, ONE swap
    out = []
    for layer in (0, 1, 3):
        g = cache.group_of_layer(layer)
        first = table.first_block_position("b", g) // 4
        for b in table.blocks("b", g)[:4 - first]:  # the matched blocks (the last one is b's own)
            out.append(b"".join(x.tobytes() for x in cache.group(g).read_block(cache.local_layer(layer), b, gpu)))
    live, = np.asarray(table.state_slots(["b"])).tolist()
    out += [cache.read_state(2, live, gpu, tensor=t).tobytes() for t in (0, 1)]
    table.check_invariants()
    table.free("b")
    table.release(gpu)
    prefix.close()
    disk.close()
    tier.release(gpu)
    cache.release(gpu)
    return out

host = run(HostBackend(), False)
assert len(host) == 4 + 2 + 4 + 2 and all(part.strip(b"\\0") for part in host)
with CudaBackend() as gpu:
    assert run(gpu, True) == host
print("CHECK hybrid disk on stub ok")
'''


def test_the_disk_round_trip_on_the_device_matches_host_backend(stub_env):
    from kernel_harness.stub import run_on_stub

    assert "CHECK hybrid disk on stub ok" in run_on_stub(stub_env, DISK_ON_STUB)


def test_closing_the_disk_tier_first_leaves_two_tiers(tmp_path):
    world = DiskWorld(tmp_path / "t", host=(1, 1, 1))
    world.cached_prompt()
    world.push_down()
    on_host = sorted(world.prefix.host_entries())
    world.disk.close()
    world.events.clear()
    assert world.prefix.match(PROMPT, limit=16).num_tokens == 0  # its entries are forgotten
    assert world.prefix.disk_tier() is None and world.prefix.disk_entries() == []
    assert [(type(e).__name__, e.medium) for e in world.events] == [("GroupBlockRemoved", "DISK")] * 5
    assert sorted(world.prefix.host_entries()) == on_host
    world.push_down()  # the host tier drops as without a disk tier
    world.table.check_invariants()
    world.prefix.close()
    again = DiskWorld(tmp_path / "t", host=(1, 1, 1))  # the directory kept what was written
    assert [x.restored_blocks for x in again.disk.stats()] == [3, 1, 1]  # the directory kept them
    assert again.prefix.disk_entries() == []  # but the chain's start (on the host then) was never written
    again.close()
