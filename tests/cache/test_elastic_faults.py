"""Elastic pools when a backend's map or unmap fails: a granule whose unmap failed (before
or after taking effect) is never resident again until a retried unmap settles it, so no
block over possibly unmapped memory is handed out (on a GPU: CUDA_ERROR_ILLEGAL_ADDRESS and
a lost context), and nothing leaks once the retry succeeds."""

from __future__ import annotations

import numpy as np
import pytest
from structlog.testing import capture_logs

from fault_injection import CONFIG, GRANULE, InjectedFault, new_backend
from pagedkv import PagedKvCache

SIDE = CONFIG.k_block_bytes_for_layer(0)  # 128 bytes: 4 blocks a granule, 4 pools
POOLS = 2 * CONFIG.num_layers


def _write_all(cache, gpu, blocks, value):
    data = np.full(SIDE, value, np.uint8)
    for block in blocks:
        cache.write_block(0, block, data, data, gpu)
        cache.write_block(1, block, data, data, gpu)


def test_an_unmap_that_fails_after_taking_effect_takes_the_granule_out_of_residence():
    gpu = new_backend()
    cache = PagedKvCache(CONFIG, 16, gpu, elastic=True)
    held = cache.alloc_blocks(8)  # two steps mapped in every pool
    cache.free_blocks(held[4:])
    gpu.plan.fail_next("unmap_chunk", late=True)  # the first pool's top granule: unmapped, then an error
    with capture_logs() as logs, pytest.raises(InjectedFault, match="after it took effect"):
        cache.shrink(gpu)
    assert [e["event"] for e in logs] == ["kv_elastic_unmap_failed", "kv_cache_shrunk"]
    assert cache.resident_blocks() == 4 and cache.pools().elastic().unsettled() == 1
    assert gpu.live_bytes() == POOLS * GRANULE  # the backend really unmapped all four
    cache.allocator().check_invariants()
    more = cache.alloc_blocks(12)  # maps again: the unsettled granule is settled first
    assert more == list(range(4, 16)) and cache.pools().elastic().unsettled() == 0
    _write_all(cache, gpu, held[:4] + more, 0x77)  # every byte handed out is mapped
    assert all((cache.read_block(1, b, gpu)[1] == 0x77).all() for b in held[:4] + more)
    cache.free_blocks(held[:4] + more)
    cache.release(gpu)
    assert gpu.live_allocations() == 0 and gpu.live_bytes() == 0


def test_an_unmap_that_fails_before_taking_effect_is_retried_by_the_next_shrink():
    gpu = new_backend()
    cache = PagedKvCache(CONFIG, 16, gpu, elastic=True)
    held = cache.alloc_blocks(8)
    cache.free_blocks(held[4:])
    gpu.plan.fail_next("unmap_chunk", skip=2)  # the third pool's top granule stays mapped
    with capture_logs(), pytest.raises(InjectedFault, match="before it took effect"):
        cache.shrink(gpu)
    assert cache.resident_blocks() == 4  # not handed out: the library cannot know which it was
    assert gpu.live_bytes() == POOLS * GRANULE + GRANULE  # still mapped on the backend
    assert cache.shrink(gpu) == 0  # the retry: nothing resident changes, the granule is unmapped
    assert gpu.live_bytes() == POOLS * GRANULE and cache.pools().elastic().unsettled() == 0
    cache.free_blocks(held[:4])
    assert cache.shrink(gpu) == POOLS * GRANULE and gpu.live_bytes() == 0
    cache.release(gpu)
    assert gpu.live_allocations() == 0


def test_a_map_that_fails_is_unmapped_before_the_granule_is_mapped_again():
    gpu = new_backend()
    cache = PagedKvCache(CONFIG, 16, gpu, elastic=True)
    gpu.plan.fail_next("map_chunk", late=True, skip=1)  # the second pool's granule: mapped, then an error
    with capture_logs(), pytest.raises(InjectedFault):
        cache.alloc_blocks(2)
    assert cache.resident_blocks() == 0 and cache.pools().elastic().unsettled() == 1
    assert gpu.live_bytes() == GRANULE  # the growth's first granule was undone; the failed one is mapped
    blocks = cache.alloc_blocks(2)  # settles it (unmaps it), then maps it anew
    assert blocks == [0, 1] and gpu.live_bytes() == POOLS * GRANULE
    _write_all(cache, gpu, blocks, 0x11)
    cache.free_blocks(blocks)
    cache.release(gpu)
    assert gpu.live_allocations() == 0 and gpu.live_bytes() == 0


def test_release_after_a_failed_unmap_frees_every_reservation():
    gpu = new_backend()
    cache = PagedKvCache(CONFIG, 16, gpu, elastic=True)
    cache.free_blocks(cache.alloc_blocks(8))
    gpu.plan.fail_next("unmap_chunk")
    with capture_logs(), pytest.raises(InjectedFault):
        cache.shrink(gpu)
    cache.release(gpu)  # the reservation's release unmaps what is still mapped
    assert gpu.live_allocations() == 0 and gpu.live_bytes() == 0
