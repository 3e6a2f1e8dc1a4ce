"""The host tier when the backend's event and free calls fail: a swap's event stays
recorded until the backend destroys it (in the handle, in the tier's pending list, or with
the tier until `release`), swap memory whose free failed is freed by the next `release`,
and the pending list survives a poll that raises."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from fault_injection import CONFIG, InjectedFault, new_backend
from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.tiers.host_tier import HostTier


def _world(blocks=12, host_blocks=10):
    gpu = new_backend()
    cache = PagedKvCache(CONFIG, blocks, gpu)
    tier = HostTier(cache, host_blocks, gpu)
    return gpu, cache, tier


def _release(gpu, cache, tier, *more):
    for obj in more:
        obj.close() if isinstance(obj, PrefixCache) else obj.release(gpu)
    tier.release(gpu)
    cache.release(gpu)
    assert (gpu.live_allocations(), gpu.live_swap_memory(), gpu.live_events()) == (0, 0, 0)


def test_a_handle_keeps_its_event_when_destroy_fails_and_a_second_wait_destroys_it():
    gpu, cache, tier = _world()
    dev, host = cache.alloc_blocks(2), tier.alloc(2)
    handle = tier.swap_out(dev, host, 0)
    gpu.plan.fail_next("destroy_event")
    with pytest.raises(InjectedFault):
        handle.wait()
    assert handle.event() is not None and gpu.live_events() == 1
    handle.wait()
    assert handle.event() is None and gpu.live_events() == 0
    _release(gpu, cache, tier)


@pytest.mark.parametrize("method", ["wait_event", "destroy_event"])
def test_a_demotion_whose_swap_cannot_be_waited_for_leaks_no_event(method):
    gpu, cache, tier = _world()
    prefix = PrefixCache(cache, host_tier=tier)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(13)))
    table.free("a")  # 3 full blocks cached on the device
    gpu.plan.fail_next(method)
    with capture_logs(), pytest.raises(InjectedFault):
        cache.alloc_blocks(cache.num_free_blocks() + 1)  # evicts: one swap_out, its wait fails
    table.check_invariants()
    assert gpu.live_events() == 1  # the failed swap's, kept by the tier until it is known done
    stats = prefix.stats()
    assert (stats.cached_blocks, stats.demotions, prefix.num_host_blocks()) == (3, 0, 0)  # nothing changed
    cache.free_blocks(cache.alloc_blocks(cache.num_free_blocks() + 3))  # a retry demotes all three
    assert prefix.num_host_blocks() == 3 and prefix.stats().demotions == 3
    assert tier.num_free_blocks() == 7  # the failed swap's host blocks came back
    _release(gpu, cache, tier, table, prefix)


@pytest.mark.parametrize("method", ["event_done", "destroy_event"])
def test_a_promotion_whose_swap_cannot_be_polled_leaks_no_event(method):
    gpu, cache, tier = _world()
    prefix = PrefixCache(cache, host_tier=tier)
    table = SequenceTable(cache, prefix, gpu)
    prompt = list(range(13))
    table.add("a", prompt)
    table.free("a")
    cache.free_blocks(cache.alloc_blocks(cache.num_free_blocks() + 3))  # demoted to the host
    assert prefix.num_host_blocks() == 3
    gpu.plan.fail_next(method)
    with capture_logs(), pytest.raises(InjectedFault):
        table.add("b", prompt)
    assert "b" not in table and prefix.num_host_blocks() == 3
    table.check_invariants()
    assert table.add("b", prompt) == 12  # the retry promotes
    table.free("b")
    _release(gpu, cache, tier, table, prefix)


def test_swap_memory_whose_free_fails_stays_recorded_and_the_next_release_frees_it():
    gpu, cache, tier = _world()
    gpu.plan.fail_next("_forget_swap", skip=1)
    with capture_logs() as logs, pytest.raises(InjectedFault):
        tier.release(gpu)
    assert [e["event"] for e in logs] == ["host_tier_free_failed"]
    assert gpu.live_swap_memory() == 1
    _release(gpu, cache, tier)


def test_the_pending_list_survives_a_poll_that_raises():
    gpu, cache, tier = _world(host_blocks=4)
    dev = cache.alloc_blocks(2)
    first, second = tier.alloc(2), tier.alloc(2)
    h1, h2 = tier.swap_out(dev, first, 0), tier.swap_out(dev, second, 0)
    tier.abandon(h1, first)  # as a failed demotion does: freed once h1 is known done
    tier.abandon(h2, second)
    assert tier.num_free_blocks() == 4
    gpu.plan.fail_next("wait_event", skip=1)  # h1 is waited for, h2's wait raises
    with pytest.raises(InjectedFault):
        tier.alloc(4)
    assert tier.num_free_blocks() == 4 and gpu.live_events() == 1  # h1 reaped once, h2 still pending
    assert sorted(tier.alloc(4)) == [0, 1, 2, 3]  # no block twice: h1's were not pushed again
    assert gpu.live_events() == 0
    tier.free([0, 1, 2, 3])
    _release(gpu, cache, tier)


def test_an_event_whose_record_fails_leaves_the_stream_waited_and_nothing_recorded():
    gpu, cache, tier = _world()
    dev, host = cache.alloc_blocks(1), tier.alloc(1)
    gpu.plan.fail_next("record_event")
    with pytest.raises(InjectedFault):
        tier.swap_out(dev, host, 0)
    assert gpu.plan.calls[-1] == "synchronize"  # the copy is known finished before the error
    assert gpu.live_events() == 0
    _release(gpu, cache, tier)


def test_abandoned_blocks_are_free_only_once_their_swap_is_done_and_keep_destroys_the_event():
    """The README's abandon / keep paragraph."""
    gpu = HostBackend(1 << 22)
    cache = PagedKvCache(KvCacheConfig(4, 1, 16, 2, "bf16"), 4, gpu)
    tier = HostTier(cache, 4, gpu)
    device = cache.alloc_blocks(2)
    host = tier.alloc(2)
    handle = tier.swap_out(device, host, 0)
    done = [False]
    real_done, real_wait = gpu.event_done, gpu.wait_event

    def wait(event):
        if not done[0]:
            raise RuntimeError("wait failed")  # completion not known yet
        real_wait(event)

    gpu.event_done = lambda event: done[0] and real_done(event)
    gpu.wait_event = wait
    tier.abandon(handle, host)
    assert tier.alloc(2) == [2, 3]  # the abandoned two stay out
    with pytest.raises(RuntimeError, match="wait failed"):
        tier.alloc(1)  # needs them: waits for the swap, which still cannot be waited for
    done[0] = True
    assert tier.alloc(2) == [0, 1] and gpu.live_events() == 0  # reaped: free, event destroyed
    kept = tier.swap_in([0], device[:1], 0)
    tier.keep(kept)
    with pytest.raises(TypeError, match="keep takes a SwapHandle, got int"):
        tier.keep(3)
    assert gpu.live_events() == 1
    tier.release(gpu)
    assert gpu.live_events() == 0 and gpu.live_swap_memory() == 0
    cache.release(gpu)


def test_an_unmap_of_nothing_mapped_is_chunk_not_mapped():
    """The README's ChunkNotMapped paragraph."""
    from pagedkv import ChunkNotMapped, DeviceMemoryError

    gpu = HostBackend(1 << 22, vmm_granularity=4096)
    base = gpu.reserve_address(4 * 4096)
    gpu.map_chunk(base, 4096)
    gpu.unmap_chunk(base, 4096)
    with pytest.raises(ChunkNotMapped, match="not a chunk mapped there") as caught:
        gpu.unmap_chunk(base, 4096)  # unmapped already: a retry after a late failure finds it gone
    assert isinstance(caught.value, DeviceMemoryError)
    gpu.release_address(base)


def test_abandon_refuses_a_repeated_block_and_a_block_the_prefix_cache_holds():
    gpu = HostBackend(1 << 22)
    cache = PagedKvCache(KvCacheConfig(4, 1, 16, 2, "bf16"), 4, gpu)
    tier = HostTier(cache, 4, gpu)
    host, device = tier.alloc(2), cache.alloc_blocks(2)
    handle = tier.swap_out(device, host, 0)
    with pytest.raises(ValueError, match=r"host tier abandon lists a block twice: \[%d, %d\]" % (host[0], host[0])):
        tier.abandon(handle, [host[0], host[0]])
    assert tier.num_free_blocks() == 2  # nothing changed
    handle.wait()
    tier.free(host)
    cache.free_blocks(device)
    prefix = PrefixCache(cache, host_tier=tier)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(9)))
    table.free("a")
    prefix.evict(2)  # both cached blocks demoted to the host tier
    cached = tier.lru_blocks()
    assert len(cached) == 2
    with pytest.raises(Exception, match="PrefixCache holds it"):
        tier.abandon(handle, cached[:1])
    assert tier.lru_blocks() == cached
    prefix.close()
    _release(gpu, cache, tier)
