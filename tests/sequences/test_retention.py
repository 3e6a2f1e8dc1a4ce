"""Retention hints: priorities (lower evicts first), TTLs on an injected clock, pins
(never evicted; KvCacheExhausted instead), the host tier, and evictions by priority."""

from __future__ import annotations

import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheError, KvCacheExhausted, PagedKvCache, PrefixCache, SequenceTable

BS = 4


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def prompts(n):
    return [list(range(100 * i, 100 * i + 8)) for i in range(n)]  # 2 blocks each


@pytest.fixture
def world():
    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 6, gpu)
    clock = Clock()
    prefix = PrefixCache(cache, clock=clock)
    yield gpu, cache, prefix, clock
    prefix.close()
    cache.release(gpu)


def cache_all(cache, prefix, ps):
    for p in ps:
        blocks = cache.alloc_blocks(2)
        prefix.insert(p, blocks)
        cache.free_blocks(blocks)


def cached(prefix, cache, p):
    found = prefix.match(p)
    cache.free_blocks(found.blocks)
    return found.num_tokens


def test_lower_priority_evicts_first_then_least_recently_used(world):
    gpu, cache, prefix, clock = world
    a, b, c = prompts(3)
    cache_all(cache, prefix, [a, b, c])  # a is the least recently used
    assert prefix.set_retention(a, priority=90) == 2
    assert prefix.set_retention(c, priority=10) == 2
    held = cache.alloc_blocks(2)  # c first (priority 10), though the most recent
    assert [cached(prefix, cache, p) for p in (a, b, c)] == [8, 8, 0]
    cache.free_blocks(held)
    held = cache.alloc_blocks(4)  # the free 2, then b (35) before a (90)
    assert [cached(prefix, cache, p) for p in (a, b, c)] == [8, 0, 0]
    assert prefix.stats().evictions_by_priority == {10: 2, 35: 2}
    cache.free_blocks(held)


def test_a_ttl_drops_the_hint_when_it_runs_out(world):
    gpu, cache, prefix, clock = world
    a, b, c = prompts(3)
    cache_all(cache, prefix, [a, b, c])
    prefix.set_retention(a, priority=100, ttl_s=30)
    clock.t += 29.5
    held = cache.alloc_blocks(2)
    assert cached(prefix, cache, a) == 8 and cached(prefix, cache, b) == 0  # a still kept
    cache.free_blocks(held)
    clock.t += 1  # the hint ran out: a is back at 35, and the least recently used of a, c
    cache_all(cache, prefix, [b])
    for p in (c, b):
        cached(prefix, cache, p)
    cache.free_blocks(cache.alloc_blocks(2))
    assert [cached(prefix, cache, p) for p in (a, b, c)] == [0, 8, 8]


def test_a_pinned_chain_is_never_evicted_allocation_raises_instead(world):
    gpu, cache, prefix, clock = world
    a, b, c = prompts(3)
    cache_all(cache, prefix, [a, b, c])
    assert prefix.pin(a) == 2 and prefix.pin(a, start=4) == 1  # block 1 pinned twice
    assert cache.num_available_blocks() == 4
    held = cache.alloc_blocks(4)
    free = cache.num_free_blocks()
    with pytest.raises(KvCacheExhausted):
        cache.alloc_blocks(1)
    assert cache.num_free_blocks() == free and cached(prefix, cache, a) == 8
    prefix.unpin(a)
    with pytest.raises(KvCacheExhausted):  # block 1 still pinned once: its parent stays too
        cache.alloc_blocks(1)
    prefix.unpin(a, start=4)
    assert cache.num_available_blocks() == 2
    cache.free_blocks(held + cache.alloc_blocks(2))
    assert cached(prefix, cache, a) == 0
    with pytest.raises(KvCacheError, match="unpin of block 0 of the prompt, which no pin holds"):
        cache_all(cache, prefix, [a]) or prefix.unpin(a)


def test_pins_hold_in_the_host_tier():
    from pagedkv.host_tier import HostTier

    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 4, gpu)
    tier = HostTier(cache, 2, gpu)
    prefix = PrefixCache(cache, host_tier=tier)
    a, b, c = prompts(3)
    cache_all(cache, prefix, [a])
    cache.free_blocks(cache.alloc_blocks(4))  # a demoted into the 2 host blocks
    assert prefix.match(a).host_num_tokens == 8
    assert prefix.pin(a) == 2  # pinned in the host tier
    cache_all(cache, prefix, [b])
    cache.free_blocks(cache.alloc_blocks(4))  # b evicted: no host room but a's, pinned, so b is dropped
    assert prefix.match(a).host_num_tokens == 8 and prefix.match(b).host_num_tokens == 0
    prefix.unpin(a)
    cache_all(cache, prefix, [c])
    cache.free_blocks(cache.alloc_blocks(4))  # now a goes for c
    assert prefix.match(a).host_num_tokens == 0 and prefix.match(c).host_num_tokens == 8
    prefix.close()
    tier.release(gpu)
    cache.release(gpu)


@pytest.mark.parametrize(
    "kw, words",
    [({"priority": 101}, "priority must be an int in \\[0, 100\\], got 101"), ({"priority": True}, "priority"),
     ({"ttl_s": 0}, "ttl_s must be a finite number of seconds > 0"), ({"ttl_s": float("nan")}, "ttl_s"),
     ({"start": -1}, "start")],
)
def test_bad_hints_raise_naming_them(world, kw, words):
    gpu, cache, prefix, clock = world
    (a,) = prompts(1)
    cache_all(cache, prefix, [a])
    with pytest.raises(ValueError, match=words):
        prefix.set_retention(a, **kw)


def test_with_a_table_hints_follow_cache_prefix():
    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 4, gpu)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    system = list(range(8))
    table.add("agent", system + [9], cache_salt="s1")
    assert prefix.set_retention(system, priority=80, cache_salt="s1") == 0  # not cached yet
    table.cache_prefix("agent")
    assert prefix.set_retention(system, priority=80, cache_salt="s1") == 2
    table.free("agent")
    table.check_invariants()
    prefix.close()
    cache.release(gpu)


def test_host_tier_drops_go_lowest_priority_first():
    from pagedkv.host_tier import HostTier

    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 4, gpu)
    tier = HostTier(cache, 4, gpu)
    prefix = PrefixCache(cache, host_tier=tier)
    a, b, c = prompts(3)
    for p in (a, b):
        cache_all(cache, prefix, [p])
        cache.free_blocks(cache.alloc_blocks(4))  # demoted: a, then b, fill the host tier
    assert prefix.set_retention(a, priority=70) == 2  # a is the least recently used, but kept longer
    cache_all(cache, prefix, [c])
    cache.free_blocks(cache.alloc_blocks(4))  # c demoted: 2 host blocks must go, b's
    assert [prefix.match(p).host_num_tokens for p in (a, b, c)] == [8, 0, 8]
    prefix.check_invariants()
    prefix.close()
    tier.release(gpu)
    cache.release(gpu)
