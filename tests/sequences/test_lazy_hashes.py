"""Insert packs its tokens once and computes chained hashes only when asked for (events,
`block_hash`): the values are the ones computed eagerly. numpy prompts are checked
vectorised with the same errors."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable, chain_hash, root_hash
from pagedkv.core.validate import token_ids_and_bytes

BS = 4


def make_cache(num_blocks=16):
    config = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=8, num_layers=1, dtype="bf16")
    return PagedKvCache(config, num_blocks, HostBackend(capacity_bytes=1 << 24))


def chain(tokens, adapter_id=0):
    out, parent = [], root_hash(adapter_id)
    for i in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = chain_hash(parent, tokens[i : i + BS])
        out.append(parent)
    return out


def test_hashes_are_computed_when_asked_for_with_the_eager_values():
    cache = make_cache()
    prefix = PrefixCache(cache)
    first = list(range(100, 112))
    blocks = cache.alloc_blocks(3)
    assert prefix.insert(first, blocks) == 3
    assert all(prefix._by_block[b]._hash is None for b in blocks)  # nothing hashed yet
    assert prefix.block_hash(blocks[2]) == chain(first)[2]  # the whole chain on the way
    assert [prefix._by_block[b]._hash for b in blocks] == chain(first)
    second = first[:8] + [7, 7, 7, 7, 9]
    more = cache.alloc_blocks(1)
    assert prefix.insert(second, blocks[:2] + more) == 1
    assert prefix._by_block[more[0]]._hash is None
    assert prefix.block_hash(more[0]) == chain(second)[2]
    prefix.check_invariants()


def test_events_carry_the_same_hashes_and_eviction_without_a_consumer_hashes_nothing():
    events = []
    cache = make_cache(4)
    prefix = PrefixCache(cache, on_event=events.append)
    tokens = list(range(8))
    blocks = cache.alloc_blocks(2)
    prefix.insert(tokens, blocks, adapter_id=3)
    assert events[-1].block_hashes == tuple(chain(tokens, 3))
    quiet_cache = make_cache(4)
    quiet = PrefixCache(quiet_cache)
    held = quiet_cache.alloc_blocks(2)
    quiet.insert(tokens, held)
    nodes = [quiet._by_block[b] for b in held]
    quiet_cache.free_blocks(held)
    assert sorted(quiet.evict(2)) == sorted(held)
    assert [n._hash for n in nodes] == [None, None]  # evicted unhashed: no consumer asked
    assert nodes[1].hash == chain(tokens)[1]  # still computable from its chain


def test_a_numpy_prompt_is_checked_vectorised_with_the_same_result_and_errors():
    ids = np.array([5, 0, 2**63 - 1, 17], dtype=np.int64)
    tokens, data = token_ids_and_bytes(ids)
    assert tokens == [5, 0, 2**63 - 1, 17] and all(type(t) is int for t in tokens)
    assert data == np.array(tokens, dtype="<i8").tobytes()
    assert token_ids_and_bytes(np.array([3, 4], dtype=np.uint16)) == ([3, 4], np.array([3, 4], "<i8").tobytes())
    assert token_ids_and_bytes(np.array([], dtype=np.int32)) == ([], b"")
    with pytest.raises(ValueError, match=r"tokens\[1\] is -3: token ids must lie in \[0, 2\*\*63\)"):
        token_ids_and_bytes(np.array([1, -3, 2]))
    with pytest.raises(ValueError, match=r"tokens\[0\] is 9223372036854775808"):
        token_ids_and_bytes(np.array([2**63], dtype=np.uint64))
    with pytest.raises(TypeError, match="1-D integer array, got dtype bool"):
        token_ids_and_bytes(np.array([True]))
    cache = make_cache()
    table = SequenceTable(cache, PrefixCache(cache))
    table.add("list", list(range(9)))
    table.free("list")
    assert table.add("array", np.arange(9, dtype=np.int32)) == 8  # the same blocks matched
    assert table.blocks("array")[:2] == [0, 1]
