"""The hybrid table and prefix cache take the one-group serving keys: a cache salt (no hit
across salts), extra keys on add and append (they change the entries' keys and hashes), and
the "vllm-sha256-cbor" scheme, whose hashes equal a one-group cache's of the group's block
size for the same tokens and keys."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.sequences.hybrid_prefix import GroupBlockStored, HybridPrefixCache

SEED = "42"


def config(sliding_bs=None):
    return KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
        LayerGroup("full", (0,)),
        LayerGroup("sliding", (1,), window=8, block_size=sliding_bs),
        LayerGroup("state", (2,), state=(((4,), "float32"),), checkpoint_every=8),
    ))


def world(sliding_bs=None, **options):
    gpu = HostBackend()
    cache = PagedKvCache(config(sliding_bs), [64, 64, None], gpu, num_state_slots=64)
    events = []
    prefix = PrefixCache(cache, on_event=events.append, **options)
    return gpu, cache, prefix, SequenceTable(cache, prefix, gpu), events


PROMPT = list(range(100, 121)) + [1, 2, 3]  # 24 tokens


def hit(prefix, tokens, **keys) -> int:
    """The match length, its references given back."""
    found = prefix.match(tokens, **keys)
    prefix.release(found)
    return found.num_tokens


def test_no_hit_across_salts():
    _, _, prefix, table, _ = world()
    table.add("a", PROMPT, cache_salt="tenant-1")
    table.free("a")
    assert table.add("b", PROMPT + [9], cache_salt="tenant-2") == 0
    assert table.add("c", PROMPT + [9]) == 0
    assert table.add("d", PROMPT + [9], cache_salt=b"tenant-1") == 0  # bytes and str are not the same salt
    assert table.add("e", PROMPT + [9], cache_salt="tenant-1") == 24
    for s in "bcde":
        table.free(s)
    assert hit(prefix, PROMPT + [9], cache_salt="tenant-1") == 24
    assert hit(prefix, PROMPT + [9], cache_salt="tenant-3") == 0
    with pytest.raises(TypeError, match="cache_salt must be a non-empty str or bytes"):
        table.add("f", PROMPT, cache_salt="")
    assert "f" not in table
    table.check_invariants()


def test_extra_keys_key_the_units_they_cover_and_change_the_hash():
    _, _, prefix, table, events = world()
    table.add("a", PROMPT, extra_keys=[(10, 3, "image-1")])  # covers the units [8, 12) and [12, 16)
    table.free("a")
    stored = {(e.group, e.position): e.block_hash for e in events if isinstance(e, GroupBlockStored)}
    events.clear()
    table.add("b", PROMPT, extra_keys=[(10, 3, "image-2")])
    table.free("b")
    other = {(e.group, e.position): e.block_hash for e in events if isinstance(e, GroupBlockStored)}
    # the full group's blocks before the key hit (not stored again); from 12 on b's are new, other hashes
    assert sorted(pos for g, pos in other if g == 0) == [12, 16, 20, 24]
    assert all(other[0, pos] != stored[0, pos] for pos in (12, 16, 20, 24))
    assert hit(prefix, PROMPT + [9], extra_keys=[(10, 3, "image-1")]) == 24
    assert hit(prefix, PROMPT + [9], extra_keys=[(10, 3, "image-3")]) == 8
    assert hit(prefix, PROMPT + [9]) == 8
    table.check_invariants()


def test_append_extra_keys_like_the_one_group_table():
    _, _, prefix, table, _ = world()
    table.add("a", PROMPT[:16])
    with pytest.raises(ValueError, match=r"extra_keys\[0\] covers tokens \[6, 10\) of the step, which appends 8"):
        table.append("a", token_ids=PROMPT[16:], extra_keys=[(6, 4, "img")])
    assert table.num_tokens("a") == 16
    table.append("a", token_ids=PROMPT[16:], extra_keys=[(2, 1, "img")])  # token 18: the unit [16, 20)
    assert table.num_tokens("a") == 24
    table.free("a")
    assert hit(prefix, PROMPT + [9]) == 16
    assert hit(prefix, PROMPT + [9], extra_keys=[(18, 1, "img")]) == 24
    assert table.add("b", PROMPT + [9], extra_keys=[(18, 1, "img")]) == 24
    table.free("b")
    table.check_invariants()


def one_group_hashes(block_size, tokens, **keys):
    gpu = HostBackend()
    cache = PagedKvCache(KvCacheConfig(block_size, 1, 16, 1, "bf16"), 64, gpu)
    prefix = PrefixCache(cache, hash_scheme="vllm-sha256-cbor", hash_seed=SEED)
    table = SequenceTable(cache, prefix, gpu)
    table.add("x", tokens, **keys)
    table.cache_prefix("x")
    out = {(i + 1) * block_size: prefix.block_hash(b) for i, b in enumerate(table.blocks("x"))
           if (i + 1) * block_size <= len(tokens)}
    table.free("x")
    return out


@pytest.mark.parametrize("keys", [{}, {"cache_salt": "tenant"}, {"extra_keys": [(2, 4, "lora"), (13, 2, "img")]},
                                  {"cache_salt": b"t", "extra_keys": [(0, 24, "lora")]}])
def test_vllm_scheme_hashes_equal_the_one_group_caches(keys):
    _, _, prefix, table, events = world(sliding_bs=2, hash_scheme="vllm-sha256-cbor", hash_seed=SEED)
    assert isinstance(prefix, HybridPrefixCache) and prefix.hash_scheme() == "vllm-sha256-cbor"
    table.add("a", PROMPT, **keys)
    table.cache_prefix("a")
    stored = [e for e in events if isinstance(e, GroupBlockStored)]
    by4, by2 = one_group_hashes(4, PROMPT, **keys), one_group_hashes(2, PROMPT, **keys)
    full = {e.position: e.block_hash for e in stored if e.group == 0}
    assert full == by4 and len(full) == 6 and all(len(h) == 32 for h in full.values())
    assert all(e.parent_block_hash == (by4.get(e.position - 4)) for e in stored if e.group == 0)
    sliding = {e.position: e.block_hash for e in stored if e.group == 1}  # block size 2
    assert sliding and all(sliding[pos] == by2[pos] for pos in sliding)
    states = {e.position: e.block_hash for e in stored if e.group == 2}  # a checkpoint: its last unit's chain
    assert sorted(states) == [8, 16, 24] and all(states[pos] == by2[pos] for pos in states)
    for e in stored:
        assert prefix.block_hash(e.group, e.block_id) == e.block_hash
    table.free("a")


def test_the_default_scheme_keeps_its_hashes_and_bad_schemes_are_refused():
    _, _, prefix, table, events = world()
    table.add("a", PROMPT)
    table.cache_prefix("a")
    assert prefix.hash_scheme() == "pagedkv-blake2b-64"
    hashes = [e.block_hash for e in events if isinstance(e, GroupBlockStored)]
    assert all(type(h) is int for h in hashes)
    gpu = HostBackend()
    cache = PagedKvCache(config(), [8, 8, None], gpu)
    with pytest.raises(ValueError, match="hash_scheme must be one of"):
        PrefixCache(cache, hash_scheme="sha256")
    with pytest.raises(TypeError, match="hash_seed must be a str"):
        PrefixCache(cache, hash_scheme="vllm-sha256-cbor", hash_seed=1)
    with pytest.raises(KeyError, match="not cached"):
        prefix.block_hash(0, 63)
    table.free("a")


def test_events_carry_the_entries_extra_keys_on_the_wire():
    from pagedkv.events.wire import event_fields

    _, _, _, table, events = world()
    table.add("a", PROMPT, cache_salt="t", extra_keys=[(10, 3, "image-1")])
    table.cache_prefix("a")
    full = {e.position: e for e in events if isinstance(e, GroupBlockStored) and e.group == 0}
    assert {pos: e.extra_keys for pos, e in full.items()} == {
        4: ("t",), 8: None, 12: ("image-1",), 16: ("image-1",), 20: None, 24: None}
    fields = event_fields(full[12])
    assert fields[0] == "BlockStored" and fields[8] == (("image-1",),) and fields[9] == 0
    assert event_fields(full[8])[8] is None
    table.free("a")
