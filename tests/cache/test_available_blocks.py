"""`num_available_blocks` (free plus what the attached prefix cache would evict) and
`return_evicted_block` with no prefix cache attached (the seed contract)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, RefCountError, SequenceTable


def make(blocks=8):
    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    return gpu, PagedKvCache(cfg, blocks, gpu)


def test_available_is_free_without_a_prefix_cache():
    gpu, cache = make()
    cache.alloc_blocks(3)
    assert cache.num_available_blocks() == cache.num_free_blocks() == 5
    cache.release(gpu)


def test_available_counts_what_allocation_would_evict_and_nothing_else():
    gpu, cache = make(8)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(13)))  # 3 full blocks + 1
    table.free("a")  # 3 cached, held by the cache alone
    assert (cache.num_free_blocks(), cache.num_available_blocks()) == (5, 8)
    table.add("b", list(range(9)))  # matches the first 2 blocks: held again, not evictable
    assert table.blocks("b")[:2] == prefix.match(list(range(9))).blocks
    cache.free_blocks(table.blocks("b")[:2])  # the match's references, back
    # free: 8 - 3 cached - 1 fresh of b = 4; evictable: block 3 (the cached leaf only the cache holds)
    assert (cache.num_free_blocks(), cache.num_available_blocks()) == (4, 5)
    held = cache.alloc_blocks(5)  # exactly what it promised, by evicting the one leaf
    assert prefix.num_cached_blocks() == 2 and cache.num_available_blocks() == 0
    cache.free_blocks(held)
    table.free("b")
    assert cache.num_available_blocks() == 8
    prefix.close()
    cache.release(gpu)


def test_a_held_child_keeps_its_whole_chain_unavailable():
    gpu, cache = make(8)
    prefix = PrefixCache(cache)
    blocks = cache.alloc_blocks(3)
    prefix.insert(list(range(12)), blocks)
    cache.free_blocks(blocks[:2])  # the caller keeps only the deepest block
    assert cache.num_available_blocks() == 5  # its parents cannot go before it
    cache.free_blocks(blocks[2:])
    assert cache.num_available_blocks() == 8
    prefix.close()
    cache.release(gpu)


def test_return_evicted_block_without_a_prefix_cache_follows_the_seed():
    gpu, cache = make(4)
    b = cache.alloc_block()
    cache.inc_ref(b)  # the engine's own prefix cache holds it too
    cache.return_evicted_block(b)
    assert cache.ref_count(b) == 1 and cache.num_free_blocks() == 3
    cache.return_evicted_block(b)
    assert cache.ref_count(b) == 0 and cache.num_free_blocks() == 4
    with capture_logs() as logs:
        assert cache.return_evicted_block(b) is None
    assert [(e["event"], e["log_level"]) for e in logs] == [("kv_return_evicted_at_zero", "warning")]
    assert cache.num_free_blocks() == 4
    cache.check_invariants()
    cache.release(gpu)


def test_with_a_prefix_cache_attached_the_stricter_check_stays():
    gpu, cache = make(4)
    prefix = PrefixCache(cache)
    b = cache.alloc_block()
    with pytest.raises(RefCountError, match=f"block {b}, which no attached prefix cache holds"):
        cache.return_evicted_block(b)
    assert cache.ref_count(b) == 1
    prefix.close()
    cache.release(gpu)
