"""The hybrid prefix cache over a HybridHostTier: an evicted entry of any group (a full or
sliding block, a checkpoint slot) is demoted to that group's host tier in one swap, the
match rule counts host-held entries, `SequenceTable.add` promotes every group's host
entries in ONE swap byte for byte, a full host tier drops its least recently used entry
(never a pinned one), events carry their medium, and a failed promotion changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from shared_helpers import HYBRID_STATE, counting_host, hybrid_tier_config

from pagedkv import HostBackend, HybridHostTier, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.sequences.hybrid_prefix import GroupBlockRemoved, GroupBlockStored

STATE = HYBRID_STATE
PROMPT = list(range(100, 117))  # 17 tokens: full blocks 0..3, sliding blocks 2..3, checkpoints at 8 and 16

config = hybrid_tier_config


class World:
    def __init__(self, host=(12, 12, 8), blocks=(16, 16, None), slots=8):
        self.gpu = counting_host()
        self.cache = PagedKvCache(config(), list(blocks), self.gpu, num_state_slots=slots)
        self.tier = HybridHostTier(self.cache, [host[0], host[1], None], self.gpu, num_state_slots=host[2])
        self.events: list = []
        self.prefix = PrefixCache(self.cache, on_event=self.events.append, host_tier=self.tier)
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)
        self.rng = np.random.default_rng(7)

    def scribble(self, seq_id) -> None:
        """Random bytes in every block the sequence's step may write, its live slot and checkpoints."""
        for g in (0, 1):
            group = self.cache.group(g)
            for b in self.table.step_blocks(seq_id, g).values():
                for layer in range(group.num_layers()):
                    stride = group.k_block_stride_bytes_for_layer(layer)
                    group.write_block(layer, b, self.rng.integers(0, 256, stride, np.uint8),
                                      self.rng.integers(0, 256, stride, np.uint8), self.gpu)
        slots = np.asarray(self.table.state_slots([seq_id])).tolist()
        slots += [slot for _, slot in self.table.step_checkpoints(seq_id)]
        for slot in slots:
            for t, (shape, dtype) in enumerate(STATE):
                self.cache.write_state(2, slot, self.rng.standard_normal(shape).astype(dtype), self.gpu, tensor=t)

    def garble_free(self) -> None:
        """Overwrite every free block and slot: a promotion must bring the bytes back itself."""
        for g in (0, 1, 2):
            group = self.cache.group(g)
            taken = group.alloc_blocks(group.num_free_blocks())
            for x in taken:
                if g == 2:
                    for t, (shape, dtype) in enumerate(STATE):
                        self.cache.write_state(2, x, np.full(shape, 3, dtype), self.gpu, tensor=t)
                else:
                    for layer in range(group.num_layers()):
                        stride = group.k_block_stride_bytes_for_layer(layer)
                        group.write_block(layer, x, np.full(stride, 0x5A, np.uint8), np.full(stride, 0xA5, np.uint8),
                                          self.gpu)
            group.free_blocks(taken)

    def contents(self) -> dict:
        """(tokens, group) -> the bytes of every device entry (every layer's K/V, every state tensor)."""
        out = {}
        for _, tokens, g, entry in self.prefix.entries():
            group = self.cache.group(g)
            if g == 2:
                out[tokens, g] = [self.cache.read_state(2, entry, self.gpu, tensor=t).tobytes() for t in range(len(STATE))]
            else:
                out[tokens, g] = [tuple(x.tobytes() for x in group.read_block(layer, entry, self.gpu))
                                  for layer in range(group.num_layers())]
        return out

    def cached_prompt(self, seq_id="a", prompt=PROMPT) -> dict:
        self.table.add(seq_id, prompt)
        self.scribble(seq_id)
        self.table.free(seq_id)
        return self.contents()

    def counts(self):
        return (sorted(self.prefix.entries()), sorted(self.prefix.host_entries()), self.prefix.tier_counts(),
                [self.cache.num_free_blocks(group=g) for g in range(3)],
                [self.tier.group(g).lru_blocks() for g in range(3)], [self.tier.num_free_blocks(g) for g in range(3)])


@pytest.fixture
def world():
    return World()


def keys_of(entries):
    return sorted((tokens, g) for _, tokens, g, _ in entries)


def test_every_group_round_trips_byte_for_byte_through_demotion_and_one_promotion(world):
    before = world.cached_prompt()
    assert sorted((len(t), g) for t, g in before) == [(4, 0), (8, 0), (8, 2), (12, 0), (12, 1), (16, 0), (16, 1), (16, 2)]
    world.events.clear()
    for g in range(3):
        assert world.prefix.evict(g, 99) == [4, 2, 2][g]
    assert world.prefix.entries() == [] and keys_of(world.prefix.host_entries()) == sorted(before)
    assert [world.prefix.num_host_entries(g) for g in range(3)] == [4, 2, 2]
    assert [world.tier.group(g).num_cached_blocks() for g in range(3)] == [4, 2, 2]
    removed = [e for e in world.events if isinstance(e, GroupBlockRemoved)]
    stored = [e for e in world.events if isinstance(e, GroupBlockStored)]
    assert [e.medium for e in removed] == ["GPU"] * 8 and [e.medium for e in stored] == ["CPU"] * 8
    assert sorted((e.group, e.position) for e in stored) == sorted((g, len(t)) for t, g in before)
    assert {e.block_hash for e in stored} == {e.block_hash for e in removed}
    world.garble_free()
    world.prefix.check_invariants()

    batches = world.gpu.batches
    world.events.clear()
    assert world.table.add("b", PROMPT) == 16
    assert world.gpu.batches == batches + 1  # every group's host entries in ONE swap
    assert world.prefix.tier_counts()["promotions"] == 7  # the full blocks, the window's, the checkpoint at 16
    after = world.contents()
    assert sorted(after) == sorted(k for k in before if k != ((tuple(PROMPT[:8])), 2))
    for key, value in after.items():
        assert value == before[key], key
    (live,) = np.asarray(world.table.state_slots(["b"])).tolist()
    assert [world.cache.read_state(2, live, world.gpu, tensor=t).tobytes() for t in range(2)] == \
        before[tuple(PROMPT[:16]), 2]
    assert [e.medium for e in world.events if isinstance(e, GroupBlockRemoved)] == ["CPU"] * 7
    assert [e.medium for e in world.events if isinstance(e, GroupBlockStored)][:7] == ["GPU"] * 7
    assert world.prefix.num_host_entries(2) == 1  # the checkpoint at 8 stays on the host
    world.table.check_invariants()


def test_a_hit_that_needs_a_promoted_sliding_block_and_a_promoted_checkpoint(world):
    before = world.cached_prompt()
    world.prefix.evict(1, 1)  # one of the window's two sliding blocks (the least recently used)
    world.prefix.evict(2, 2)  # both checkpoints
    found = world.prefix.match(PROMPT, limit=16)
    assert (found.num_tokens, found.host_num_tokens) == (16, 16)  # the device alone: no hit at all
    host = {g: dict(pairs) for g, pairs in enumerate(found.host_entries)}
    assert [i for i, b in enumerate(found.group_blocks[1]) if b == -1] == list(host[1]) and len(host[1]) == 1
    assert found.checkpoints[2] == -1 and list(host[2]) == [0]
    assert host[0] == {} and -1 not in found.group_blocks[0]
    world.prefix.release(found)
    world.prefix.check_invariants()
    world.garble_free()
    assert world.table.add("b", PROMPT) == 16
    assert world.contents() == {k: v for k, v in before.items() if k != (tuple(PROMPT[:8]), 2)}
    assert world.prefix.tier_counts()["host_hit_tokens"] == 32  # the match above and the add's
    world.table.check_invariants()


def test_a_failing_promotion_swap_changes_nothing(world):
    world.cached_prompt()
    for g in range(3):
        world.prefix.evict(g, 99)
    world.events.clear()
    state = world.counts()
    world.gpu.fail = True
    with pytest.raises(IndexError, match="planted failure"):
        world.table.add("b", PROMPT)
    assert "b" not in world.table
    after = world.counts()
    assert after[:2] == state[:2] and after[3:] == state[3:] and world.events == []
    world.table.check_invariants()
    world.gpu.fail = False
    assert world.table.add("b", PROMPT) == 16
    world.table.check_invariants()


def test_a_failing_demotion_swap_leaves_the_victims_on_the_device(world):
    world.cached_prompt()
    state = world.counts()
    world.gpu.fail = True
    with pytest.raises(IndexError, match="planted failure"):
        world.prefix.evict(0, 2)
    assert world.counts() == state
    world.table.check_invariants()


def test_an_add_whose_eviction_cannot_demote_changes_nothing():
    world = World(blocks=(6, 6, None), slots=4)
    world.cached_prompt()  # the full group's 4 cached blocks leave 2 free: the next add must evict
    state = world.counts()
    world.gpu.fail = True
    with pytest.raises(IndexError, match="planted failure"):
        world.table.add("b", list(range(300, 317)))
    assert "b" not in world.table and world.counts() == state
    world.table.check_invariants()
    world.gpu.fail = False
    world.table.add("b", list(range(300, 317)))
    assert world.prefix.num_host_entries(0) >= 1
    world.table.check_invariants()


def test_a_table_without_a_backend_promotes_on_the_swap_stream_and_waits():
    world = World()
    before = world.cached_prompt()
    for g in range(3):
        world.prefix.evict(g, 99)
    bare = SequenceTable(world.cache, world.prefix)
    world.garble_free()
    assert bare.add("b", PROMPT) == 16
    assert world.contents() == {k: v for k, v in before.items() if k != (tuple(PROMPT[:8]), 2)}
    assert [g for g, _, _ in bare.take_pending_copies()] == [2]  # the checkpoint into the live slot: the engine's
    bare.check_invariants()


def test_a_full_host_tier_drops_its_least_recently_used_entry_and_never_a_pinned_one():
    world = World(host=(12, 1, 8))
    world.cached_prompt()
    sliding = {len(t): e for _, t, g, e in world.prefix.entries() if g == 1}
    world.events.clear()
    world.prefix.evict(1, 1)  # the least recently used sliding block to the one host block
    ((_, first, _, h1),) = world.prefix.host_entries()
    world.prefix.evict(1, 1)  # the other takes its place: the host LRU drops the older
    ((_, second, _, h2),) = world.prefix.host_entries()
    assert sorted([len(first), len(second)]) == [12, 16]
    cpu = [(type(e).__name__, e.block_id) for e in world.events if e.medium == "CPU"]
    assert cpu == [("GroupBlockStored", h1), ("GroupBlockRemoved", h1), ("GroupBlockStored", h2)]
    assert world.prefix.tier_counts()["host_drops"] == 1

    assert sliding  # both sliding blocks were cached to begin with


def test_a_host_entry_a_match_pins_is_never_dropped():
    world = World(host=(12, 1, 8))
    world.cached_prompt()
    world.prefix.evict(1, 1)
    found = world.prefix.match(PROMPT, limit=16)  # needs the host entry: pins it
    assert found.num_tokens == 16 and len(found.host_entries[1]) == 1
    (pinned,) = world.tier.group(1).lru_blocks()
    world.cached_prompt("c", list(range(200, 217)))  # two more sliding blocks only the cache holds
    world.events.clear()
    assert world.prefix.evict(1, 1) == 1
    assert [(type(e).__name__, e.medium) for e in world.events] == [("GroupBlockRemoved", "GPU")]  # dropped
    assert world.tier.group(1).lru_blocks() == [pinned] and [h for _, h in found.host_entries[1]] == [pinned]
    world.prefix.release(found)
    world.table.check_invariants()
    ((_, held, _, _),) = world.prefix.host_entries()
    world.prefix.evict(1, 1)  # unpinned now: the host LRU gives way
    ((_, now, _, _),) = world.prefix.host_entries()
    assert now != held and world.prefix.tier_counts()["host_drops"] == 1


def test_a_device_entry_offered_over_a_host_entry_takes_its_place(world):
    world.cached_prompt()
    world.prefix.evict(0, 99)
    assert world.prefix.num_host_entries(0) == 4
    world.table.add("b", PROMPT[:5] + [1, 2, 3, 4])  # hits nothing (no checkpoint on the host at 4)
    world.scribble("b")
    world.table.free("b")  # its first full block ends at 4, like the host one: the device one is kept
    assert world.prefix.num_host_entries(0) == 3
    world.prefix.check_invariants()


def test_clear_and_close_free_every_host_entry(world):
    world.cached_prompt()
    for g in range(3):
        world.prefix.evict(g, 99)
    world.prefix.clear()
    assert world.prefix.host_entries() == [] and [world.tier.num_free_blocks(g) for g in range(3)] == [12, 12, 8]
    world.cached_prompt()
    world.prefix.evict(0, 99)
    world.prefix.close()
    assert [world.tier.num_free_blocks(g) for g in range(3)] == [12, 12, 8]
    world.tier.group(0).alloc(12)  # no longer owned: the tier is the caller's again


def test_releasing_the_host_tier_first_leaves_a_device_only_cache(world):
    world.cached_prompt()
    world.prefix.evict(1, 99)
    world.tier.release(world.gpu)
    world.events.clear()
    assert world.prefix.match(PROMPT, limit=16).num_tokens == 0  # the sliding blocks were on the host
    assert [(type(e).__name__, e.medium) for e in world.events] == [("GroupBlockRemoved", "CPU")] * 2
    assert world.prefix.host_tier() is None and world.prefix.host_entries() == []
    world.prefix.evict(0, 99)  # dropped now: nowhere to demote to
    assert world.prefix.num_cached(0) == 0
    world.table.check_invariants()
    world.prefix.close()


def test_construction_checks():
    gpu = HostBackend()
    cache = PagedKvCache(config(), [8, 8, None], gpu, num_state_slots=4)
    other = PagedKvCache(config(), [8, 8, None], gpu, num_state_slots=4)
    with pytest.raises(Exception, match="another cache"):
        PrefixCache(cache, host_tier=HybridHostTier(other, 2, gpu))
    tier = HybridHostTier(cache, 2, gpu)
    prefix = PrefixCache(cache, host_tier=tier)
    assert prefix.host_tier() is tier
    with pytest.raises(ValueError, match="not the backend of the prefix cache's host tier"):
        SequenceTable(cache, prefix, HostBackend())
