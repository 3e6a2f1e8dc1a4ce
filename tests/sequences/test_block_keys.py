"""Block keys beyond the tokens: cache salts (namespaces) and extra keys over token ranges,
through `PrefixCache.match` / `insert` and `SequenceTable.add` / `cache_prefix`."""

from __future__ import annotations

import pytest
from shared_helpers import hits, keyed_table_world

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.sequences.hashing import root_hash

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks + 1


@pytest.fixture
def world():
    yield from keyed_table_world(BS)




def test_a_salt_is_a_namespace(world):
    cache, prefix, table = world
    table.add("a", PROMPT, cache_salt="tenant-a")
    table.free("a")
    assert hits(prefix, cache, PROMPT, cache_salt="tenant-a") == 12
    assert hits(prefix, cache, PROMPT) == 0
    assert hits(prefix, cache, PROMPT, cache_salt="tenant-b") == 0
    assert hits(prefix, cache, PROMPT, cache_salt=b"tenant-a") == 0  # bytes and str salts never meet
    assert table.add("b", PROMPT, cache_salt="tenant-b") == 0
    assert table.add("c", PROMPT, cache_salt="tenant-a") == 12


def test_extra_keys_apply_to_every_block_they_cover_even_partly(world):
    cache, prefix, table = world
    image = [(5, 2, "sha256:abcd")]  # positions 5 and 6: block 1 only
    table.add("a", PROMPT, extra_keys=image)
    table.free("a")
    assert hits(prefix, cache, PROMPT, extra_keys=image) == 12
    assert hits(prefix, cache, PROMPT) == 4  # block 0 is not covered: shared; block 1 on is keyed
    assert hits(prefix, cache, PROMPT, extra_keys=[(5, 2, "sha256:ffff")]) == 4
    assert hits(prefix, cache, PROMPT, extra_keys=[(7, 1, "sha256:abcd")]) == 12  # the same blocks, the same key
    assert hits(prefix, cache, PROMPT, extra_keys=[(3, 1, "sha256:abcd")]) == 0  # now block 0 carries it
    lora = [(0, len(PROMPT), "lora:sql-adapter")]
    table.add("b", PROMPT, extra_keys=lora)
    table.cache_prefix("b")
    assert hits(prefix, cache, PROMPT, extra_keys=lora) == 12
    assert hits(prefix, cache, PROMPT, extra_keys=[(0, 13, "lora:other")]) == 0


def test_insert_and_match_agree_on_keys_and_chains_differ(world):
    cache, prefix, table = world
    blocks = cache.alloc_blocks(3)
    assert prefix.insert(PROMPT[:12], blocks, cache_salt=b"\x00ns", extra_keys=[(8, 4, 7)]) == 3
    again = cache.alloc_blocks(3)
    assert prefix.insert(PROMPT[:12], again) == 3  # the same tokens unkeyed: other blocks
    assert hits(prefix, cache, PROMPT, cache_salt=b"\x00ns", extra_keys=[(8, 4, 7)]) == 12
    assert hits(prefix, cache, PROMPT, cache_salt=b"\x00ns", extra_keys=[(8, 4, "7")]) == 8  # int 7 is not "7"
    assert len({prefix.block_hash(b) for b in blocks + again}) == 6
    cache.free_blocks(blocks + again)
    prefix.check_invariants()


@pytest.mark.parametrize(
    "kw, error, words",
    [
        ({"cache_salt": ""}, TypeError, "cache_salt must be a non-empty str or bytes"),
        ({"cache_salt": 5}, TypeError, "cache_salt must be a non-empty str or bytes, got int 5"),
        ({"extra_keys": [(0, 0, "x")]}, ValueError, r"extra_keys\[0\] length must be >= 1"),
        ({"extra_keys": [(0, 1, "x"), (-1, 2, "y")]}, ValueError, r"extra_keys\[1\] offset"),
        ({"extra_keys": [(0, 1)]}, ValueError, r"extra_keys\[0\] must be \(offset, length, key\)"),
        ({"extra_keys": [(0, 1, 1.5)]}, TypeError, r"extra_keys\[0\] key must be a str, bytes or an int"),
        ({"extra_keys": "abc"}, TypeError, "extra_keys must be an iterable"),
    ],
)
def test_bad_keys_raise_naming_them_and_change_nothing(world, kw, error, words):
    cache, prefix, table = world
    free = cache.num_free_blocks()
    with pytest.raises(error, match=words):
        table.add("a", PROMPT, **kw)
    with pytest.raises(error, match=words):
        prefix.match(PROMPT, **kw)
    assert "a" not in table and cache.num_free_blocks() == free


def test_unkeyed_hashes_are_unchanged(world):
    cache, prefix, table = world
    table.add("a", PROMPT)
    table.free("a")
    found = prefix.match(PROMPT)
    from pagedkv.sequences.hashing import chain_hash

    h = root_hash(0)
    for i, block in enumerate(found.blocks):
        h = chain_hash(h, PROMPT[i * BS : (i + 1) * BS])
        assert prefix.block_hash(block) == h
    cache.free_blocks(found.blocks)


def test_keyed_chains_demote_to_the_host_tier_and_come_back_under_their_keys():
    from pagedkv.host_tier import HostTier

    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 4, gpu)
    tier = HostTier(cache, 8, gpu)
    prefix = PrefixCache(cache, host_tier=tier)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", PROMPT, cache_salt="t1", extra_keys=[(4, 1, "img")])
    table.free("a")
    held = cache.alloc_blocks(4)  # demotes the 3 keyed blocks
    assert prefix.num_host_blocks() == 3
    assert prefix.match(PROMPT, cache_salt="t1", extra_keys=[(4, 1, "img")]).host_num_tokens == 12
    assert prefix.match(PROMPT, cache_salt="t1").host_num_tokens == 4
    assert prefix.match(PROMPT).host_num_tokens == 0
    cache.free_blocks(held)
    assert table.add("b", PROMPT, cache_salt="t1", extra_keys=[(4, 1, "img")]) == 12  # promoted
    table.free("b")
    table.check_invariants()
    prefix.close()
    tier.release(gpu)
    cache.release(gpu)


def test_keyed_chains_stay_off_the_disk_tier_plain_ones_go_there(tmp_path):
    from pagedkv.tiers.disk_tier import DiskTier
    from pagedkv.host_tier import HostTier

    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 4, gpu)
    tier = HostTier(cache, 3, gpu)
    disk = DiskTier(str(tmp_path), 1 << 20)
    prefix = PrefixCache(cache, host_tier=tier, disk_tier=disk)
    table = SequenceTable(cache, prefix, gpu)
    for i, kw in enumerate(({"cache_salt": "t"}, {}, {"extra_keys": [(0, 1, "x")]}, {})):
        table.add(i, [t + 100 * i for t in PROMPT], **kw)
        table.free(i)
        cache.free_blocks(cache.alloc_blocks(4))  # device -> host -> (disk)
    assert prefix.match([t + 100 for t in PROMPT]).disk_num_tokens + prefix.match([t + 100 for t in PROMPT]).host_num_tokens == 12
    assert prefix.match(PROMPT, cache_salt="t").disk_num_tokens == 0
    assert prefix.match([t + 200 for t in PROMPT], extra_keys=[(0, 1, "x")]).disk_num_tokens == 0
    assert prefix.num_disk_blocks() >= 3
    table.check_invariants()
    prefix.close()
    disk.close()
    tier.release(gpu)
    cache.release(gpu)
