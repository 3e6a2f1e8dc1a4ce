"""METRALE_KV_TRACE is a debug flag: it must never change behaviour. The same seeded mix of
allocations, shared references and frees hands out the same blocks, in the same order,
with the trace on and off, on the plain and the elastic allocator (issue 21, item 4: the
elastic free list took the traced path's per-block pushes, `free_blocks([0, 2, 1])` then
`alloc_blocks(3)` gave [0, 2, 1] traced and [0, 1, 2] untraced)."""

from __future__ import annotations

import random

import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache

CONFIG = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")  # 128-byte sides


def _journal(env_flags, trace: str, elastic: bool, seed: int) -> list:
    env_flags(METRALE_KV_TRACE=trace)
    gpu = HostBackend(1 << 24, vmm_granularity=512)  # 4 blocks a mapping step
    cache = PagedKvCache(CONFIG, 48, gpu, elastic=elastic)
    assert (cache.allocator()._tracer is not None) == (trace == "1")
    rng = random.Random(seed)
    held: list[int] = []
    journal = []
    for _ in range(300):
        op = rng.random()
        if op < 0.4 and cache.num_free_blocks():
            got = cache.alloc_blocks(rng.randint(1, min(6, cache.num_free_blocks())))
            held += got
            journal.append(("alloc", got))
        elif op < 0.5 and held:
            shared = rng.sample(held, min(len(held), 2))
            cache.inc_refs(shared)
            held += shared
        elif op < 0.9 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            table, held = held[:k], held[k:]
            cache.free_blocks(table)
        elif held:
            cache.free_block(held.pop())
    journal.append(("resident", cache.resident_blocks(), cache.num_free_blocks()))
    cache.free_blocks(held)
    cache.release(gpu)
    return journal


def test_the_issue_example_gives_one_order_with_and_without_the_trace(env_flags):
    for elastic in (False, True):
        orders = []
        for trace in ("0", "1"):
            env_flags(METRALE_KV_TRACE=trace)
            gpu = HostBackend(1 << 24, vmm_granularity=4096)
            cache = PagedKvCache(CONFIG, 64, gpu, elastic=elastic)
            assert cache.alloc_blocks(3) == [0, 1, 2]
            cache.free_blocks([0, 2, 1])
            orders.append(cache.alloc_blocks(3))
        assert orders[0] == orders[1], (elastic, orders)
        assert orders[0] == ([0, 1, 2] if elastic else [0, 2, 1])  # elastic: lowest first within a step


@pytest.mark.parametrize("elastic", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_random_mix_allocates_the_same_with_the_trace_on(env_flags, elastic, seed):
    assert _journal(env_flags, "0", elastic, seed) == _journal(env_flags, "1", elastic, seed)
