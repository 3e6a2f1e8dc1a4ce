"""Every KV event carries a sequence number (1, 2, 3, ... per prefix cache, no gaps), and
BlockStored carries the blocks' extra keys where vLLM places them (salt on the first)."""

from __future__ import annotations

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.host_tier import HostTier

BS = 4


def test_sequence_numbers_run_without_gaps_over_every_kind_and_tier():
    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 4, gpu)
    tier = HostTier(cache, 2, gpu)
    got = []
    prefix = PrefixCache(cache, on_event=got.append, host_tier=tier)
    table = SequenceTable(cache, prefix, gpu)
    for i in range(4):
        table.add(i, list(range(10 * i, 10 * i + 9)))
        table.free(i)  # each: a BlockStored, and the evictions they cause (GPU removed, CPU stored/removed)
    prefix.clear()
    assert [e.seq for e in got] == list(range(1, len(got) + 1))
    kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in got}
    assert {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "CPU"),
            ("AllBlocksCleared", None)} <= kinds
    prefix.close()
    tier.release(gpu)
    cache.release(gpu)


def test_stored_events_carry_extra_keys_and_the_salt_on_a_prompts_first_block():
    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 8, gpu)
    got = []
    prefix = PrefixCache(cache, on_event=got.append)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(13)), cache_salt="tenant", extra_keys=[(0, 13, "lora:x"), (5, 2, b"\x01img")])
    table.free("a")
    table.add("b", list(range(9)))
    table.free("b")
    keyed, plain = got
    assert keyed.extra_keys == (("lora:x", "tenant"), ("lora:x", b"\x01img"), ("lora:x",))
    assert plain.extra_keys is None and plain.seq == 2
    prefix.close()
    cache.release(gpu)
