"""Conformance rules for the "host_tier" capability: swap memory, the batched copy (one call,
every range checked before anything moves), events, and a HostTier over a cache of mixed
formats moving every layer's K and V in one call per swap, byte for byte. Each runs only
on a backend that states "host_tier".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cache.paged_cache import PagedKvCache
from ..core.config import KvCacheConfig
from ..errors import DeviceOutOfMemory
from .registry import expect, expect_bytes, expect_raises, read, rule

_MIXED = KvCacheConfig(
    block_size=4, num_kv_heads=2, head_dim=16, num_layers=3, dtype="bf16k_turbo3v",
    layer_dtypes=("bf16", "fp8k_turbo4v"), layer_dims=((2, 16), (1, 32)),
)


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@rule("protocol", requires=("host_tier",))
def rule_swap_memory(gpu: Any) -> None:
    """alloc_swap_memory(n): an object with an int `address`, `nbytes == n`, a writable
    1-D uint8 `array` of n bytes, `free()` (a second call does nothing) and `freed`;
    n <= 0 raises ValueError, an impossible size DeviceOutOfMemory."""
    memory = gpu.alloc_swap_memory(4096)
    try:
        expect(isinstance(memory.address, int) and memory.address > 0, f"swap memory address {memory.address!r}")
        expect(memory.nbytes == 4096, f"swap memory of 4096 bytes reports nbytes {memory.nbytes}")
        array = memory.array
        expect(isinstance(array, np.ndarray) and array.dtype == np.uint8 and array.shape == (4096,)
               and array.flags.writeable, f"swap memory array is {type(array).__name__} {getattr(array, 'dtype', '')}")
        array[:] = _pattern(4096, 1)
        expect_bytes(memory.array, _pattern(4096, 1), "swap memory read back through .array")
        expect(not memory.freed, "fresh swap memory says freed")
    finally:
        memory.free()
    expect(memory.freed, "freed swap memory does not say so")
    memory.free()
    for bad in (0, -1):
        expect_raises(ValueError, lambda: gpu.alloc_swap_memory(bad), f"alloc_swap_memory({bad})", names=str(bad))
    err = expect_raises(MemoryError, lambda: gpu.alloc_swap_memory(1 << 62), "alloc_swap_memory(2**62)")
    expect(isinstance(err, DeviceOutOfMemory), f"alloc_swap_memory(2**62) raised {type(err).__name__}, not DeviceOutOfMemory")


@rule("protocol", requires=("host_tier",))
def rule_batched_copy(gpu: Any) -> None:
    """copy_batch_async copies every listed range in one call, in stream order: device to
    swap memory, swap memory to device, device to device, swap to swap; numpy uint64
    lists are accepted, an empty list does nothing, and so does a 0-byte range (its
    addresses are not looked at)."""
    stream = gpu.default_stream()
    memory = gpu.alloc_swap_memory(8192)
    ptr = gpu.alloc(8192)
    try:
        gpu.copy_h2d(_pattern(8192, 2), ptr)
        memory.array[:] = _pattern(8192, 3)
        d, h = int(ptr), memory.address
        dsts = np.array([8, h, d + 4096, d + 6000, h + 5000], dtype=np.uint64)
        srcs = np.array([16, d + 100, h + 7000, d + 300, h + 6000], dtype=np.uint64)
        sizes = np.array([0, 1000, 600, 900, 700], dtype=np.uint64)
        gpu.copy_batch_async(dsts, srcs, sizes, stream)
        gpu.copy_batch_async([], [], [], stream)
        gpu.synchronize(stream)
        dev, host = _pattern(8192, 2), _pattern(8192, 3)
        want_host, want_dev = host.copy(), dev.copy()
        want_host[0:1000] = dev[100:1100]
        want_dev[4096:4696] = host[7000:7600]
        want_dev[6000:6900] = dev[300:1200]
        want_host[5000:5700] = host[6000:6700]
        expect_bytes(memory.array, want_host, "swap memory after one batched copy")
        expect_bytes(read(gpu, ptr, 8192), want_dev, "device memory after one batched copy")
    finally:
        gpu.synchronize_all()
        gpu.free(ptr)
        memory.free()


@rule("protocol", requires=("host_tier",))
def rule_batched_copy_refuses_bad_ranges(gpu: Any) -> None:
    """A range outside every allocation and swap memory (or in freed swap memory) raises
    IndexError naming the entry and the address; overlapping destinations, a destination
    overlapping a source, and unequal lengths raise ValueError; nothing is copied."""
    stream = gpu.default_stream()
    memory = gpu.alloc_swap_memory(4096)
    gone = gpu.alloc_swap_memory(4096)
    ptr = gpu.alloc(4096)
    try:
        gpu.copy_h2d(_pattern(4096, 4), ptr)
        memory.array[:] = _pattern(4096, 5)
        d, h = int(ptr), memory.address
        gone_address = gone.address
        gone.free()
        past = d + 4000
        cases = [
            (IndexError, [h, past], [d, d + 200], [100, 200], f"{past:x}", "a destination range past the allocation's end"),
            (IndexError, [h, gone_address], [d, d + 200], [100, 200], f"{gone_address:x}", "a range in freed swap memory"),
            (ValueError, [h, h + 50], [d, d + 200], [100, 100], None, "overlapping destinations"),
            (ValueError, [d + 1000], [d + 1050], [100], None, "a destination overlapping its source"),
            (ValueError, [h, h + 200], [d], [100, 100], None, "unequal lengths"),
        ]
        for kind, dsts, srcs, sizes, names, what in cases:
            err = expect_raises(kind, lambda: gpu.copy_batch_async(dsts, srcs, sizes, stream), what, names=names)
            if kind is IndexError:
                expect("1" in str(err), f"{what}: the message {err} does not name entry 1")
            gpu.synchronize(stream)
            expect_bytes(read(gpu, ptr, 4096), _pattern(4096, 4), f"device memory after {what}")
            expect_bytes(memory.array, _pattern(4096, 5), f"swap memory after {what}")
    finally:
        gpu.synchronize_all()
        gpu.free(ptr)
        memory.free()


@rule("protocol", requires=("host_tier",))
def rule_events(gpu: Any) -> None:
    """record_event / event_done / wait_event / stream_wait_event / destroy_event: an event
    recorded after work is done once waited for; stream_wait_event orders a second stream
    after it; an unknown or destroyed event raises ValueError naming it."""
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    memory = gpu.alloc_swap_memory(4096)
    ptr = gpu.alloc(4096)
    events: list[int] = []
    try:
        gpu.memset_async(ptr, 0x3C, 4096, s1)
        event = gpu.record_event(s1)
        events.append(event)
        gpu.stream_wait_event(s2, event)
        gpu.copy_batch_async([memory.address], [int(ptr)], [4096], s2)
        done = gpu.record_event(s2)
        events.append(done)
        gpu.wait_event(done)
        expect(gpu.event_done(done) is True and gpu.event_done(event) is True, "a waited-for event is not done")
        expect_bytes(memory.array, np.full(4096, 0x3C, np.uint8), "a batched copy ordered after another stream's memset")
        for e in list(events):
            gpu.destroy_event(e)
            events.remove(e)
        expect_raises(ValueError, lambda: gpu.destroy_event(done), "destroy of a destroyed event", names=str(done))
        expect_raises(ValueError, lambda: gpu.event_done(done), "event_done of a destroyed event", names=str(done))
        expect_raises(ValueError, lambda: gpu.wait_event(done), "wait_event of a destroyed event", names=str(done))
        expect_raises(ValueError, lambda: gpu.stream_wait_event(s1, done), "stream_wait_event on a destroyed event",
                      names=str(done))
    finally:
        gpu.synchronize_all()
        for e in events:
            gpu.destroy_event(e)
        gpu.free(ptr)
        memory.free()
        gpu.destroy_stream(s1)
        gpu.destroy_stream(s2)


@rule("cache", requires=("host_tier",))
def rule_host_tier_swaps(gpu: Any) -> None:
    """A HostTier over a cache of mixed formats and dims: swap_out (on a created stream)
    then swap_in (on the default stream) move every layer's K and V of the listed blocks
    byte for byte, each in ONE copy_batch_async call. (On CudaBackend the two streams take
    both copy paths: cuMemcpyBatchAsync where the driver has it, and the copy kernel,
    which the legacy default stream always takes.)"""
    from ..tiers.host_tier import HostTier

    cache = PagedKvCache(_MIXED, 8, gpu)
    tier = None
    calls: list[int] = []
    side_stream = gpu.create_stream()
    try:
        tier = HostTier(cache, 4, gpu)
        blocks = cache.alloc_blocks(8)
        written = {}
        for layer in range(_MIXED.num_layers):
            for block in blocks[:3]:
                k = _pattern(cache.k_block_stride_bytes_for_layer(layer), 10 * layer + block)
                v = _pattern(cache.v_block_stride_bytes_for_layer(layer), 100 + 10 * layer + block)
                cache.write_block(layer, block, k, v, gpu)
                written[layer, block] = (k, v)
        original = gpu.copy_batch_async

        def counted(*args):
            calls.append(len(args[0]))
            return original(*args)

        gpu.copy_batch_async = counted
        try:
            host = tier.alloc(3)
            stream = gpu.default_stream()
            tier.swap_out(blocks[:3], host, side_stream).wait()
            tier.swap_in(host, blocks[5:8][::-1], stream).wait()
        finally:
            del gpu.copy_batch_async
        expect(len(calls) == 2, f"two swaps made {len(calls)} copy_batch_async calls")
        for layer in range(_MIXED.num_layers):
            for block, h, back in zip(blocks[:3], host, blocks[5:8][::-1]):
                k, v = written[layer, block]
                got_k, got_v = tier.read_block(layer, h)
                expect_bytes(got_k, k, f"layer {layer} K of block {block} in host block {h}")
                expect_bytes(got_v, v, f"layer {layer} V of block {block} in host block {h}")
                got_k, got_v = cache.read_block(layer, back, gpu)
                expect_bytes(got_k, k, f"layer {layer} K of block {block} swapped back into block {back}")
                expect_bytes(got_v, v, f"layer {layer} V of block {block} swapped back into block {back}")
    finally:
        if tier is not None:
            tier.release(gpu)
        cache.release(gpu)
        gpu.destroy_stream(side_stream)
