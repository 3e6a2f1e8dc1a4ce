"""Host-tier section of tools/bench.py (`--section tier`, part of `--gpu`): the batched swaps
of CudaBackend.copy_batch_async against the pinned-copy bandwidth measured in the same run
and the per-block copy loop they replace.

Layout as a host tier keeps it: BLOCKS blocks x LAYERS layers, K and V, BF16, 8 KV heads
x 128, block 16 (32 KiB per layer, side and block), one device pool and one host pool
(swap memory) per layer and side. Descriptors are built as HostTier builds them: one
range per layer-side-run of consecutive blocks (contiguous blocks: LAYERS x 2 ranges;
scattered blocks: one range per block). Each copy path runs in its own backend (the
driver's cuMemcpyBatchAsync, where this driver has it, and the copy kernel), timed with
CUDA events on a non-default stream. Printed: the ceiling (one cuMemcpyDtoHAsync and one
cuMemcpyHtoDAsync of the whole tier on pinned memory), swap_out / swap_in GB/s of each path
and as a fraction of the ceiling, and the per-block copy_d2h_async / copy_h2d_async loop.
Floors: swap_out and swap_in >= 80% of the pinned ceiling of their direction, per path.
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np

BLOCKS = 256
LAYERS = 32
HEADS, HEAD_DIM, BLOCK_TOKENS, DTYPE_BYTES = 8, 128, 16, 2
FLOOR_OF_PINNED = 0.80
"""swap_out / swap_in GB/s must reach this fraction of the pinned copy of their direction."""


def block_bytes() -> int:
    """Bytes of one block of one layer and side (K or V)."""
    return BLOCK_TOKENS * HEADS * HEAD_DIM * DTYPE_BYTES


def layer_side_runs(blocks_from: list[int], blocks_to: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, count) of each run of consecutive
    pairs (source and destination both +1): how HostTier turns a block list into ranges."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(blocks_from, blocks_to):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def descriptors(src_pools: list[int], dst_pools: list[int], blocks_from: list[int], blocks_to: list[int]):
    """(dsts, srcs, sizes) uint64 arrays: one range per pool (layer and side) per run."""
    size = block_bytes()
    runs = layer_side_runs(blocks_from, blocks_to)
    dsts, srcs, sizes = [], [], []
    for src_pool, dst_pool in zip(src_pools, dst_pools):
        for a, b, n in runs:
            srcs.append(src_pool + a * size)
            dsts.append(dst_pool + b * size)
            sizes.append(n * size)
    return np.array(dsts, np.uint64), np.array(srcs, np.uint64), np.array(sizes, np.uint64)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def run(args) -> None:
    """Measure and print the host-tier section; SystemExit(1) after printing if a floor is
    missed and tools/floors.py is absent."""
    from pagedkv.driver import CudaBackend, is_available

    from bench_gpu import EventTimer, Floors

    if not is_available():
        print("[tier] no CUDA driver or GPU on this machine: section skipped")
        return
    quick = getattr(args, "quick", False)
    reps = 3 if quick else 10
    floors = Floors()
    total = BLOCKS * LAYERS * 2 * block_bytes()
    print(f"host tier: {BLOCKS} blocks x {LAYERS} layers x K,V of {block_bytes() // 1024} KiB ({total / 2**20:.4g} MiB per swap)")
    for mode in ("auto", "kernel"):
        with CudaBackend(copy_batch=mode) as gpu:
            if mode == "auto" and gpu.copy_batch_path == "kernel":
                print("  this driver has no cuMemcpyBatchAsync (CUDA 12.8+): the copy kernel only")
                continue
            stream = gpu.create_stream()
            timer = EventTimer(stream)
            try:
                _bench_path(gpu, stream, timer, floors, reps, total, first=mode == "auto")
            finally:
                timer.close()
                gpu.destroy_stream(stream)
    if floors.missed and floors.exits_itself:
        print(f"[tier] floors missed: {', '.join(floors.missed)}")
        sys.exit(1)


def _bench_path(gpu, stream, timer, floors, reps, total, first) -> None:
    size = block_bytes()
    pool_bytes = BLOCKS * size
    pools = [gpu.alloc(pool_bytes) for _ in range(2 * LAYERS)]
    tier = gpu.alloc_swap_memory(total)
    pinned = gpu.alloc_pinned(total)
    big = gpu.alloc(total)
    try:
        for p in pools:
            gpu.memset_async(p, 0x3C, pool_bytes, stream)
        gpu.memset_async(big, 0x3C, total, stream)
        tier.array[:] = 0
        host_pools = [tier.address + k * pool_bytes for k in range(2 * LAYERS)]
        device_pools = [int(p) for p in pools]
        path = gpu.copy_batch_path
        print(f"{path} path ({'cuMemcpyBatchAsync' if path == 'driver' else 'pagedkv_copy_batch kernel over mapped memory'}):")

        out_ms = timer.time(lambda: gpu.copy_d2h_async(big, pinned.array, stream), reps)
        in_ms = timer.time(lambda: gpu.copy_h2d_async(pinned.array, big, stream), reps)
        ceiling = {"out": _gbps(total, out_ms), "in": _gbps(total, in_ms)}
        print(f"  pinned ceiling: one cuMemcpyDtoHAsync  {out_ms:9.3f} ms  {ceiling['out']:8.1f} GB/s")
        print(f"  pinned ceiling: one cuMemcpyHtoDAsync  {in_ms:9.3f} ms  {ceiling['in']:8.1f} GB/s")

        blocks = list(range(BLOCKS))
        scattered = [int(b) for b in np.random.default_rng(0).permutation(BLOCKS)]
        for label, device_blocks in (("contiguous blocks", blocks), ("scattered blocks", scattered)):
            out = descriptors(device_pools, host_pools, device_blocks, blocks)
            back = descriptors(host_pools, device_pools, blocks, device_blocks)
            swap_out_ms = timer.time(lambda: gpu.copy_batch_async(*out, stream), reps)
            swap_in_ms = timer.time(lambda: gpu.copy_batch_async(*back, stream), reps)
            print(f"  {label} ({out[0].size} ranges per swap):")
            for direction, ms in (("out", swap_out_ms), ("in", swap_in_ms)):
                rate = _gbps(total, ms)
                fraction = rate / ceiling[direction]
                print(f"    swap_{direction:<4} one copy_batch_async    {ms:9.3f} ms  {rate:8.1f} GB/s  {fraction * 100:6.1f}% of pinned")
                floors.floor(f"{path} swap_{direction} ({label}) vs pinned copy", fraction, FLOOR_OF_PINNED)
        if first:
            _bench_loop(gpu, stream, timer, tier, pools, size, total, max(1, reps // 3))
    finally:
        gpu.synchronize(stream)
        gpu.free(big)
        pinned.free()
        tier.free()
        for p in pools:
            gpu.free(p)


def _bench_loop(gpu, stream, timer, tier, pools, size, total, reps) -> None:
    """The per-block loop a batched swap replaces: one async copy per block, layer and side."""
    arr = tier.array
    views = [arr[k * BLOCKS * size:(k + 1) * BLOCKS * size] for k in range(len(pools))]

    def loop(out: bool) -> Callable[[], None]:
        def work() -> None:
            for pool, view in zip(pools, views):
                for b in range(BLOCKS):
                    if out:
                        gpu.copy_d2h_async(pool.offset(b * size), view[b * size:(b + 1) * size], stream)
                    else:
                        gpu.copy_h2d_async(view[b * size:(b + 1) * size], pool.offset(b * size), stream)
        return work

    calls = len(pools) * BLOCKS
    for direction, out in (("out", True), ("in", False)):
        ms = timer.time(loop(out), reps)
        print(f"  per-block loop swap_{direction} ({calls} cuMemcpy{'DtoH' if out else 'HtoD'}Async)  {ms:9.3f} ms  {_gbps(total, ms):8.1f} GB/s")
