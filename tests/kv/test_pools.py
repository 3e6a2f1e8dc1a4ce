"""KvPools: strides, addresses and the region table, and release on the right backend only,
retrying what failed to free (defect 8, pools part)."""

from __future__ import annotations

import pytest

from pagedkv import DeviceMemoryError, HostBackend, KvCacheConfig, KvCacheError, KvPools, PagedKvCache


def config(**kw):
    return KvCacheConfig(**{"block_size": 4, "num_kv_heads": 2, "head_dim": 16, "num_layers": 2,
                            "dtype": "bf16k_turbo4v", **kw})


class FailsOnce(HostBackend):
    """A HostBackend whose free of each listed address fails the first time only."""

    def __init__(self):
        super().__init__(capacity_bytes=1 << 20)
        self.fail_once: set[int] = set()
        self.frees: list[int] = []

    def free(self, ptr):
        self.frees.append(int(ptr))
        if int(ptr) in self.fail_once:
            self.fail_once.discard(int(ptr))
            raise DeviceMemoryError(f"injected: free of {ptr!r} failed")
        super().free(ptr)


def test_geometry_of_the_pools():
    gpu = HostBackend(capacity_bytes=1 << 20)
    pools = KvPools(config(), 3, gpu)
    # 4 x 2 x 16 = 128 elements: bf16 K 256 bytes, turbo4 V 64 + 8 bytes
    assert [pools.k_stride(l) for l in range(2)] == [256, 256]
    assert [pools.v_stride(l) for l in range(2)] == [72, 72]
    assert gpu.live_allocations() == 4 and gpu.live_bytes() == 2 * 3 * (256 + 72)
    assert pools.k_block_ptr(1, 2) == pools.k_pool(1) + 2 * 256
    assert pools.v_block_ptr(0, 1) == pools.v_pool(0) + 72
    regions = pools.regions()
    assert regions.bases.tolist() == [pools.k_pool(0), pools.v_pool(0), pools.k_pool(1), pools.v_pool(1)]
    assert regions.strides.tolist() == [256, 72, 256, 72]
    assert [pools.region_index(l, s) for l in range(2) for s in "KV"] == [0, 1, 2, 3]
    with pytest.raises(IndexError, match="block 3 out of range for a cache of 3 blocks"):
        pools.k_block_ptr(0, 3)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        pools.v_block_ptr(2, 0)
    pools.release(gpu)
    assert gpu.live_allocations() == 0 and pools.pending() == 0
    with pytest.raises(KvCacheError, match="released"):
        pools.k_block_ptr(0, 0)


def test_aliased_v_is_the_k_pool():
    gpu = HostBackend(capacity_bytes=1 << 20)
    pools = KvPools(config(dtype="turbo8", v_aliases_k=True), 2, gpu)
    assert pools.v_pool(1) == pools.k_pool(1) and pools.v_stride(1) == pools.k_stride(1) == 144
    assert pools.region_index(1, "V") == pools.region_index(1, "K") == 1
    assert gpu.live_allocations() == 2
    pools.release(gpu)
    assert gpu.live_allocations() == 0


@pytest.mark.parametrize("gpu", [None, "host", 0])
def test_a_missing_backend_is_named(gpu):
    shown = {None: "NoneType None", "host": "str 'host'", 0: "int 0"}[gpu]
    with pytest.raises(TypeError, match=f"gpu must be a GpuBackend .HostBackend, CudaBackend., got {shown}"):
        PagedKvCache(config(), 4, gpu)


def test_release_with_the_wrong_backend_forgets_nothing():
    gpu, other = HostBackend(capacity_bytes=1 << 20), HostBackend(capacity_bytes=1 << 20)
    cache = PagedKvCache(config(), 4, gpu)
    blocks = cache.alloc_blocks(2)
    with pytest.raises(KvCacheError, match="release with HostBackend .*: the pools were allocated on HostBackend"):
        cache.release(other)
    # nothing forgotten: the cache still works, its pools are live, then release frees them all
    assert cache.num_blocks() == 4 and cache.ref_count(blocks[0]) == 1
    cache.write_block(0, blocks[0], b"\x01", None, gpu)
    assert cache.read_block(0, blocks[0], gpu)[0][0] == 1
    assert gpu.live_allocations() == 4
    cache.release(gpu)
    assert gpu.live_allocations() == 0 and cache.num_blocks() == 0


def test_a_pool_whose_free_failed_is_retried_by_the_next_release():
    gpu = FailsOnce()
    pools = KvPools(config(), 2, gpu)
    failing = int(pools.v_pool(1))
    gpu.fail_once = {failing}
    with pytest.raises(DeviceMemoryError, match="injected: free of"):
        pools.release(gpu)
    assert gpu.live_allocations() == 1 and pools.pending() == 1
    pools.release(gpu)  # retries only the pool that failed
    assert gpu.frees.count(failing) == 2 and len(gpu.frees) == 5
    assert gpu.live_allocations() == 0 and pools.pending() == 0
    pools.release(gpu)
    assert len(gpu.frees) == 5


def test_the_cache_retries_through_its_own_release():
    gpu = FailsOnce()
    cache = PagedKvCache(config(), 2, gpu)
    gpu.fail_once = {int(cache.k_pool_ptr(0))}
    with pytest.raises(DeviceMemoryError):
        cache.release(gpu)
    assert gpu.live_allocations() == 1
    cache.release(gpu)
    assert gpu.live_allocations() == 0


def test_a_failed_construction_frees_what_it_allocated():
    gpu = HostBackend(capacity_bytes=256 * 4 * 3)  # room for three of the four pools
    with pytest.raises(MemoryError):
        KvPools(config(dtype="bf16"), 4, gpu)
    assert gpu.live_allocations() == 0


class RecordsCalls(HostBackend):
    """A HostBackend that records the order of synchronize_all and free calls."""

    def __init__(self):
        super().__init__(capacity_bytes=1 << 20)
        self.calls: list[str] = []

    def synchronize_all(self):
        self.calls.append("synchronize_all")

    def free(self, ptr):
        self.calls.append("free")
        super().free(ptr)


def test_release_waits_for_every_stream_before_the_first_free():
    gpu = RecordsCalls()
    pools = KvPools(config(), 3, gpu)
    pools.release(gpu)
    assert gpu.calls == ["synchronize_all"] + ["free"] * 4
    pools.release(gpu)  # nothing left: no wait, no free
    assert gpu.calls == ["synchronize_all"] + ["free"] * 4


def test_num_blocks_past_the_int32_bound_is_refused_before_any_allocation():
    gpu = HostBackend(capacity_bytes=1 << 20)
    for n in (2**31, 2**40, 2**63):
        for elastic in (False, True):
            with pytest.raises(ValueError, match=f"num_blocks is {n}, more than 2147483647 .block indices are int32."):
                KvPools(config(), n, gpu, elastic=elastic)
    assert gpu.live_allocations() == 0 and gpu.live_bytes() == 0
