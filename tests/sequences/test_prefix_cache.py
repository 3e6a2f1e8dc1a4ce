"""PrefixCache: exact-token radix tree, references, LRU eviction, evicting allocation, events."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from pagedkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheConfig,
    KvCacheError,
    KvCacheExhausted,
    PagedKvCache,
    PrefixCache,
    PrefixMatch,
    RefCountError,
    SequenceTable,
)
from pagedkv.sequences.prefix_cache import chain_hash, root_hash

BS = 4


def make_cache(gpu, num_blocks=8):
    config = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")
    return PagedKvCache(config, num_blocks, gpu)


def counts(cache):
    return [cache.ref_count(b) for b in range(cache.num_blocks())]


def held_by_caller(cache, tokens, prefix, adapter_id=0):
    """Allocate blocks for `tokens`, insert them, and return them (the caller still holds them)."""
    blocks = cache.alloc_blocks(-(-len(tokens) // BS))
    prefix.insert(tokens, blocks, adapter_id)
    return blocks


def test_empty_cache_matches_nothing(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    assert prefix.match(list(range(12))) == PrefixMatch([], 0)
    stats = prefix.stats()
    assert (stats.queries, stats.queried_tokens, stats.hit_tokens, stats.hit_rate) == (1, 12, 0, 0.0)
    assert (stats.cached_blocks, stats.evictions) == (0, 0)


def test_insert_takes_one_reference_and_match_one_more(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    tokens = list(range(10))  # two full blocks and a partial one
    blocks = cache.alloc_blocks(3)
    assert prefix.insert(tokens, blocks) == 2
    assert [cache.ref_count(b) for b in blocks] == [2, 2, 1]
    assert prefix.num_cached_blocks() == 2 and not prefix.is_cached(blocks[2])
    found = prefix.match(tokens + [77, 78])
    assert found == PrefixMatch(blocks[:2], 8)
    assert [cache.ref_count(b) for b in blocks] == [3, 3, 1]
    assert prefix.match(np.array(tokens[:7])) == PrefixMatch(blocks[:1], 4)
    assert prefix.stats().hit_tokens == 12 and prefix.stats().queried_tokens == 19
    assert prefix.stats().hit_rate == 12 / 19
    cache.free_blocks(blocks)
    cache.free_blocks(blocks[:2])
    cache.free_blocks(blocks[:1])
    assert [cache.ref_count(b) for b in blocks] == [1, 1, 0]
    prefix.check_invariants()
    cache.check_invariants(prefix.block_references())


def test_keys_are_exact_tokens_not_hashes(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    a = held_by_caller(cache, [1, 2, 3, 4, 5, 6, 7, 8], prefix)
    b = held_by_caller(cache, [1, 2, 3, 4, 5, 6, 7, 9], prefix)
    assert b[0] != a[0]  # the caller's first block was a duplicate chunk: not cached
    assert prefix.is_cached(a[0]) and not prefix.is_cached(b[0]) and prefix.is_cached(b[1])
    assert prefix.match([1, 2, 3, 4, 5, 6, 7, 9]).blocks == [a[0], b[1]]
    assert prefix.match([1, 2, 3, 4, 5, 6, 7, 10]).blocks == [a[0]]
    assert prefix.match([1, 2, 3, 5]).blocks == []


def test_adapters_never_share(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    base = held_by_caller(cache, [1, 2, 3, 4], prefix, adapter_id=0)
    lora = held_by_caller(cache, [1, 2, 3, 4], prefix, adapter_id=3)
    assert prefix.match([1, 2, 3, 4, 9]).blocks == base
    assert prefix.match([1, 2, 3, 4, 9], adapter_id=3).blocks == lora
    assert prefix.match([1, 2, 3, 4, 9], adapter_id=1).blocks == []
    assert prefix.block_hash(base[0]) != prefix.block_hash(lora[0])


def test_hash_is_chained_blake2b_of_parent_and_int64_tokens(gpu):
    seed = hashlib.blake2b(b"pagedkv-prefix-root" + (0).to_bytes(8, "little"), digest_size=8).digest()
    assert root_hash(0) == int.from_bytes(seed, "little")
    first = hashlib.blake2b(seed + struct.pack("<4q", 1, 2, 3, 4), digest_size=8).digest()
    second = hashlib.blake2b(first + struct.pack("<4q", 5, 6, 7, 8), digest_size=8).digest()
    assert chain_hash(root_hash(0), [1, 2, 3, 4]) == int.from_bytes(first, "little")
    cache = make_cache(gpu)
    events = []
    prefix = PrefixCache(cache, on_event=events.append)
    blocks = held_by_caller(cache, [1, 2, 3, 4, 5, 6, 7, 8], prefix)
    hashes = (int.from_bytes(first, "little"), int.from_bytes(second, "little"))
    assert [prefix.block_hash(b) for b in blocks] == list(hashes)
    assert events == [
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
            block_ids=tuple(blocks),
            block_size=BS,
            adapter_id=0,
        )
    ]
    more = cache.alloc_blocks(3)
    prefix.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], more)
    assert events[-1].parent_block_hash == hashes[1]
    assert events[-1].block_ids == (more[2],) and events[-1].token_ids == (9, 9, 9, 9)


def test_evict_takes_lru_leaves_held_by_the_cache_alone(gpu):
    cache = make_cache(gpu)
    events = []
    prefix = PrefixCache(cache, on_event=events.append)
    a = held_by_caller(cache, [1] * 8, prefix)  # chain a0 -> a1
    b = held_by_caller(cache, [2] * 4, prefix)
    cache.free_blocks(a)  # a1 released before a0 (tail first)
    assert prefix.evict(10) == [a[1], a[0]]  # b still held by its caller
    assert events[-1] == BlockRemoved(
        block_hashes=(chain_hash(chain_hash(root_hash(0), [1] * 4), [1] * 4), chain_hash(root_hash(0), [1] * 4)),
        block_ids=(a[1], a[0]),
    )
    assert [cache.ref_count(x) for x in a] == [0, 0]
    cache.free_blocks(b)
    assert prefix.stats().evictions == 2
    assert prefix.evict(0) == []
    assert prefix.evict(1) == b
    prefix.check_invariants()
    cache.check_invariants({})


def test_recent_match_protects_a_block(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    a = held_by_caller(cache, [1] * 4, prefix)
    b = held_by_caller(cache, [2] * 4, prefix)
    cache.free_blocks(a)
    cache.free_blocks(b)
    cache.free_blocks(prefix.match([1] * 4).blocks)  # a used again, after b
    assert prefix.evict(1) == b
    assert prefix.evict(1) == a


def test_the_last_release_of_a_shared_block_counts_as_its_latest_use(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    a = held_by_caller(cache, [1] * 8, prefix)  # inserted first
    b = held_by_caller(cache, [2] * 8, prefix)
    cache.free_blocks(b)  # both blocks of each chain fall to one in one free_blocks call
    cache.free_blocks(a)  # a released after b: b is now the least recently used
    assert prefix.evict(2) == [b[1], b[0]]
    assert prefix.evict(2) == [a[1], a[0]]


def test_a_chain_found_again_by_insert_stays_evictable(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    a = held_by_caller(cache, [1] * 8, prefix)
    cache.free_blocks(a)  # a's chain is held by the cache alone
    b = cache.alloc_blocks(2)
    assert prefix.insert([1] * 8, b) == 0  # the same tokens: a's chain is used again, b is not cached
    cache.free_blocks(b)
    assert prefix.evict(8) == [a[1], a[0]]
    assert counts(cache) == [0] * 8
    prefix.check_invariants()


def test_parent_is_never_evicted_before_its_child(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    chain = held_by_caller(cache, [5] * 12, prefix)
    cache.free_blocks(chain[:1])  # the root-side block is released first (oldest) ...
    cache.free_blocks(chain[1:])
    assert prefix.evict(1) == [chain[2]]  # ... but only a leaf may go
    assert prefix.evict(5) == [chain[1], chain[0]]


def test_alloc_blocks_evicts_just_enough(gpu):
    cache = make_cache(gpu, num_blocks=6)
    prefix = PrefixCache(cache)
    cached = held_by_caller(cache, list(range(16)), prefix)  # 4 blocks
    cache.free_blocks(cached)
    assert cache.num_free_blocks() == 2
    taken = cache.alloc_blocks(3)
    assert prefix.num_cached_blocks() == 3 and prefix.stats().evictions == 1
    assert not prefix.is_cached(cached[3]) and cached[3] in taken
    assert prefix.match(list(range(16))).blocks == cached[:3]
    cache.check_invariants({**{b: 1 for b in taken}, **{b: 2 for b in cached[:3]}})


def test_alloc_blocks_exhausted_takes_and_evicts_nothing(gpu):
    cache = make_cache(gpu, num_blocks=6)
    prefix = PrefixCache(cache)
    cached = held_by_caller(cache, list(range(16)), prefix)
    cache.free_blocks(cached[2:])  # only the last two are evictable; the first two are held
    before = counts(cache)
    with pytest.raises(KvCacheExhausted, match="asked for 5 block.* 2 of 6 are free and the prefix cache"):
        cache.alloc_blocks(5)
    assert counts(cache) == before and prefix.num_cached_blocks() == 4
    assert len(cache.alloc_blocks(4)) == 4  # exactly what eviction can reach
    assert prefix.num_cached_blocks() == 2
    prefix.check_invariants()


def test_alloc_block_evicts_when_the_free_list_is_empty(gpu):
    cache = make_cache(gpu, num_blocks=2)
    prefix = PrefixCache(cache)
    cached = held_by_caller(cache, [3] * 8, prefix)
    with pytest.raises(KvCacheExhausted):
        cache.alloc_block()
    assert cache.try_alloc_block() is None
    cache.free_block(cached[1])
    assert cache.alloc_block() == cached[1]
    assert prefix.num_cached_blocks() == 1 and cache.ref_count(cached[0]) == 2


def test_insert_keeps_existing_blocks_and_rejects_bad_blocks(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    first = held_by_caller(cache, [1] * 8, prefix)
    other = cache.alloc_blocks(2)
    assert prefix.insert([1] * 8, other) == 0
    assert [cache.ref_count(b) for b in other] == [1, 1]
    before = (counts(cache), prefix.num_cached_blocks())
    with pytest.raises(ValueError, match="block .* is already cached for other tokens"):
        prefix.insert([2] * 4, [first[0]])
    with pytest.raises(ValueError, match="insert given a block twice"):
        prefix.insert([2] * 8, [other[0], other[0]])
    free_block = cache.alloc_block()
    cache.free_block(free_block)
    with pytest.raises(RefCountError, match=f"insert of a free block.*inc_ref of free block {free_block}"):
        prefix.insert([2] * 4, [free_block])
    with pytest.raises(ValueError, match="9 tokens fill 2 block"):
        prefix.insert([2] * 9, [other[0]])
    with pytest.raises(ValueError, match=r"tokens\[1\] is -5"):
        prefix.insert([2, -5, 2, 2], [other[0]])
    with pytest.raises(TypeError, match=r"tokens\[0\] must be an int token id, got 1.5"):
        prefix.insert([1.5, 2, 2, 2], [other[0]])
    with pytest.raises(ValueError, match="adapter_id must be a non-negative int, got -1"):
        prefix.match([1] * 4, adapter_id=-1)
    assert (counts(cache), prefix.num_cached_blocks()) == before


def test_clear_returns_references_and_keeps_held_blocks(gpu):
    cache = make_cache(gpu)
    events = []
    prefix = PrefixCache(cache, on_event=events.append)
    held = held_by_caller(cache, [1] * 4, prefix)
    idle = held_by_caller(cache, [2] * 4, prefix)
    cache.free_blocks(idle)
    prefix.clear()
    assert events[-1] == AllBlocksCleared()
    assert cache.ref_count(held[0]) == 1 and cache.ref_count(idle[0]) == 0
    assert prefix.match([1] * 4) == PrefixMatch([], 0)
    cache.check_invariants({held[0]: 1})


def test_one_prefix_cache_per_kv_cache(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    with pytest.raises(KvCacheError, match="already has a prefix cache"):
        PrefixCache(cache)
    prefix.close()
    assert cache.attached_prefix_cache() is None
    PrefixCache(cache)


def test_check_invariants_catches_count_and_tree_corruption(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    blocks = held_by_caller(cache, [1] * 8, prefix)
    with pytest.raises(RefCountError, match=f"block {blocks[0]} has count 2 but its holders account for 1"):
        cache.check_invariants(prefix.block_references())
    cache.check_invariants({b: 2 for b in blocks})
    node = prefix._by_block[blocks[1]]
    node.hash ^= 1
    with pytest.raises(KvCacheError, match=f"block {blocks[1]} carries a wrong hash"):
        prefix.check_invariants()


def test_released_blocks_stay_evictable_after_many_cycles(gpu):
    cache = make_cache(gpu, num_blocks=8)
    prefix = PrefixCache(cache)
    for i in range(4):
        cache.free_blocks(held_by_caller(cache, [i] * 4, prefix))
    for _ in range(500):  # every release pushes a heap entry; the heap must stay bounded
        cache.free_blocks(prefix.match([1] * 4).blocks)
    assert len(prefix._policy._heap) <= 2 * 4 + 65
    assert prefix.evict(4) == [0, 2, 3, 1]


def test_match_refuses_tokens_that_are_not_ints(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    tokens = list(range(2 * BS))
    blocks = held_by_caller(cache, tokens, prefix)
    before = counts(cache)
    for bad, shown in (([float(t) for t in tokens], "0.0"), ([True] + tokens[1:], "True")):
        with pytest.raises(TypeError, match=rf"tokens\[0\] must be an int token id, got {shown}"):
            prefix.match(bad)
    assert counts(cache) == before
    assert prefix.match(np.array(tokens, dtype=np.int32)).blocks == blocks
    cache.free_blocks(blocks)
    cache.free_blocks(blocks)
    prefix.close()
    cache.release(gpu)


def test_releasing_the_cache_closes_its_prefix_cache(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    blocks = held_by_caller(cache, list(range(BS)), prefix)
    cache.free_blocks(blocks)
    assert prefix.num_cached_blocks() == 1
    cache.release(gpu)
    assert cache.attached_prefix_cache() is None and prefix.num_cached_blocks() == 0
    prefix.clear()  # nothing left to hand back: no error
    with pytest.raises(KvCacheError, match="released: no block can be allocated"):
        cache.alloc_block()


def test_reserve_then_confirm_or_cancel(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    tokens = list(range(2 * BS))
    blocks = held_by_caller(cache, tokens, prefix)
    cache.free_blocks(blocks)
    stats, before = prefix.stats(), counts(cache)
    found = prefix.reserve(tokens + [5])
    assert found == PrefixMatch(blocks, 2 * BS)
    assert [cache.ref_count(b) for b in blocks] == [2, 2] and prefix.stats() == stats
    prefix.cancel(found)
    assert counts(cache) == before and prefix.stats() == stats
    found = prefix.reserve(tokens + [5])
    prefix.confirm(2 * BS + 1, found)
    after = prefix.stats()
    assert (after.queries, after.queried_tokens, after.hit_tokens) == (stats.queries + 1, stats.queried_tokens + 9, 8)
    cache.free_blocks(found.blocks)
    prefix.close()
    cache.release(gpu)


# -- hash values are part of the KV-event contract ------------------------------------------


def test_hash_values_are_pinned(gpu):
    """Values computed on commit bcc1fa4 (before the insert loop was rewritten): routers
    compare them across engines, so they must never change."""
    r0 = root_hash(0)
    assert (r0, root_hash(7)) == (0x984CD6943ED57F52, 0x6D5780DC1BA99DE8)
    assert chain_hash(r0, list(range(16))) == 0x0F778A62521EE411
    assert chain_hash(0x0F778A62521EE411, [2**63 - 1] * 16) == 0x64BD1C23215ED345
    assert chain_hash(root_hash(7), [5, 0, 31999, 12] * 4) == 0xDC96A4B7159D4869
    cache = make_cache(gpu)
    events = []
    prefix = PrefixCache(cache, on_event=events.append)
    first = cache.alloc_blocks(3)
    prefix.insert([7, 2**63 - 1, 0, 31999, 5, 5, 5, 5, 1, 2, 3, 4], first, adapter_id=3)
    more = cache.alloc_blocks(2)
    prefix.insert([7, 2**63 - 1, 0, 31999, 5, 5, 5, 5, 9, 9, 9, 9, 8, 8, 8, 8], first[:2] + more, adapter_id=3)
    assert events[0].block_hashes == (0xF15FF353778C4CA8, 0x24585DF407D9D40A, 0xDE1346873E7C0699)
    assert events[1].block_hashes == (0x9BCEDB6546166F57, 0x1AE33FF0A48A6ABB)
    assert events[1].parent_block_hash == 0x24585DF407D9D40A
    assert [prefix.block_hash(b) for b in more] == list(events[1].block_hashes)
    prefix.check_invariants()


# -- events are delivered once the operation is complete ------------------------------------


def fully_cached(cache, prefix, n_blocks):
    """Cache `n_blocks` blocks of distinct tokens and release the caller's references:
    every block is then evictable and the free list holds the rest."""
    blocks = cache.alloc_blocks(n_blocks)
    prefix.insert(list(range(100, 100 + n_blocks * BS)), blocks)
    cache.free_blocks(blocks)
    return blocks


def test_a_consumer_that_allocates_sees_a_finished_allocation(gpu):
    cache = make_cache(gpu)
    got = []

    def consumer(event):
        if isinstance(event, BlockRemoved) and not got:
            got.append(cache.alloc_block())  # evicts once more: its event comes after this one
            cache.check_invariants(held)

    prefix = PrefixCache(cache, on_event=consumer)
    fully_cached(cache, prefix, 8)
    held = prefix.block_references()
    taken = cache.alloc_blocks(3)
    assert len(taken) == 3 and len(got) == 1 and len(set(taken) | set(got)) == 4
    assert prefix.stats().evictions == 4 and cache.num_free_blocks() == 0
    held = prefix.block_references()
    for block in taken + got:
        held[block] = 1
    cache.check_invariants(held)
    prefix.check_invariants()


def test_a_consumer_that_raises_leaves_the_operation_done(gpu):
    cache = make_cache(gpu)
    seen = []

    def consumer(event):
        seen.append(event)
        if len(seen) == 1:
            raise RuntimeError("consumer failed")

    prefix = PrefixCache(cache, on_event=consumer)
    blocks = cache.alloc_blocks(2)
    with pytest.raises(RuntimeError, match="consumer failed"):
        prefix.insert(list(range(2 * BS)), blocks)
    assert prefix.num_cached_blocks() == 2 and counts(cache)[:2] == [2, 2]  # the insert is complete
    prefix.check_invariants()
    cache.free_blocks(blocks)
    # an allocation whose eviction event raises hands its blocks back: nothing taken
    seen.clear()
    free_before = cache.num_free_blocks()
    with pytest.raises(RuntimeError, match="consumer failed"):
        cache.alloc_blocks(7)
    assert cache.num_free_blocks() == free_before + 1 and prefix.num_cached_blocks() == 1
    cache.check_invariants(prefix.block_references())
    assert len(seen) == 1


def test_events_after_a_raising_one_stay_queued(gpu):
    cache = make_cache(gpu)
    seen, extra = [], []

    def consumer(event):
        if not isinstance(event, BlockRemoved):
            return
        seen.append(event.block_ids)
        if len(seen) == 1:
            extra.append(cache.alloc_block())  # evicts again: that event waits behind this one
            raise RuntimeError("consumer failed")

    prefix = PrefixCache(cache, on_event=consumer)
    fully_cached(cache, prefix, 8)
    with pytest.raises(RuntimeError, match="consumer failed"):
        cache.alloc_block()
    assert len(seen) == 1 and cache.num_free_blocks() == 1  # the raising allocation handed its block back
    prefix.deliver_events()
    assert seen == [(7,), (6,)] and extra == [6]
    prefix.deliver_events()  # nothing left: nothing delivered twice
    assert len(seen) == 2


def test_events_wait_for_the_end_of_a_sequence_table_call(gpu):
    cache = make_cache(gpu)
    observed = []

    def consumer(event):
        observed.append((type(event).__name__, len(table), cache.num_free_blocks()))

    prefix = PrefixCache(cache, on_event=consumer)
    table = SequenceTable(cache, prefix)
    table.add("a", list(range(8 * BS)))
    table.free("a")  # all 8 blocks are cached: reported once "a" is gone
    assert observed == [("BlockStored", 0, 0)]
    table.add("b", list(range(500, 500 + 3 * BS)))  # evicts three: reported once "b" exists
    assert observed[1:] == [("BlockRemoved", 1, 0)]
    table.check_invariants()


def test_a_decode_append_that_evicts_reports_once_the_token_is_in(gpu):
    cache = make_cache(gpu)
    observed = []

    def consumer(event):
        if "b" in table:
            observed.append((type(event).__name__, table.num_tokens("b"), len(table.blocks("b"))))

    prefix = PrefixCache(cache, on_event=consumer)
    table = SequenceTable(cache, prefix)
    table.add("a", list(range(7 * BS)))
    table.free("a")  # 7 blocks cached, 1 free
    table.add("b", [900] * BS)  # takes the free block
    observed.clear()
    table.append("b", 1, [901])  # crosses into a new block: evicts one cached block
    assert observed == [("BlockRemoved", BS + 1, 2)]
    assert prefix.stats().evictions == 1
    table.check_invariants()


# -- a match or reservation is released once --------------------------------------------------


def test_a_reservation_is_released_once(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    tokens = list(range(2 * BS))
    fully_cached_blocks = held_by_caller(cache, tokens, prefix)
    cache.free_blocks(fully_cached_blocks)
    found = prefix.reserve(tokens + [1])
    prefix.cancel(found)
    before = counts(cache)
    for again in (lambda: prefix.cancel(found), lambda: prefix.confirm(9, found)):
        with pytest.raises(RefCountError, match="already confirmed or cancelled"):
            again()
        assert counts(cache) == before
    found = prefix.reserve(tokens + [1])
    prefix.confirm(9, found)
    with pytest.raises(RefCountError, match="already confirmed or cancelled"):
        prefix.cancel(found)
    cache.free_blocks(found.blocks)
    assert counts(cache) == before
    with pytest.raises(TypeError, match="takes the result of reserve"):
        prefix.cancel(PrefixMatch(fully_cached_blocks, 8))
    assert counts(cache) == before


def test_freeing_a_match_twice_never_hands_out_cached_kv(gpu):
    """The issue's scenario: a second release of a match took a cached block to count 0, the
    block was reused while still cached, and a later match returned another sequence's KV."""
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    prompt = list(range(2 * BS))
    cached = held_by_caller(cache, prompt, prefix)
    cache.free_blocks(cached)
    found = prefix.match(prompt)
    cache.free_blocks(found.blocks)
    before = counts(cache)
    with pytest.raises(RefCountError, match=f"would free block {cached[0]}, which the prefix cache still holds"):
        cache.free_blocks(found.blocks)
    for release in (cache.dec_ref, cache.free_block):
        with pytest.raises(RefCountError, match="which the prefix cache still holds"):
            release(found.blocks[0])
    assert counts(cache) == before
    others = [cache.alloc_block() for _ in range(cache.num_free_blocks())]
    assert not set(others) & set(cached)
    assert prefix.match(prompt).blocks == cached
    cache.check_invariants({**prefix.block_references(), **{b: 2 for b in cached}, **dict.fromkeys(others, 1)})


def test_return_evicted_block_refuses_a_block_the_prefix_cache_does_not_hold(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    block = cache.alloc_block()
    cache.inc_ref(block)
    with pytest.raises(RefCountError, match=f"return_evicted_block of block {block}, which no attached prefix cache holds"):
        cache.return_evicted_block(block)
    assert cache.ref_count(block) == 2
    del prefix


def test_check_invariants_catches_a_free_block_that_is_still_cached(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    block = fully_cached(cache, prefix, 1)[0]
    cache._allocator._refs[block] = 0  # the corruption a double release used to leave behind
    cache._allocator._free.append(block)
    with pytest.raises(RefCountError, match=f"free block {block} is still held by the prefix cache"):
        cache.check_invariants()


# -- a closed prefix cache takes nothing --------------------------------------------------------


def test_a_closed_prefix_cache_takes_nothing(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix)
    prompt = list(range(2 * BS + 1))
    table.add("a", prompt)
    prefix.close()
    assert prefix.closed() and cache.attached_prefix_cache() is None
    with pytest.raises(KvCacheError, match="insert on a closed PrefixCache"):
        prefix.insert(prompt, table.blocks("a"))
    with pytest.raises(KvCacheError, match="cache_prefix on a closed PrefixCache"):
        table.cache_prefix("a")
    table.free("a")
    assert prefix.num_cached_blocks() == 0 and cache.num_free_blocks() == 8
    for i in range(20):  # with nothing evicting, a tree that kept growing would exhaust the cache
        table.add(i, prompt)
        table.free(i)
    assert prefix.match(prompt) == PrefixMatch([], 0)
    assert prefix.num_cached_blocks() == 0 and cache.num_free_blocks() == 8
    prefix.close()  # a second close does nothing
    table.check_invariants()


# -- one token-id rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, error, shown",
    [
        (None, TypeError, "tokens must be a sequence of int token ids, got None"),
        ("abcd", TypeError, "tokens must be a sequence of int token ids, got str 'abcd'"),
        ([2**64], ValueError, r"tokens\[0\] is 18446744073709551616: token ids must lie in \[0, 2\*\*63\)"),
        ([1, 2, -1], ValueError, r"tokens\[2\] is -1"),
        ([2**63], ValueError, r"tokens\[0\] is 9223372036854775808"),
        ([1, True], TypeError, r"tokens\[1\] must be an int token id, got True"),
    ],
)
def test_match_and_reserve_use_the_one_token_id_rule(gpu, bad, error, shown):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix)
    fully_cached(cache, prefix, 2)
    before = (counts(cache), prefix.stats())
    for call in (prefix.match, prefix.reserve):
        with pytest.raises(error, match=shown):
            call(bad)
    with pytest.raises(error, match=shown.replace("tokens", "prompt_tokens", 1)):
        table.add("s", bad)
    assert (counts(cache), prefix.stats()) == before and len(table) == 0
