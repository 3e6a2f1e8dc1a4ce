"""HybridSequenceTable and HybridPrefixCache: exact block lists, sliding releases, state slots,
checkpoints, fork, the cross-group match, exports per group, refusals of the tiers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import HostBackend, HostTier, KvCacheConfig, KvCacheError, KvCacheExhausted, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.groups.window import max_live_blocks
from pagedkv.sequences.hybrid_prefix import GroupBlockRemoved, GroupBlockStored, HybridPrefixCache
from pagedkv.sequences.hybrid_table import HybridSequenceTable


def config(window=8, every=8, block_size=4, sliding_bs=None):
    return KvCacheConfig(block_size, 1, 16, 3, "bf16", layer_groups=(
        LayerGroup("full", (0,)),
        LayerGroup("sliding", (1,), window=window, block_size=sliding_bs),
        LayerGroup("state", (2,), state=(((4,), "float32"),), checkpoint_every=every),
    ))


def world(blocks=(32, 32, None), slots=None, gpu=True, **kw):
    backend = HostBackend()
    cache = PagedKvCache(config(**kw), list(blocks), backend, num_state_slots=slots)
    events = []
    prefix = PrefixCache(cache, on_event=events.append)
    table = SequenceTable(cache, prefix, backend if gpu else None)
    return backend, cache, prefix, table, events


def test_the_table_and_prefix_cache_of_a_hybrid_cache_are_the_hybrid_ones():
    _, cache, prefix, table, _ = world()
    assert isinstance(table, HybridSequenceTable) and isinstance(prefix, HybridPrefixCache)
    with pytest.raises(TypeError, match="tier must be a HybridHostTier, got object"):
        PrefixCache(cache, host_tier=object())
    with pytest.raises(TypeError, match="must be a HybridDiskTier, got object"):
        PrefixCache(cache, disk_tier=object())
    with pytest.raises(KvCacheError, match="HostTier does not support a cache with layer_groups"):
        HostTier(cache, 4, HostBackend())


def test_add_holds_every_full_block_and_only_the_window_of_a_sliding_group():
    _, cache, _, table, _ = world()
    assert table.add("a", list(range(100, 121))) == 0
    assert table.blocks("a", 0) == [0, 1, 2, 3, 4, 5]
    assert table.blocks("a", 1) == [0, 1, 2]  # blocks 3, 4, 5 of 21 tokens under an 8-token window
    assert table.first_block_position("a", 1) == 12
    assert cache.num_free_blocks(group=1) == 29
    # every 8 tokens and the end of the prompt's last whole unit (20): one slot at each
    assert table.step_checkpoints("a") == [(8, 1), (16, 2), (20, 3)]
    assert np.asarray(table.checkpoint_slots(["a"])).tolist() == [3]  # the deepest
    assert table.checkpoint_position("a") == 20
    assert np.asarray(table.state_slots(["a"])).tolist() == [0]
    table.check_invariants()


def test_append_releases_sliding_blocks_and_offers_the_written_ones():
    _, cache, prefix, table, events = world()
    table.add("a", list(range(100, 121)))
    for i in range(10):
        table.append("a", token_ids=[200 + i])
        table.check_invariants()
    assert table.num_tokens("a") == 31
    assert table.blocks("a", 0) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert table.blocks("a", 1) == [2, 3, 4]
    assert table.first_block_position("a", 1) == 20
    # released sliding blocks 3 and 4 (ends 16 and 20) were offered before they were freed
    assert prefix.num_cached(1) == 2
    assert np.asarray(table.slot_mapping(["a"], group=1)).tolist() == [4 * 4 + 2]  # position 30
    assert np.asarray(table.slot_mapping(["a"], group=0)).tolist() == [7 * 4 + 2]
    assert np.asarray(table.checkpoint_slots(["a"])).tolist() == [-1]  # the step to 31 reached none
    stored = [e for e in events if isinstance(e, GroupBlockStored)]
    assert [(e.group, e.block_id, e.position) for e in stored] == [(1, 0, 16), (1, 1, 20)]


def test_a_second_prompt_reuses_every_group_and_copies_the_checkpoint():
    gpu, cache, prefix, table, _ = world()
    prompt = list(range(100, 121))
    table.add("a", prompt)
    (slot,) = np.asarray(table.checkpoint_slots(["a"])).tolist()
    cache.write_state(2, slot, [1, 2, 3, 4], gpu)  # the engine: the state as of position 20
    for i in range(10):
        table.append("a", token_ids=[200 + i])
        if i == 2:
            assert table.step_checkpoints("a") == [(24, 4)]  # the step to 24 reached 24
    table.free("a")
    assert [prefix.num_cached(g) for g in range(3)] == [7, 4, 4]  # checkpoints at 8, 16, 20, 24
    assert table.add("b", prompt + [7]) == 20  # full 0..20, sliding [12, 20), checkpoint at 20
    assert table.blocks("b", 0)[:5] == [0, 1, 2, 3, 4]
    live = np.asarray(table.state_slots(["b"])).tolist()[0]
    np.testing.assert_array_equal(cache.read_state(2, live, gpu), np.array([1, 2, 3, 4], np.float32))
    # the hit took one reference per matched block in each group
    assert cache.group(0).ref_count(0) == 2 and cache.group(2).ref_count(slot) == 1
    table.check_invariants()


def test_no_checkpoint_no_hit_and_a_shorter_unit_still_hits():
    _, cache, prefix, table, _ = world()
    table.add("a", list(range(6)))  # checkpoint at 4
    table.free("a")
    assert table.add("b", list(range(6))) == 4
    assert table.add("c", list(range(3))) == 0  # no checkpoint at 0 < p <= 2
    assert table.add("d", [9] + list(range(1, 6))) == 0


def test_a_missing_sliding_block_limits_the_match_to_an_earlier_checkpoint():
    _, cache, prefix, table, _ = world()
    table.add("a", list(range(17)))  # prompt checkpoint at 16 and sliding blocks 2, 3, 4
    table.free("a")
    blocks = {tokens: entry for _, tokens, g, entry in prefix.entries() if g == 1}
    assert sorted(len(t) for t in blocks) == [12, 16]
    assert table.add("b", list(range(17))) == 16
    table.free("b")
    # evict the sliding block covering [12, 16): p = 16 needs it; no other checkpoint remains
    alloc, taken = cache.group(1), []
    while prefix.is_cached(1, blocks[tuple(range(16))]):
        taken.append(alloc.alloc_block())
    alloc.free_blocks(taken)
    assert prefix.is_cached(1, blocks[tuple(range(12))])  # the LRU order took the deeper one first
    assert table.add("c", list(range(17))) == 0
    table.check_invariants()


def test_fork_shares_blocks_and_copies_the_live_state():
    gpu, cache, prefix, table, _ = world()
    table.add("a", list(range(10)))
    (live,) = np.asarray(table.state_slots(["a"])).tolist()
    cache.write_state(2, live, [5, 6, 7, 8], gpu)
    table.fork("a", "b")
    (twin,) = np.asarray(table.state_slots(["b"])).tolist()
    assert twin != live
    np.testing.assert_array_equal(cache.read_state(2, twin, gpu), np.array([5, 6, 7, 8], np.float32))
    assert table.blocks("b", 0) == table.blocks("a", 0) and table.blocks("b", 1) == table.blocks("a", 1)
    table.append("b", token_ids=[1])  # the shared, partly filled last blocks are copied first
    assert table.blocks("b", 0)[-1] != table.blocks("a", 0)[-1]
    assert table.blocks("b", 1)[-1] != table.blocks("a", 1)[-1]
    table.check_invariants()


def test_without_a_backend_copies_are_left_to_the_engine():
    _, cache, prefix, table, _ = world(gpu=False)
    table.add("a", list(range(10)))
    table.fork("a", "b")
    table.append("b", token_ids=[1])
    (a_live,), (b_live,) = np.asarray(table.state_slots(["a"])), np.asarray(table.state_slots(["b"]))
    copies = table.take_pending_copies()
    assert copies == [(2, a_live, b_live), (0, 2, table.blocks("b", 0)[-1]), (1, 2, table.blocks("b", 1)[-1])]
    assert table.take_pending_copies() == []


def test_a_failed_add_changes_nothing():
    _, cache, prefix, table, _ = world(blocks=(4, 32, None), slots=3)
    table.add("a", list(range(10)))  # full 3 blocks, 1 live slot + 1 checkpoint
    before = [cache.num_free_blocks(group=g) for g in range(3)]
    with pytest.raises(KvCacheExhausted):
        table.add("b", [50] * 10)
    assert [cache.num_free_blocks(group=g) for g in range(3)] == before
    assert "b" not in table
    table.check_invariants()


def test_eviction_in_one_group_frees_that_groups_blocks_and_reports_the_group():
    _, cache, prefix, table, events = world(blocks=(8, 32, None), slots=16)
    table.add("a", list(range(30)))
    table.free("a")
    assert prefix.num_cached(0) == 7
    table.add("b", [77] * 30)  # needs 8 full blocks: the cache evicts 7 full entries
    removed = [e for e in events if isinstance(e, GroupBlockRemoved)]
    assert {e.group for e in removed} == {0} and len(removed) == 7
    table.check_invariants()


@settings(max_examples=60)
@given(
    window=st.integers(1, 20),
    block_size=st.sampled_from([1, 2, 4, 8]),
    steps=st.lists(st.integers(0, 13), min_size=1, max_size=25),
    prompt=st.integers(0, 30),
)
def test_a_sliding_group_never_holds_more_than_its_window_needs(window, block_size, steps, prompt):
    cfg = KvCacheConfig(block_size, 1, 16, 2, "bf16", layer_groups=(
        LayerGroup("full", (0,)), LayerGroup("sliding", (1,), window=window)))
    cache = PagedKvCache(cfg, [512, 64], HostBackend())
    table = SequenceTable(cache)
    table.add("s", list(range(prompt)))
    n = prompt
    bound = max_live_blocks(window, block_size)
    for step in steps:
        table.append("s", step)
        n += step
        held = table.blocks("s", 1)
        first = table.first_block_position("s", 1)
        assert len(held) <= bound
        # exactly the blocks intersecting [n - window, n)
        assert first == (max(0, n - window) // block_size) * block_size
        assert first + len(held) * block_size >= n > first + (len(held) - 1) * block_size or n == 0
    table.check_invariants()


def test_a_prompt_leaving_a_cached_chain_is_given_the_window_and_a_checkpoint_at_the_branch_point():
    gpu, cache, prefix, table, _ = world(every=None)
    a = list(range(100, 120))
    table.add("a", a)  # sliding holds [12, 20); checkpoint at 20 only
    table.free("a")
    b = a[:12] + list(range(300, 310))  # follows a's chain to 12, then leaves it
    assert table.add("b", b) == 0  # no checkpoint at 12 yet
    # the add step is given a checkpoint at the branch point 12 and at the prompt's end 20
    assert [pos for pos, _ in table.step_checkpoints("b")] == [12, 20]
    # and, beyond its window ([12, 22): 3 blocks), the sliding blocks covering [4, 12) for this step
    assert len(table.blocks("b", 1)) == 3 and table.first_block_position("b", 1) == 12
    held, free_before = table.blocks("b", 1), cache.num_free_blocks(group=1)
    mapping = np.asarray(table.slot_mapping(["b"], group=1)).tolist()
    assert mapping[:4] == [-1] * 4 and -1 not in mapping[4:]
    assert mapping[12:] == [held[(p - 12) // 4] * 4 + p % 4 for p in range(12, 22)]
    extra = sorted({s // 4 for s in mapping[4:12]})
    assert len(extra) == 2 and not set(extra) & set(held)
    table.check_invariants()
    table.cache_prefix("b")  # the step is written: the branch-point blocks go to the cache
    assert all(prefix.is_cached(1, x) for x in extra)
    assert cache.num_free_blocks(group=1) == free_before  # the cache keeps them, the sequence let go
    table.check_invariants()
    c = a[:12] + [7, 7, 7, 7, 7]
    assert table.add("c", c) == 12  # a third conversation with the same start hits the branch point
    table.check_invariants()


def test_sliding_blocks_no_hit_can_use_are_evicted_before_older_useful_ones():
    cfg = KvCacheConfig(2, 1, 16, 2, "bf16", layer_groups=(
        LayerGroup("full", (0,)), LayerGroup("sliding", (1,), window=4)))
    cache = PagedKvCache(cfg, [64, 64], HostBackend())
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix)
    chains = (list(range(1, 13)), list(range(100, 116)))  # a's blocks are all older than b's
    for sid, chain in zip("ab", chains):
        table.add(sid, chain[:2])
        for t in chain[2:]:
            table.append(sid, token_ids=[t])
        table.free(sid)
    ends = sorted(len(t) for _, t, g, _ in prefix.entries() if g == 1)
    assert ends == [2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 16]
    assert prefix.evict(1, 10) == 10
    # what is left: the blocks covering each chain's last window (a hit at its end needs them)
    left = sorted((t[0], len(t)) for _, t, g, _ in prefix.entries() if g == 1)
    assert left == [(1, 10), (1, 12), (100, 14), (100, 16)]
    assert table.add("a2", chains[0] + [9]) == 12
    assert table.add("b2", chains[1] + [9]) == 16
    table.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    every=st.sampled_from([None, 4, 8]),
    prompt=st.integers(1, 20),
    steps=st.lists(st.tuples(st.sampled_from(["one", "one", "one", "many", "fork", "cache"]), st.integers(0, 9)),
                   min_size=1, max_size=40),
)
def test_the_one_token_fast_path_leaves_exactly_what_the_full_path_leaves(window, block_size, every, prompt, steps):
    """Two tables over twin caches, one fed `token_ids=[t]` (the decode fast path), the other
    the same ids as a tuple (the full path): every export and count stays equal."""
    twins = []
    for _ in range(2):
        backend = HostBackend()
        cache = PagedKvCache(config(window=window, every=every, block_size=block_size), [200, 200, None],
                             backend, num_state_slots=200)
        twins.append((cache, SequenceTable(cache, PrefixCache(cache), backend)))
    ids = ["s"]
    for _, table in twins:
        table.add("s", list(range(prompt)))
    for i, (step, which) in enumerate(steps):
        target = ids[which % len(ids)]
        for k, (cache, table) in enumerate(twins):
            if step == "fork":
                table.fork(target, f"f{i}")
            elif step == "cache":
                table.cache_prefix(target)
            elif step == "many":
                table.append(target, token_ids=[i, i + 1])
            else:
                table.append(target, token_ids=[i] if k == 0 else (i,))
        if step == "fork":
            ids.append(f"f{i}")
        (c0, t0), (c1, t1) = twins
        for sid in ids:
            for g in (0, 1):
                assert t0.blocks(sid, g) == t1.blocks(sid, g)
                assert t0.first_block_position(sid, g) == t1.first_block_position(sid, g)
                slots = [np.asarray(t.slot_mapping([sid], group=g)).tolist() for t in (t0, t1)]
                assert slots[0] == slots[1]
            assert t0.step_checkpoints(sid) == t1.step_checkpoints(sid)
            assert t0.num_tokens(sid) == t1.num_tokens(sid)
        assert [c0.num_free_blocks(group=g) for g in range(3)] == [c1.num_free_blocks(group=g) for g in range(3)]
    for _, table in twins:
        table.check_invariants()
        for sid in ids:
            table.free(sid)
    assert twins[0][1]._prefix.entries() == twins[1][1]._prefix.entries()


def test_the_fast_path_refuses_what_the_full_path_refuses():
    _, cache, _, table, _ = world()
    table.add("a", list(range(5)))
    table.append("a", token_ids=[1])  # now within a block: the next one-token step is a fast one
    for bad in ([True], [-1], [2**63]):
        with pytest.raises((TypeError, ValueError)):
            table.append("a", token_ids=bad)
        assert table.num_tokens("a") == 6
    with pytest.raises(KeyError):
        table.append("nobody", token_ids=[1])
    table.append("a", token_ids=[3])
    assert np.asarray(table.slot_mapping(["a"], group=0)).tolist() == [table.blocks("a", 0)[1] * 4 + 2]
    table.check_invariants()


def test_a_step_of_several_tokens_keeps_the_blocks_it_attends_to_until_the_next_step():
    _, cache, prefix, table, _ = world(every=None)
    table.add("a", list(range(10)))  # window 8, block 4: blocks 0, 1, 2
    held = table.blocks("a", 1)
    table.append("a", token_ids=list(range(10, 18)))  # 18 tokens: the window starts in block 2
    assert table.first_block_position("a", 1) == 8 and len(table.blocks("a", 1)) == 3
    # position 10 attends to [3, 11): blocks 0 and 1 stay the sequence's for this step
    steps = table.step_blocks("a", 1)
    assert sorted(steps) == [0, 1, 2, 3, 4] and [steps[0], steps[1]] == held[:2]
    assert cache.num_free_blocks(group=1) == 32 - 5
    table.check_invariants()
    table.append("a", token_ids=[18])  # the next step gives them up (both are cached)
    assert sorted(table.step_blocks("a", 1)) == [2, 3, 4]
    assert prefix.is_cached(1, held[0]) and prefix.is_cached(1, held[1])
    assert cache.group(1).ref_count(held[0]) == 1
    table.check_invariants()
