"""Elastic caches on HostBackend: reserved pools mapped in steps, lowest block first,
shrink/reserve, exhaustion that changes nothing, two caches sharing one capped device."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.backends.capabilities import BackendFeatureMissing
from pagedkv.core.elastic_allocator import ElasticBlockAllocator, StepFreeLists
from pagedkv.errors import DeviceMemoryError, DeviceOutOfMemory, KvCacheError, KvCacheExhausted, RefCountError

G = 4096
BLOCK = 512  # bytes of one block side below: 16 tokens x 1 head x 16 dims x 2 bytes


def config(layers: int = 2) -> KvCacheConfig:
    return KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=16, num_layers=layers, dtype="bf16")


def host(capacity: int = 1 << 20) -> HostBackend:
    return HostBackend(capacity_bytes=capacity, vmm_granularity=G)


def state(cache: PagedKvCache, gpu: HostBackend) -> tuple:
    counts = tuple(cache.ref_count(b) for b in range(cache.num_blocks()))
    return cache.resident_blocks(), cache.num_free_blocks(), gpu.live_bytes(), counts


# -- HostBackend's virtual memory ------------------------------------------------------


def test_host_reserved_range_is_inaccessible_until_mapped():
    gpu = host()
    base = gpu.reserve_address(4 * G)
    assert gpu.supports("vmm") and not gpu.supports("pinned") and gpu.vmm_granularity() == G
    assert base % G == 0 and gpu.live_bytes() == 0 and gpu.live_allocations() == 1
    with pytest.raises(DeviceMemoryError, match=r"unmapped chunk at offset 0 of the reservation"):
        gpu.copy_h2d(b"x", base)
    gpu.map_chunk(base.offset(G), 2 * G)
    assert gpu.live_bytes() == 2 * G and gpu.mem_info() == ((1 << 20) - 2 * G, 1 << 20)
    gpu.copy_h2d(np.full(2 * G, 3, np.uint8), base.offset(G))
    out = np.empty(2 * G, np.uint8)
    gpu.copy_d2h(base.offset(G), out)
    assert (out == 3).all()
    with pytest.raises(DeviceMemoryError, match=rf"unmapped chunk at offset {3 * G} "):
        gpu.copy_d2h(base.offset(2 * G), np.empty(G + 1, np.uint8))  # one byte into granule 3
    gpu.unmap_chunk(base.offset(G), 2 * G)
    assert gpu.live_bytes() == 0
    with pytest.raises(DeviceMemoryError, match=rf"unmapped chunk at offset {G} "):
        gpu.copy_d2h(base.offset(G), out)
    gpu.map_chunk(base.offset(G), G)  # fresh memory is zeroed, the old bytes are gone
    gpu.copy_d2h(base.offset(G), out[:G])
    assert (out[:G] == 0).all()
    gpu.release_address(base)  # unmaps what is left
    assert gpu.live_bytes() == 0 and gpu.live_allocations() == 0


def test_host_vmm_refuses_bad_chunks_and_changes_nothing():
    gpu = host(capacity=3 * G)
    base = gpu.reserve_address(4 * G)
    gpu.map_chunk(base, G)
    with pytest.raises(ValueError, match="multiples of the 4096-byte granularity"):
        gpu.map_chunk(base.offset(256), G)
    with pytest.raises(ValueError, match="multiples of the 4096-byte granularity"):
        gpu.map_chunk(base.offset(G), 100)
    with pytest.raises(DeviceMemoryError, match="offset 0 is mapped already"):
        gpu.map_chunk(base, 2 * G)
    with pytest.raises(DeviceMemoryError, match="runs past the 16384-byte reservation"):
        gpu.map_chunk(base.offset(3 * G), 2 * G)
    with pytest.raises(DeviceOutOfMemory, match="map_chunk asked 12288 bytes"):
        gpu.map_chunk(base.offset(G), 3 * G)
    with pytest.raises(DeviceMemoryError, match="not a chunk mapped there"):
        gpu.unmap_chunk(base, 2 * G)
    with pytest.raises(DeviceMemoryError, match="not inside a reserved address range"):
        gpu.map_chunk(gpu.alloc(G), G)
    with pytest.raises(ValueError, match="not a multiple of the 4096-byte granularity"):
        gpu.reserve_address(G + 1)
    with pytest.raises(DeviceMemoryError, match="not the start of a live reservation"):
        gpu.release_address(base.offset(G))
    assert gpu.live_bytes() == 2 * G  # the one chunk and the plain allocation
    with pytest.raises(ValueError, match="vmm_granularity must be a multiple of 256"):
        HostBackend(vmm_granularity=1000)


# -- elastic caches ----------------------------------------------------------------------


def test_elastic_cache_maps_a_step_of_every_pool_and_hands_out_lowest_first():
    gpu = host()
    cache = PagedKvCache(config(), 64, gpu, elastic=True)
    assert cache.is_elastic() and cache.resident_blocks() == 0 and gpu.live_bytes() == 0
    assert cache.num_free_blocks() == 64
    base = cache.k_pool_ptr(1)  # addresses are fixed from the start
    assert [cache.alloc_block() for _ in range(3)] == [0, 1, 2]
    assert cache.resident_blocks() == 8 and gpu.live_bytes() == 4 * G  # one granule per pool
    cache.free_block(1)
    cache.free_block(0)
    assert cache.alloc_blocks(3) == [0, 1, 3]  # lowest first, not the last freed
    assert cache.alloc_blocks(6) == [4, 5, 6, 7, 8, 9] and cache.resident_blocks() == 16
    assert cache.num_free_blocks() == 64 - 10
    cache.check_invariants()
    assert cache.k_cache_ptr(1, 9) == base + 9 * BLOCK and cache.k_pool_ptr(1) == base


def test_addresses_regions_and_data_stay_put_across_grow_and_shrink():
    gpu = host()
    cache = PagedKvCache(config(), 64, gpu, elastic=True)
    table = cache.alloc_blocks(2)
    regions = cache.block_regions()
    bases = regions.bases.tolist()
    ptrs = [cache.k_cache_ptr(0, 1), cache.v_cache_ptr(1, 1)]
    data = (np.arange(BLOCK) % 199).astype(np.uint8)
    cache.write_block(1, 1, data, data, gpu)
    burst = cache.alloc_blocks(30)
    cache.fill_blocks(burst, 9, gpu, 0)
    cache.free_blocks(burst)
    assert cache.shrink(gpu) == 3 * 4 * G and cache.resident_blocks() == 8
    assert cache.block_regions() is regions and regions.bases.tolist() == bases
    assert [cache.k_cache_ptr(0, 1), cache.v_cache_ptr(1, 1)] == ptrs
    assert np.array_equal(cache.read_block(1, 1, gpu)[1], data)
    again = cache.alloc_blocks(30)
    assert again == list(range(2, 32))
    cache.init_blocks(again, gpu, 0)  # remapped memory is written through the same table
    assert np.array_equal(cache.read_block(0, 31, gpu)[0], np.zeros(BLOCK, np.uint8))
    cache.free_blocks(again + table)
    cache.release(gpu)
    assert gpu.live_bytes() == 0 and gpu.live_allocations() == 0


def test_shrink_keeps_the_step_of_the_highest_block_in_use():
    gpu = host()
    cache = PagedKvCache(config(), 64, gpu, elastic=True)
    table = cache.alloc_blocks(20)
    assert cache.resident_blocks() == 24
    cache.free_blocks(table[:-1])  # block 19 stays: steps 0..2 (blocks 0..23) stay mapped
    assert cache.shrink(gpu) == 0 and cache.resident_blocks() == 24
    cache.free_block(19)
    assert cache.shrink(gpu) == 3 * 4 * G and cache.resident_blocks() == 0 and gpu.live_bytes() == 0
    assert cache.shrink(gpu) == 0
    cache.check_invariants()


def test_reads_and_writes_of_a_block_that_is_not_resident_are_refused():
    gpu = host()
    cache = PagedKvCache(config(), 64, gpu, elastic=True)
    cache.alloc_block()
    for action in (
        lambda: cache.zero_blocks([8], gpu, 0),
        lambda: cache.read_block(0, 8, gpu),
        lambda: cache.k_cache_ptr(0, 40),
        lambda: cache.read_tokens(0, [8 * 16], gpu),
    ):
        with pytest.raises(IndexError, match=r"block \d+ is not resident: the elastic pools back blocks \[0, 8\)"):
            action()
    with pytest.raises(IndexError, match="block 64 out of range"):
        cache.zero_blocks([64], gpu, 0)


def test_exhaustion_when_the_device_cannot_map_changes_nothing():
    gpu = host(capacity=4 * G + 2 * G)  # one step of 4 granules, then room for only 2
    cache = PagedKvCache(config(), 64, gpu, elastic=True)
    table = cache.alloc_blocks(8)
    before = state(cache, gpu)
    with pytest.raises(KvCacheExhausted, match=r"0 resident block\(s\) are free, 8 of 64 resident; the device could not map more"):
        cache.alloc_block()  # two of the four pools' granules map, then the third fails
    assert state(cache, gpu) == before
    with pytest.raises(KvCacheExhausted):
        cache.alloc_blocks(3)
    assert cache.try_alloc_block() is None
    with pytest.raises(KvCacheExhausted):
        cache.reserve(1, gpu)
    assert state(cache, gpu) == before
    cache.check_invariants()
    cache.free_block(table[-1])
    assert cache.alloc_block() == 7  # what is resident still allocates


def test_ceiling_exhaustion_and_reserve():
    gpu = host()
    cache = PagedKvCache(config(), 20, gpu, elastic=True)  # pools of 20 blocks: 3 granules each
    assert cache.reserve(10, gpu) == 2 * 4 * G and cache.resident_blocks() == 16
    assert cache.reserve(16, gpu) == 0
    assert cache.reserve(17, gpu) == 4 * G and cache.resident_blocks() == 20  # capped at the ceiling
    cache.alloc_blocks(20)
    before = state(cache, gpu)
    with pytest.raises(KvCacheExhausted, match=r"asked for 1 block\(s\) but 0 resident block\(s\) are free, 20 of 20"):
        cache.alloc_block()
    with pytest.raises(KvCacheExhausted):
        cache.reserve(1, gpu)
    assert state(cache, gpu) == before
    with pytest.raises(ValueError):
        cache.reserve(-1, gpu)
    with pytest.raises(KvCacheError, match="release with HostBackend"):
        cache.shrink(host())


def test_mapping_is_preferred_to_eviction_and_eviction_follows_a_full_device(held_set):
    gpu = host(capacity=4 * G)  # exactly one step
    cache = PagedKvCache(config(), 64, gpu, elastic=True)

    class Evicting(type(held_set)):
        def reclaim(self, n):
            victims = sorted(self.held)[:n]
            if len(victims) < n:
                return False
            for block in victims:
                cache.return_evicted_block(block)
                self.held.discard(block)
            return True

    evicting = Evicting()
    cache.attach_prefix_cache(evicting)
    table = cache.alloc_blocks(8)
    cache.inc_refs(table[:2])
    evicting.held.update(table[:2])  # the prefix cache keeps blocks 0 and 1 with its own reference
    cache.free_blocks(table[:2])
    assert cache.ref_count(0) == 1
    assert sorted(cache.alloc_blocks(2)) == [0, 1] and evicting.delivered == 1  # evicted: the device is full
    before = state(cache, gpu)
    with pytest.raises(KvCacheExhausted, match="the prefix cache cannot evict enough; the device could not map more"):
        cache.alloc_block()
    assert state(cache, gpu) == before and evicting.delivered == 2


def test_a_failed_eviction_gives_back_what_the_call_mapped(held_set):
    gpu = host()
    cache = PagedKvCache(config(), 16, gpu, elastic=True)
    cache.attach_prefix_cache(held_set)  # evicts nothing
    cache.alloc_blocks(4)
    before = state(cache, gpu)
    with pytest.raises(KvCacheExhausted):
        cache.alloc_blocks(13)  # the ceiling has 12 more: step 1 maps, then eviction fails
    assert state(cache, gpu) == before and held_set.delivered == 1


def test_two_caches_share_a_capped_device():
    gpu = host(capacity=4 * 4 * G)  # four steps of one cache in all
    a = PagedKvCache(config(), 64, gpu, elastic=True)
    b = PagedKvCache(config(), 64, gpu, elastic=True)
    burst = a.alloc_blocks(24)
    b.alloc_blocks(8)
    with pytest.raises(KvCacheExhausted, match="the device could not map more"):
        b.alloc_block()
    a.free_blocks(burst[8:])
    assert a.shrink(gpu) == 2 * 4 * G
    assert b.alloc_blocks(16) == list(range(8, 24)) and b.resident_blocks() == 24
    assert gpu.live_bytes() == 4 * 4 * G
    a.release(gpu)
    b.release(gpu)
    assert gpu.live_bytes() == 0 and gpu.live_allocations() == 0


def test_elastic_needs_a_backend_with_vmm():
    class NoVirtualMemory(HostBackend):
        def supports(self, name):
            return False

    gpu = NoVirtualMemory(capacity_bytes=1 << 20)
    with pytest.raises(BackendFeatureMissing, match=r"elastic pools needs a backend that supports 'vmm' .*; NoVirtualMemory does not"):
        PagedKvCache(config(), 8, gpu, elastic=True)
    assert gpu.live_allocations() == 0
    with pytest.raises(TypeError, match="elastic must be True or False, got 1"):
        PagedKvCache(config(), 8, host(), elastic=1)


def test_the_default_cache_is_not_elastic_and_keeps_its_stack_order():
    gpu = host()
    cache = PagedKvCache(config(), 16, gpu)
    assert not cache.is_elastic() and cache.resident_blocks() == 16
    assert type(cache.allocator()) is not ElasticBlockAllocator
    assert gpu.live_bytes() == 16 * 4 * BLOCK
    a, b = cache.alloc_blocks(2)
    cache.free_block(a)
    cache.free_block(b)
    assert cache.alloc_block() == b  # the last freed first (a stack)
    assert cache.shrink(gpu) == 0 and cache.reserve(15, gpu) == 0
    with pytest.raises(KvCacheExhausted, match="reserve of 16 block"):
        cache.reserve(16, gpu)


def test_release_of_a_failed_construction_frees_every_reservation():
    class FailingRegions(HostBackend):
        def create_block_regions(self, rows):
            raise RuntimeError("no table")

    gpu = FailingRegions(capacity_bytes=1 << 20, vmm_granularity=G)
    with pytest.raises(RuntimeError, match="no table"):
        PagedKvCache(config(), 64, gpu, elastic=True)
    assert gpu.live_allocations() == 0


def test_step_free_lists_give_the_lowest_step_first():
    free = StepFreeLists(4, 12)
    free.add_range(0, 10)  # steps [0..3], [4..7], [8, 9]
    assert free.take(5) == [0, 1, 2, 3, 4] and len(free) == 5 and free.lowest == 1
    free.append(4)
    free.extend([3, 1])  # step 0 again: the mark moves down, lower ids first
    assert [free.pop_lowest() for _ in range(4)] == [1, 3, 4, 5]
    free.drop_from(9)
    assert sorted(free) == [6, 7, 8]
    assert [free.pop_lowest() for _ in range(4)] == [6, 7, 8, None]
    free.add_range(9, 12)  # the rest of step 2 joins its bucket
    assert [free.pop_lowest() for _ in range(3)] == [9, 10, 11]
    spread = StepFreeLists(4, 20)
    spread.extend([13, 2, 9, 8, 1, 0, 17, 12])
    assert spread.buckets == [[2, 1, 0], [], [9, 8], [13, 12], [17]] and spread.lowest == 0


def test_random_operations_keep_the_invariants_and_the_lowest_first_rule():
    rng = random.Random(13)
    gpu = host(capacity=4 * 5 * G)  # 5 of the 8 steps a 64-block cache could map
    cache = PagedKvCache(config(), 64, gpu, elastic=True)
    held: list[int] = []
    exhausted = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.6:
            n = rng.randint(1, 6)
            free_resident = sorted(set(range(cache.resident_blocks())) - set(held))
            before = state(cache, gpu)
            try:
                got = cache.alloc_blocks(n)
            except KvCacheExhausted:
                exhausted += 1
                steps_short = -(-(n - len(free_resident)) // 8)
                assert (cache.resident_blocks() // 8 + steps_short) * 4 * G > gpu.mem_info()[1]
                assert state(cache, gpu) == before
                continue
            left = set(free_resident) - set(got)
            if left:  # nothing came from a step above one that still has a free block
                assert max(b // 8 for b in got if b in set(free_resident)) <= min(b // 8 for b in left)
            held += got
        elif op < 0.85 and held:
            rng.shuffle(held)
            k = rng.randint(1, max(1, len(held) // 3))
            cache.free_blocks(held[:k])
            held = held[k:]
        elif op < 0.95:
            top = max(held, default=-1) + 1
            cache.shrink(gpu)
            assert cache.resident_blocks() == -(-top // 8) * 8
        else:
            try:
                cache.reserve(rng.randint(0, 20), gpu)
            except KvCacheExhausted:
                pass
        cache.check_invariants({b: 1 for b in held})
        assert gpu.live_bytes() == cache.mapped_bytes() == cache.resident_blocks() // 8 * 4 * G
    assert exhausted > 10, exhausted  # the device cap was reached, not only the ceiling


def test_check_invariants_sees_a_broken_heap_and_an_unbacked_reference():
    gpu = host()
    cache = PagedKvCache(config(), 64, gpu, elastic=True)
    cache.alloc_block()
    allocator = cache.allocator()
    free = allocator._free
    free.buckets[0][0] = 12
    with pytest.raises(RefCountError, match="free block 12 is in the bucket of step 0"):
        cache.check_invariants()
    free.buckets[0][0] = 7
    free.lowest = 1
    with pytest.raises(RefCountError, match="bucket 0 holds free blocks below the lowest mark 1"):
        cache.check_invariants()
    free.lowest = 0
    allocator._refs[30] = 1
    with pytest.raises(RefCountError, match="unbacked block 30 has count 1"):
        cache.check_invariants()


def test_readme_elastic_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = [block for block in re.findall(r"```py\n(.*?)```", readme, flags=re.S) if "elastic=True" in block]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["cache"].num_blocks() == 0 and namespace["gpu"].live_allocations() == 0


def test_host_views_of_an_elastic_pool_need_it_resident():
    gpu = host()
    cfg = KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=32, num_layers=1, dtype="nvfp4")
    cache = PagedKvCache(cfg, 64, gpu, elastic=True)
    block = cache.alloc_block()
    with pytest.raises(DeviceMemoryError, match="touches the unmapped chunk at offset 4096"):
        np.from_dlpack(cache.k_view(0, gpu))
    cache.reserve(63, gpu)
    pool = np.from_dlpack(cache.k_view(0, gpu))
    assert pool.shape == (64, cache.k_block_stride_bytes_for_layer(0))
    pool[block, :4] = [1, 2, 3, 4]  # zero-copy: the write lands in the pool
    assert cache.read_block(0, block, gpu)[0][:4].tolist() == [1, 2, 3, 4]


def test_elastic_cache_on_every_backend(gpu):
    """The same elastic cache on HostBackend and (cuda marker) CudaBackend, at the backend's
    own granularity: a step maps every pool, kernels and copies work on mapped blocks, and
    shrink gives back exactly what mem_info sees."""
    cfg = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=128, num_layers=2, dtype="bf16")
    if not gpu.supports("vmm"):  # TorchArenaBackend: refused before anything is touched
        before = gpu.mem_info()
        with pytest.raises(BackendFeatureMissing, match=f"supports 'vmm' .*; {type(gpu).__name__} does not"):
            PagedKvCache(cfg, 8, gpu, elastic=True)
        assert gpu.mem_info() == before
        return
    granularity = gpu.vmm_granularity()
    step = max(1, granularity // cfg.k_block_bytes_for_layer(0))
    cache = PagedKvCache(cfg, 4 * step, gpu, elastic=True)
    table = cache.alloc_blocks(3)
    assert table == [0, 1, 2] and cache.resident_blocks() == step
    assert cache.mapped_bytes() == 4 * -(-step * cfg.k_block_bytes_for_layer(0) // granularity) * granularity
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, cfg.k_block_bytes_for_layer(1), dtype=np.uint8)
    cache.write_block(1, 1, data, data[::-1].copy(), gpu)
    cache.copy_blocks([(1, 2)], gpu, 0)
    burst = cache.alloc_blocks(2 * step)
    cache.fill_blocks(burst, 0x3C, gpu, 0)
    gpu.synchronize(0)
    k, v = cache.read_block(1, 2, gpu)
    assert np.array_equal(k, data) and np.array_equal(v, data[::-1])
    assert (cache.read_block(0, burst[-1], gpu)[1] == 0x3C).all()
    cache.free_blocks(burst)
    free_before = gpu.mem_info()[0]
    returned = cache.shrink(gpu)
    assert returned == 2 * cache.mapped_bytes() and cache.resident_blocks() == step
    assert gpu.mem_info()[0] - free_before == returned
    assert np.array_equal(cache.read_block(1, 2, gpu)[0], data)
    cache.free_blocks(table)
    cache.release(gpu)


def test_elastic_bench_section_prints_every_figure(capsys):
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
    try:
        import bench

        assert bench.main(["--section", "elastic", "--quick"]) == 0
    finally:
        sys.path.pop(0)
    out = capsys.readouterr().out
    for line in (
        "backend: HostBackend, granularity 2048 KiB",
        "map_chunk ",
        "unmap_chunk ",
        "alloc_block+free_block  non-elastic",
        "ceiling elastic vs non-elastic alloc+free pair (resident)",
        "ceiling elastic vs non-elastic alloc_blocks(64)+free_blocks (resident)",
        "burst of 480 blocks over 32 kept (256 KiB a block in all layers, 64 blocks a mapping step)",
        "shrink returned 112.0 MiB in",
        "(112.0 MiB by mem_info; the burst mapped 112.0 MiB)",
    ):
        assert line in out, line


def test_a_reservation_the_host_cannot_back_is_out_of_memory_and_reserves_nothing():
    gpu = HostBackend(capacity_bytes=1 << 24, vmm_granularity=G)
    for nbytes in (2**50, 2**62):  # address space no host can give one array
        with pytest.raises(DeviceOutOfMemory, match=f"cannot reserve {nbytes} bytes of address space"):
            gpu.reserve_address(nbytes)
    wide = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=512, num_layers=1, dtype="bf16")  # 128 KiB blocks
    with pytest.raises(DeviceOutOfMemory, match="cannot reserve"):  # 256 TiB: past any x86-64 address space
        PagedKvCache(wide, 2**31 - 1, gpu, elastic=True)
    assert gpu.live_allocations() == 0 and gpu.live_bytes() == 0


def test_checksums_refuse_a_block_the_elastic_pools_do_not_back_before_any_event():
    """The checksum kernels read the pools directly: a block inside the reservation but not
    mapped would fault a GPU, so both diagnostics refuse it, naming it, with nothing logged;
    resident blocks are checksummed as on a whole cache."""
    from structlog.testing import capture_logs

    gpu = host()
    cache = PagedKvCache(config(), 64, gpu, elastic=True)
    held = cache.alloc_blocks(2)
    assert cache.resident_blocks() == 8
    with capture_logs() as logs:
        with pytest.raises(IndexError, match="block 40 is not resident"):
            cache.debug_kv_checksum_per_layer([0, 40], 1, gpu, 0, "t")
        with pytest.raises(IndexError, match="block 40 is not resident"):
            cache.debug_kv_per_block(0, [1, 40], gpu, 0, "t")
    assert logs == []
    cache.init_blocks(held, gpu, 0)
    with capture_logs() as logs:
        cache.debug_kv_per_block(0, [7, 1], gpu, 0, "t")
    assert [(e["phys"], e["k_ssq"]) for e in logs] == [(7, 0.0), (1, 0.0)]
    cache.free_blocks(held)
    cache.release(gpu)
