"""PagedKvCache batch reference paths used by the sequence table and prefix cache:
`free_blocks` (fast path and its fallback), `inc_refs`, and tracing through both."""

from __future__ import annotations

import pytest

from pagedkv import KvCacheConfig, PagedKvCache, RefCountError, SequenceTable


def make_cache(gpu, num_blocks=8):
    config = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    return PagedKvCache(config, num_blocks, gpu)


def counts(cache):
    return [cache.ref_count(b) for b in range(cache.num_blocks())]


def test_free_blocks_mixed_counts_falls_back_in_order(gpu):
    cache = make_cache(gpu)
    a, b, c = cache.alloc_blocks(3)
    cache.inc_ref(a)
    cache.free_blocks([a, b, c])  # c and b reach 0 first (last first), then a drops to 1
    assert counts(cache)[:3] == [1, 0, 0]
    assert cache.alloc_block() == b and cache.alloc_block() == c
    cache.check_invariants({a: 1, b: 1, c: 1})


def test_free_blocks_checks_every_index_before_any_count_changes(gpu):
    cache = make_cache(gpu)
    blocks = cache.alloc_blocks(3)
    before = counts(cache)
    with pytest.raises(IndexError, match="block 8 out of range for a cache of 8 blocks"):
        cache.free_blocks([blocks[0], 8, blocks[2]])
    with pytest.raises(IndexError, match="block -1 out of range for a cache of 8 blocks"):
        cache.free_blocks([blocks[0], -1])
    with pytest.raises(TypeError, match="block index must be an int, got True"):
        cache.free_blocks([blocks[0], True])
    assert counts(cache) == before
    cache.check_invariants()


def test_free_blocks_twice_in_one_call_is_a_refcount_error(gpu):
    cache = make_cache(gpu)
    block = cache.alloc_block()
    with pytest.raises(RefCountError, match=f"dec_ref of block {block} at count 0"):
        cache.free_blocks([block, block])
    assert cache.ref_count(block) == 1 and cache.num_free_blocks() == 7  # refused whole
    cache.check_invariants()


def test_inc_refs_is_all_or_nothing(gpu):
    cache = make_cache(gpu)
    a, b = cache.alloc_blocks(2)
    cache.free_block(b)
    with pytest.raises(RefCountError, match=f"inc_ref of free block {b}"):
        cache.inc_refs([a, b])
    with pytest.raises(IndexError, match="block 9 out of range"):
        cache.inc_refs([a, 9])
    assert counts(cache)[:2] == [1, 0]
    cache.inc_refs([a, a])
    assert cache.ref_count(a) == 3


def test_traced_sequence_lifecycle_records_every_count(gpu, env_flags):
    env_flags(METRALE_KV_TRACE="1")
    cache = make_cache(gpu)
    table = SequenceTable(cache, gpu=gpu)
    table.add("p", [1, 2, 3, 4, 5])
    table.fork("p", "c")
    table.free("p")
    table.free("c")
    ops = [event.split("@")[0] for event in cache.block_history(0)]
    assert ops == ["alloc->1", "inc_ref->2", "dec_ref->1", "dec_ref->0"]
    table.check_invariants()
