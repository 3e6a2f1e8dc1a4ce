"""HostTier: swaps of every layer's K and V in one batched copy, byte-exact over mixed
formats; the checks that refuse a bad swap before anything moves; events; release. The
`gpu` tests rely only on the "host_tier" contract (pagedkv.backends.capabilities)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.backends.capabilities import backend_supports

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache
from pagedkv.backends.capabilities import BackendFeatureMissing
from pagedkv.errors import DeviceOutOfMemory, KvCacheError, KvCacheExhausted, RefCountError
from pagedkv.tiers.host_tier import Event, HostTier, SwapHandle

MIXED = KvCacheConfig(
    block_size=4, num_kv_heads=2, head_dim=32, num_layers=3, dtype="turbo4k3v",
    layer_dtypes=("bf16", "fp8k_turbo4v", "nvfp4"), layer_dims=((2, 32), (1, 64)),
)
ALIASED = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16", v_aliases_k=True)



@pytest.fixture
def gpu(gpu):
    """The conftest backend, skipped (with the reason) where it does not state "host_tier"."""
    if not backend_supports(gpu, "host_tier"):
        pytest.skip(f"{type(gpu).__name__} does not state 'host_tier'")
    return gpu

def _fill(cache: PagedKvCache, blocks, gpu, seed: int) -> dict:
    """Random bytes in every layer side of `blocks`; returns (layer, block) -> (k, v)."""
    rng = np.random.default_rng(seed)
    written = {}
    for layer in range(cache.num_layers()):
        for block in blocks:
            k = rng.integers(0, 256, cache.k_block_stride_bytes_for_layer(layer), dtype=np.uint8)
            v = rng.integers(0, 256, cache.v_block_stride_bytes_for_layer(layer), dtype=np.uint8)
            cache.write_block(layer, block, k, v, gpu)
            written[layer, block] = (k, k.copy() if cache.config().v_aliases_k else v)
    return written


class CountingCopies:
    """Wraps a backend instance's `copy_batch_async`, recording each call's range count."""

    def __init__(self, gpu, monkeypatch):
        self.calls: list[int] = []
        original = gpu.copy_batch_async

        def counted(dsts, srcs, sizes, stream):
            self.calls.append(len(dsts))
            return original(dsts, srcs, sizes, stream)

        monkeypatch.setattr(gpu, "copy_batch_async", counted)


@pytest.fixture
def mixed(gpu):
    cache = PagedKvCache(MIXED, 16, gpu)
    tier = HostTier(cache, 8, gpu)
    yield cache, tier, gpu
    tier.release(gpu)
    cache.release(gpu)


@pytest.mark.parametrize("config", [MIXED, ALIASED], ids=["mixed", "v_aliases_k"])
def test_swap_out_then_in_is_byte_exact_in_every_layer_side(gpu, config):
    cache = PagedKvCache(config, 16, gpu)
    tier = HostTier(cache, 8, gpu)
    try:
        src = cache.alloc_blocks(5)
        written = _fill(cache, src, gpu, seed=3)
        host = tier.alloc(5)
        tier.swap_out(src, host, gpu.default_stream()).wait()
        for layer in range(config.num_layers):
            for block, h in zip(src, host):
                k, v = tier.read_block(layer, h)
                assert np.array_equal(k, written[layer, block][0]) and np.array_equal(v, written[layer, block][1])
        dst = cache.alloc_blocks(5)
        handle = tier.swap_in(host, dst, gpu.default_stream())
        handle.wait()
        gpu.synchronize(gpu.default_stream())
        for layer in range(config.num_layers):
            for block, d in zip(src, dst):
                k, v = cache.read_block(layer, d, gpu)
                assert np.array_equal(k, written[layer, block][0]) and np.array_equal(v, written[layer, block][1])
    finally:
        tier.release(gpu)
        cache.release(gpu)


def test_the_tier_has_the_device_pools_strides(mixed):
    cache, tier, _ = mixed
    strides = [(cache.k_block_stride_bytes_for_layer(i), cache.v_block_stride_bytes_for_layer(i)) for i in range(3)]
    assert strides == [(512, 512), (256, 144), (144, 144)]
    assert tier.block_bytes() == sum(k + v for k, v in strides) == 1712
    k, v = tier.read_block(1, 7)  # contents undefined before a swap (the stub's pinned memory is 0xFF)
    assert (k.size, v.size) == (256, 144)


def test_one_batched_copy_per_swap_however_many_blocks_and_layers(mixed, monkeypatch):
    cache, tier, gpu = mixed
    copies = CountingCopies(gpu, monkeypatch)
    device = cache.alloc_blocks(7)  # 0..6
    _fill(cache, device, gpu, seed=1)
    host = tier.alloc(7)  # 0..6
    tier.swap_out(device, host, 0).wait()
    assert copies.calls == [6]  # one run of 7 blocks x 6 rows
    back = cache.alloc_blocks(7)  # 7..13
    tier.swap_in(host[::-1], back, 0).wait()  # reversed: every pair is its own run
    assert copies.calls == [6, 42]
    tier.swap_out([], [], 0).wait()
    assert copies.calls == [6, 42]  # nothing to move, no call


def test_descriptors_merge_runs_contiguous_on_both_sides(mixed):
    cache, tier, _ = mixed
    dev, host, sizes = tier.descriptors([9, 4, 5, 11], [2, 0, 1, 4])
    k0 = int(cache.k_pool_ptr(0))
    h0 = int(tier._memories[0].address)
    # row 0 (layer 0 K, stride 512): runs [4, 5] -> [0, 1], [9] -> [2], [11] -> [4]
    assert dev[:3].tolist() == [k0 + 4 * 512, k0 + 9 * 512, k0 + 11 * 512]
    assert host[:3].tolist() == [h0, h0 + 2 * 512, h0 + 4 * 512]
    assert sizes.tolist() == [1024, 512, 512] * 2 + [512, 256, 256] + [288, 144, 144] * 3
    assert dev.size == host.size == 18


def test_a_swap_waits_for_what_after_names(mixed, monkeypatch):
    cache, tier, gpu = mixed
    calls = []
    original = gpu.stream_wait_event
    monkeypatch.setattr(gpu, "stream_wait_event", lambda s, e: (calls.append(s), original(s, e))[1])
    device = cache.alloc_blocks(2)
    host = tier.alloc(2)
    producer = gpu.create_stream()
    try:
        first = tier.swap_out(device, host, 0, after=producer)
        assert calls == [0]
        event = gpu.record_event(producer)
        tier.swap_in(host, cache.alloc_blocks(2), 0, after=Event(event)).wait()
        gpu.destroy_event(event)
        assert calls == [0, 0]
        tier.swap_in(host, cache.alloc_blocks(2), 0, after=0).wait()  # the same stream: in order already
        assert calls == [0, 0]
        first.wait()
        tier.swap_in(host, cache.alloc_blocks(2), 0, after=first).wait()  # done: nothing to wait for
        assert calls == [0, 0]
    finally:
        gpu.synchronize_all()
        gpu.destroy_stream(producer)


def test_a_handle_destroys_its_event_once(host):
    cache = PagedKvCache(MIXED, 8, host)
    tier = HostTier(cache, 4, host)
    handle = tier.swap_out(cache.alloc_blocks(1), tier.alloc(1), 0)
    assert isinstance(handle, SwapHandle) and handle.blocks == 1 and host.live_events() == 1
    assert handle.done() and host.live_events() == 0
    handle.wait()
    assert handle.done() and handle.event() is None and host.live_events() == 0
    tier.release(host)
    cache.release(host)


@pytest.mark.parametrize("call, error, named", [
    (lambda t, c: t.swap_out([0, 1], [0], 0), ValueError, "as many device as host blocks, got 2 and 1"),
    (lambda t, c: t.swap_out([16], [0], 0), IndexError, "block 16 out of range for a cache of 16 blocks"),
    (lambda t, c: t.swap_out([0], [8], 0), IndexError, "swap_out: host block 8 out of range"),
    (lambda t, c: t.swap_out([0, 1], [0, 0], 0), ValueError, "host destinations repeat block 0"),
    (lambda t, c: t.swap_out([5], [0], 0), RefCountError, "swap_out of free device block 5"),
    (lambda t, c: t.swap_out([0], [3], 0), RefCountError, "swap_out into free host block 3"),
    (lambda t, c: t.swap_out([0], [1], 0), KvCacheError, "host block 1, which holds cached KV"),
    (lambda t, c: t.swap_in([0, 0], [0, 0], 0), ValueError, "device destinations repeat block 0"),
    (lambda t, c: t.swap_in([0], [5], 0), RefCountError, "write into free block 5"),
    (lambda t, c: t.swap_in([0], [2], 0), KvCacheError, "block 2, which the prefix cache holds"),
    (lambda t, c: t.swap_in([3], [0], 0), RefCountError, "swap_in from free host block 3"),
    (lambda t, c: t.swap_in([-1], [0], 0), IndexError, "host block -1 out of range"),
])
def test_a_bad_swap_is_refused_naming_the_value_before_anything_moves(host, monkeypatch, call, error, named):
    cache = PagedKvCache(MIXED, 16, host)
    prefix = PrefixCache(cache)
    tier = HostTier(cache, 8, host)
    blocks = cache.alloc_blocks(3)  # 0, 1, 2
    prefix.insert([1, 2, 3, 4], [2])  # block 2 is cached: read-only
    written = _fill(cache, blocks[:2], host, seed=5)
    tier.alloc(3)  # host 0, 1, 2
    tier.touch([1])  # host 1 holds cached KV
    copies = CountingCopies(host, monkeypatch)
    with pytest.raises(error, match=named):
        call(tier, cache)
    assert copies.calls == [] and host.live_events() == 0
    for (layer, block), (k, v) in written.items():
        got = cache.read_block(layer, block, host)
        assert np.array_equal(got[0], k) and np.array_equal(got[1], v)
    assert not any(tier.read_block(layer, h)[0].any() for layer in range(3) for h in range(8))
    tier.release(host)
    cache.release(host)


def test_an_unknown_stream_is_refused_by_the_backend_with_nothing_moved(host):
    cache = PagedKvCache(MIXED, 8, host)
    tier = HostTier(cache, 4, host)
    device, h = cache.alloc_blocks(1), tier.alloc(1)
    _fill(cache, device, host, seed=2)
    with pytest.raises(ValueError, match="unknown stream 999"):
        tier.swap_out(device, h, 999)
    assert host.live_events() == 0 and not tier.read_block(0, h[0])[0].any()
    tier.release(host)
    cache.release(host)


def test_a_failing_batched_copy_changes_nothing_and_leaves_no_event(host, monkeypatch):
    cache = PagedKvCache(MIXED, 8, host)
    tier = HostTier(cache, 4, host)
    device, h = cache.alloc_blocks(2), tier.alloc(2)

    def refuse(*args):
        raise IndexError("copy_batch_async entry 0: planted")

    monkeypatch.setattr(host, "copy_batch_async", refuse)
    with pytest.raises(IndexError, match="planted"):
        tier.swap_out(device, h, 0)
    assert host.live_events() == 0 and tier.num_free_blocks() == 2
    tier.release(host)
    cache.release(host)


def test_free_list_lru_and_blocks_freed_after_a_swap(host):
    cache = PagedKvCache(MIXED, 8, host)
    tier = HostTier(cache, 4, host)
    assert tier.alloc(3) == [0, 1, 2] and tier.num_free_blocks() == 1
    with pytest.raises(KvCacheExhausted, match="host tier: 2 block\\(s\\) asked, 1 of 4 free"):
        tier.alloc(2)
    tier.touch([2, 0])
    tier.touch([1])
    tier.touch([2])
    assert tier.lru_blocks() == [0, 1, 2] and tier.is_cached(0) and tier.num_cached_blocks() == 3
    tier.uncache([1])
    assert tier.lru_blocks() == [0, 2] and not tier.is_cached(1)
    handle = tier.swap_in([0], cache.alloc_blocks(1), 0)
    tier.free([0], after=handle)  # reading it: free once done
    assert tier.lru_blocks() == [2] and tier.num_free_blocks() == 2
    with pytest.raises(RefCountError, match="free of free host block 0"):
        tier.free([0])
    with pytest.raises(ValueError, match="lists a block twice"):
        tier.free([1, 1])
    assert tier.alloc(2) == [0, 3]
    tier.release(host)
    assert host.live_swap_memory() == 0 and host.live_events() == 0
    with pytest.raises(KvCacheError, match="released"):
        tier.alloc(1)
    tier.release(host)  # nothing left: does nothing
    cache.release(host)


class NoHostTier(HostBackend):
    def supports(self, name):
        return name != "host_tier" and super().supports(name)


def test_a_backend_without_the_capability_or_another_backend_is_refused():
    gpu = NoHostTier(capacity_bytes=1 << 26)
    cache = PagedKvCache(MIXED, 4, gpu)
    with pytest.raises(BackendFeatureMissing, match="HostTier needs a backend that supports 'host_tier'"):
        HostTier(cache, 4, gpu)
    other = HostBackend(capacity_bytes=1 << 26)
    with pytest.raises(ValueError, match="not the backend the cache was built on"):
        HostTier(cache, 4, other)
    with pytest.raises(ValueError, match="host tier num_blocks"):
        HostTier(PagedKvCache(MIXED, 4, other), 0, other)
    cache.release(gpu)


class FailsThirdSwapMemory(HostBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.made = 0

    def alloc_swap_memory(self, nbytes):
        self.made += 1
        if self.made == 3:
            raise DeviceOutOfMemory("planted: no pinned memory left")
        return super().alloc_swap_memory(nbytes)


def test_a_failed_construction_frees_what_it_allocated():
    gpu = FailsThirdSwapMemory(capacity_bytes=1 << 26)
    cache = PagedKvCache(MIXED, 4, gpu)
    with pytest.raises(DeviceOutOfMemory, match="planted"):
        HostTier(cache, 4, gpu)
    assert gpu.made == 3 and gpu.live_swap_memory() == 0
    cache.release(gpu)


def test_a_failed_free_stays_recorded_and_a_second_release_retries_it(host, monkeypatch):
    cache = PagedKvCache(MIXED, 4, host)
    tier = HostTier(cache, 4, host)
    memory = tier._memories[2]
    real_free = memory.free
    monkeypatch.setattr(memory, "free", lambda: (_ for _ in ()).throw(RuntimeError("planted free failure")))
    with pytest.raises(RuntimeError, match="planted free failure"):
        tier.release(host)
    assert host.live_swap_memory() == 1 and tier._memories == [memory]
    monkeypatch.setattr(memory, "free", real_free)
    tier.release(host)
    assert host.live_swap_memory() == 0 and tier._memories == []
    with pytest.raises(ValueError, match="the host tier is on HostBackend"):
        tier.release(HostBackend(capacity_bytes=1 << 20))
    cache.release(host)


def test_host_swap_memory_is_a_numpy_array_at_its_data_pointer(host):
    memory = host.alloc_swap_memory(1000)
    assert memory.address == memory.array.ctypes.data and memory.nbytes == 1000 and not memory.freed
    memory.array[:] = 7
    ptr = host.alloc(1000)
    host.copy_batch_async([int(ptr)], [memory.address], [1000], 0)
    assert (host.view(ptr, 1000) == 7).all()
    memory.free()
    memory.free()  # a second call does nothing
    assert memory.freed and host.live_swap_memory() == 0
    with pytest.raises(IndexError, match=f"entry 0: source range 0x{memory.address:x} \\+ 1000 bytes"):
        host.copy_batch_async([int(ptr)], [memory.address], [1000], 0)
    with pytest.raises(ValueError, match="swap memory size"):
        host.alloc_swap_memory(0)
    with pytest.raises(DeviceOutOfMemory, match="cannot allocate"):
        host.alloc_swap_memory(1 << 62)
    host.free(ptr)


# -- the "host_tier" conformance rules fail on a backend that breaks their point ----------

class CopiesRangeByRange(HostBackend):
    """Copies each range as it checks it: a bad later range leaves the earlier ones copied."""

    def copy_batch_async(self, dsts, srcs, sizes, stream):
        for i, (d, s, n) in enumerate(zip(dsts, srcs, sizes)):
            try:
                super().copy_batch_async([d], [s], [n], stream)
            except IndexError as err:
                raise IndexError(str(err).replace("entry 0", f"entry {i}")) from None


class ForgetsTheLastRange(HostBackend):
    def copy_batch_async(self, dsts, srcs, sizes, stream):
        super().copy_batch_async(list(dsts)[:-1], list(srcs)[:-1], list(sizes)[:-1], stream)


class KeepsDestroyedEvents(HostBackend):
    def destroy_event(self, event):
        self._check_event(event)


class SwapMemoryFreeTwiceRaises(HostBackend):
    def alloc_swap_memory(self, nbytes):
        memory = super().alloc_swap_memory(nbytes)
        free = memory.free

        def strict():
            if memory.freed:
                raise RuntimeError("swap memory freed twice")
            free()

        memory.free = strict
        return memory


@pytest.mark.parametrize("backend, rule, reason", [
    (CopiesRangeByRange, "batched_copy_refuses_bad_ranges", "swap memory after a destination range past"),
    (ForgetsTheLastRange, "batched_copy", "after one batched copy"),
    (ForgetsTheLastRange, "host_tier_swaps", "differ"),
    (KeepsDestroyedEvents, "events", "destroy of a destroyed event: returned"),
    (SwapMemoryFreeTwiceRaises, "swap_memory", "swap memory freed twice"),
], ids=lambda p: p.__name__ if isinstance(p, type) else None)
def test_a_planted_defect_fails_its_host_tier_rule(backend, rule, reason):
    from pagedkv.testing import backend_conformance

    report = backend_conformance(lambda: backend(capacity_bytes=1 << 26), only=[rule])
    assert report[rule].status == "failed" and reason in report[rule].reason, report[rule].reason



def test_emulated_addresses_never_land_on_swap_memory(host):
    memory = host.alloc_swap_memory(4096)
    memory.array[:] = np.arange(4096) % 251
    host._next_address = memory.address - 256  # as if the emulated addresses had grown this far
    ptr = host.alloc(4096)
    assert int(ptr) >= memory.address + memory.nbytes or int(ptr) + 4096 <= memory.address
    host.copy_batch_async([int(ptr)], [memory.address], [4096], 0)
    assert np.array_equal(host.view(ptr, 4096), memory.array)
    host._next_address = memory.address
    reserved = host.reserve_address(host.vmm_granularity())
    assert int(reserved) >= memory.address + memory.nbytes
    host.release_address(reserved)
    host.free(ptr)
    memory.free()


def test_an_elastic_cache_swaps_its_resident_blocks_and_refuses_the_others():
    host = HostBackend(capacity_bytes=1 << 26, vmm_granularity=4096)
    cache = PagedKvCache(MIXED, 64, host, elastic=True)
    tier = HostTier(cache, 4, host)
    try:
        blocks = cache.alloc_blocks(2)
        written = _fill(cache, blocks, host, seed=9)
        h = tier.alloc(2)
        tier.swap_out(blocks, h, 0).wait()
        back = cache.alloc_blocks(2)
        tier.swap_in(h, back, 0).wait()
        for (layer, block), (k, v) in written.items():
            got = cache.read_block(layer, back[blocks.index(block)], host)
            assert np.array_equal(got[0], k) and np.array_equal(got[1], v)
        top = cache.num_blocks() - 1
        with pytest.raises(IndexError, match=f"block {top} is not resident"):
            tier.swap_in(h[:1], [top], 0)
    finally:
        tier.release(host)
        cache.release(host)
