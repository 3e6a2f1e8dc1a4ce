"""An adapter_id enters at SequenceTable.add, PrefixCache.match / reserve / insert and their
hybrid twins: each refuses one that is not an int in [0, 2**64) with a ValueError naming it,
and nothing changes (counts, sequences, cached blocks)."""

from __future__ import annotations

import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup

BS = 4
BAD = [2**64, 2**64 + 5, -1, 1.5, "3", None]


def plain():
    cache = PagedKvCache(KvCacheConfig(BS, 1, 16, 2, "bf16"), 8, HostBackend())
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix)
    table.add("base", list(range(9)), adapter_id=2**64 - 1)  # the largest id is accepted
    return cache, prefix, table


def hybrid():
    config = KvCacheConfig(BS, 1, 16, 2, "bf16", layer_groups=(
        LayerGroup("full", (0,)), LayerGroup("sliding", (1,), window=8)))
    cache = PagedKvCache(config, [16, 16], HostBackend())
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix)
    table.add("base", list(range(9)), adapter_id=2**64 - 1)
    return cache, prefix, table


def snapshot(cache, prefix, table):
    if cache.config().layer_groups:
        counts = [[cache.group(g).ref_count(b) for b in range(16)] for g in range(2)]
        cached = [prefix.num_cached(g) for g in range(2)]
    else:
        counts = [cache.ref_count(b) for b in range(cache.num_blocks())]
        cached = prefix.num_cached_blocks()
    return counts, cached, sorted(table.seq_ids())


CALLS = {
    "table.add": lambda c, p, t, a: t.add("x", list(range(9)), adapter_id=a),
    "prefix.match": lambda c, p, t, a: p.match(list(range(9)), adapter_id=a),
    "prefix.reserve": lambda c, p, t, a: p.reserve(list(range(9)), adapter_id=a),
    "prefix.insert": lambda c, p, t, a: p.insert(list(range(8)), t.blocks("base")[:2], adapter_id=a),
}
HYBRID_CALLS = {
    "hybrid table.add": lambda c, p, t, a: t.add("x", list(range(9)), adapter_id=a),
    "hybrid prefix.match": lambda c, p, t, a: p.match(list(range(9)), adapter_id=a),
    "hybrid prefix.store": lambda c, p, t, a: p.store(list(range(8)), a, {0: [(4, t.blocks("base", 0)[0])]}),
}


@pytest.mark.parametrize("bad", BAD, ids=repr)
@pytest.mark.parametrize("call", [*CALLS, *HYBRID_CALLS])
def test_a_bad_adapter_id_is_refused_naming_it_and_nothing_changes(call, bad):
    world = hybrid() if call in HYBRID_CALLS else plain()
    before = snapshot(*world)
    with pytest.raises(ValueError, match="adapter_id must be") as info:
        {**CALLS, **HYBRID_CALLS}[call](*world, bad)
    assert repr(bad) in str(info.value)
    assert snapshot(*world) == before


def test_the_largest_adapter_id_round_trips_through_free_and_match():
    cache, prefix, table = plain()
    table.free("base")  # offers its two full blocks under adapter 2**64 - 1
    assert [cache.ref_count(b) for b in range(8)] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert prefix.match(list(range(9)), adapter_id=2**64 - 1).blocks == [0, 1]
    assert prefix.match(list(range(9)), adapter_id=0).blocks == []
