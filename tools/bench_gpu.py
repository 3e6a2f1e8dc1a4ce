"""GPU section of tools/bench.py: the CudaBackend's block kernels against their baselines,
timed with CUDA events in one run, on a cache of 64 layers, 8 KV heads, head_dim 128,
block 16, BF16 (4 MiB per block index across every layer's K and V).

Printed side by side: the per-layer, per-block cuMemsetD8Async fill loop against the
batched fill kernel; the block copy; a 1 GiB BF16 checksum; the DRAM bandwidth measured
with one large cuMemcpyDtoD (the ceiling) and each kernel as a fraction of it;
read_block/write_block from pageable and pinned host memory.

Traffic is counted honestly, as DRAM bytes moved: a copy of N bytes reads N and writes N
(2N), a fill writes N, a checksum reads N. Floors: batched fill >= 50x the loop's blocks/s
at 256 blocks; fill >= 80%, copy and checksum >= 75% of the measured DRAM bandwidth. They
go through tools/floors.py when it is present (a line ending `ok` or `MISSED`;
`bench.py --strict` turns a miss into exit status 1); without it this section prints the
same lines and exits 1 itself after printing when one is missed.
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np

GIB = 1 << 30
FILL_BLOCKS = 256
COPY_PAIRS = 256
HOST_IO_BLOCKS = 16
FILL_RATIO_FLOOR = 50.0
FLOORS_OF_BANDWIDTH = {"fill": 0.80, "copy": 0.75, "checksum": 0.75}
"""Each kernel's DRAM traffic rate as a fraction of the measured DRAM bandwidth must reach this."""


class EventTimer:
    """Times work enqueued on a stream with a pair of CUDA events (milliseconds)."""

    def __init__(self, stream: int):
        from cuda.bindings import driver

        from pagedkv.driver.errors import check

        from pagedkv.driver._bindings import CU_STREAM_LEGACY

        # stream 0 is the backend's legacy default stream: name it explicitly, as the backend does
        self._driver, self._check = driver, check
        self.stream = CU_STREAM_LEGACY if stream == 0 else stream
        self._start = check(driver.cuEventCreate(0), "cuEventCreate")
        self._end = check(driver.cuEventCreate(0), "cuEventCreate")

    def time(self, work: Callable[[], None], reps: int, warmup: int = 1) -> float:
        """Milliseconds per call of `work()`: `reps` calls enqueued back to back between two
        events (after `warmup` untimed calls), so host-side work overlaps the GPU as it does
        in an engine; a call that waits for its result (the reductions) pays all of it."""
        d, check = self._driver, self._check
        for _ in range(warmup):
            work()
        check(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        check(d.cuEventRecord(self._start, self.stream), "cuEventRecord")
        for _ in range(reps):
            work()
        check(d.cuEventRecord(self._end, self.stream), "cuEventRecord")
        check(d.cuEventSynchronize(self._end), "cuEventSynchronize")
        return float(check(d.cuEventElapsedTime(self._start, self._end), "cuEventElapsedTime")) / reps

    def close(self) -> None:
        """Destroy both events."""
        self._check(self._driver.cuEventDestroy(self._start), "cuEventDestroy")
        self._check(self._driver.cuEventDestroy(self._end), "cuEventDestroy")


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def copy_traffic(nbytes: int) -> int:
    """DRAM bytes a copy of `nbytes` moves: each byte is read once and written once."""
    return 2 * nbytes


class Floors:
    """Floor checks: through tools/floors.py when it is importable (bench.py --strict
    decides the exit status), else recorded here and printed in the same form."""

    def __init__(self) -> None:
        try:
            import floors as shared
        except ImportError:
            shared = None
        self._shared = shared
        self.missed: list[str] = []

    @property
    def exits_itself(self) -> bool:
        """True when this section must exit 1 on a miss (no tools/floors.py)."""
        return self._shared is None

    def floor(self, label: str, value: float, minimum: float) -> bool:
        """Print `label: value x, needs >= minimum x  ok|MISSED` and record a miss."""
        if self._shared is not None:
            holds = self._shared.floor(label, value, minimum)
        else:
            holds = value >= minimum
            print(f"  floor   {label}: {value:.2f}x, needs >= {minimum:g}x  {'ok' if holds else 'MISSED'}")
        if not holds:
            self.missed.append(label)
        return holds


def run(args) -> None:
    """Measure and print the GPU section; SystemExit(1) after printing if a floor is missed."""
    from pagedkv import KvCacheConfig, PagedKvCache
    from pagedkv.driver import CudaBackend, is_available

    if not is_available():
        print("[gpu] no CUDA driver or GPU on this machine: section skipped")
        return
    quick = getattr(args, "quick", False)
    reps = 3 if quick else 10
    loop_reps = 1 if quick else 3
    with CudaBackend() as gpu:
        print(f"device: {gpu.device_name}, sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}, {gpu.sm_count} SMs")
        config = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=128, num_layers=64, dtype="bf16")
        cache = PagedKvCache(config, FILL_BLOCKS + COPY_PAIRS, gpu)
        cache.alloc_blocks(FILL_BLOCKS + COPY_PAIRS)  # only held blocks may be written
        stream = gpu.create_stream()
        timer = EventTimer(stream)
        floors = Floors()
        try:
            _bench(gpu, cache, config, stream, timer, floors, reps, loop_reps)
        finally:
            timer.close()
            gpu.destroy_stream(stream)
            cache.release(gpu)
    if floors.missed and floors.exits_itself:
        print(f"[gpu] floors missed: {', '.join(floors.missed)}")
        sys.exit(1)


def _bench(gpu, cache, config, stream, timer, floors, reps, loop_reps) -> None:
    side = config.k_block_bytes_for_layer(0)
    per_block = config.block_bytes_kv_all_layers()
    blocks = list(range(FILL_BLOCKS))
    fill_bytes = per_block * FILL_BLOCKS

    # the ceiling: one large device-to-device copy
    big_src, big_dst = gpu.alloc(GIB), gpu.alloc(GIB)
    try:
        gpu.memset_async(big_src, 0, GIB, stream)
        ceiling_ms = timer.time(lambda: gpu.copy_d2d(big_src, big_dst, GIB, stream), reps)
    finally:
        gpu.free(big_dst)
    ceiling = _gbps(copy_traffic(GIB), ceiling_ms)
    print(
        f"copy ceiling: one {GIB / 2**30:g} GiB cuMemcpyDtoD      {ceiling_ms:9.3f} ms  {ceiling:8.1f} GB/s"
        f" DRAM (read + write: {copy_traffic(GIB) / 2**30:g} GiB moved)"
    )

    # fill: the seed's loop vs the batched kernel
    def memset_loop() -> None:
        for layer in range(config.num_layers):
            k_pool, v_pool = cache.k_pool_ptr(layer), cache.v_pool_ptr(layer)
            for block in blocks:
                gpu.memset_async(k_pool.offset(block * side), 0, side, stream)
                gpu.memset_async(v_pool.offset(block * side), 0, side, stream)

    loop_ms = timer.time(memset_loop, loop_reps)
    fill_ms = timer.time(lambda: cache.fill_blocks(blocks, 0, gpu, stream), reps)
    ratio = loop_ms / fill_ms
    print(f"fill {FILL_BLOCKS} blocks x {config.num_layers} layers x K,V ({fill_bytes / 2**30:.3g} GiB):")
    print(f"  per-block cuMemsetD8Async loop          {loop_ms:9.3f} ms  {FILL_BLOCKS / loop_ms * 1e3:10.0f} blocks/s  {_gbps(fill_bytes, loop_ms):8.1f} GB/s")
    print(f"  batched fill kernel                     {fill_ms:9.3f} ms  {FILL_BLOCKS / fill_ms * 1e3:10.0f} blocks/s  {_gbps(fill_bytes, fill_ms):8.1f} GB/s")
    print(f"  kernel / loop                           {ratio:9.1f}x")
    floors.floor(f"batched fill vs per-layer memset loop at {FILL_BLOCKS} blocks", ratio, FILL_RATIO_FLOOR)

    # block copy (copy-on-write)
    pairs = [(b, FILL_BLOCKS + b) for b in range(COPY_PAIRS)]
    copy_ms = timer.time(lambda: cache.copy_blocks(pairs, gpu, stream), reps)
    copy_bytes = per_block * COPY_PAIRS
    print(
        f"copy {COPY_PAIRS} block pairs ({copy_bytes / 2**30:.3g} GiB)          {copy_ms:9.3f} ms"
        f"  {_gbps(copy_traffic(copy_bytes), copy_ms):8.1f} GB/s DRAM (read + write)"
    )

    # checksum of 1 GiB of BF16 KV: one region of 32 KiB blocks, one reduction
    try:
        rng = np.random.default_rng(0)
        chunk = rng.integers(0, 1 << 16, 8 << 20, dtype=np.uint16) & 0xBFFF  # finite BF16 bit patterns
        for at in range(0, GIB, chunk.nbytes):
            gpu.copy_h2d(chunk, big_src.offset(at))
        regions = gpu.create_block_regions([(int(big_src), side, side)])
        all_blocks = np.arange(GIB // side)
        sum_ms = timer.time(lambda: gpu.reduce_bf16_blocks(regions, 0, all_blocks, stream), reps)
        gpu.destroy_block_regions(regions)
    finally:
        gpu.free(big_src)
    print(f"checksum of {GIB / 2**30:g} GiB BF16 (sum, ssq, sabs)  {sum_ms:9.3f} ms  {_gbps(GIB, sum_ms):8.1f} GB/s")

    probe_ms = timer.time(
        lambda: [
            gpu.reduce_bf16_blocks(cache.block_regions(), cache.region_index(layer, s), blocks, stream)
            for layer in range(config.num_layers)
            for s in ("K", "V")
        ],
        max(1, reps // 3),
    )
    print(f"  per-layer probe, 128 reductions of {FILL_BLOCKS} blocks {probe_ms:9.3f} ms  {_gbps(fill_bytes, probe_ms):8.1f} GB/s (no floor: one synchronous call per layer and side)")

    print("as a fraction of the copy ceiling: DRAM traffic (fill writes, copy reads + writes, checksum reads) per second")
    for label, traffic, ms in (
        ("fill", fill_bytes, fill_ms),
        ("copy", copy_traffic(copy_bytes), copy_ms),
        ("checksum", GIB, sum_ms),
    ):
        fraction = _gbps(traffic, ms) / ceiling
        print(f"  {label:<9} {fraction * 100:6.1f}%")
        floors.floor(f"{label} vs measured DRAM bandwidth", fraction, FLOORS_OF_BANDWIDTH[label])

    _bench_host_io(gpu, cache, config, side, reps)


def _bench_host_io(gpu, cache, config, side, reps) -> None:
    """read_block/write_block over HOST_IO_BLOCKS blocks of every layer, pageable vs pinned host memory."""
    blocks = range(min(HOST_IO_BLOCKS, FILL_BLOCKS + COPY_PAIRS))
    nbytes = 2 * side * config.num_layers * len(blocks)
    pageable_k = np.full(side, 7, np.uint8)
    pageable_v = np.full(side, 9, np.uint8)
    pin = gpu.alloc_pinned(2 * side)
    timer = EventTimer(0)
    try:
        pin.array[:] = 5
        pin_k, pin_v = pin.array[:side], pin.array[side:]

        def write(k, v) -> Callable[[], None]:
            def work() -> None:
                for layer in range(config.num_layers):
                    for block in blocks:
                        cache.write_block(layer, block, k, v, gpu)
            return work

        def read_pageable() -> None:
            for layer in range(config.num_layers):
                for block in blocks:
                    cache.read_block(layer, block, gpu)

        def read_pinned() -> None:
            for layer in range(config.num_layers):
                for block in blocks:
                    gpu.copy_d2h(cache.k_cache_ptr(layer, block), pin_k)
                    gpu.copy_d2h(cache.v_cache_ptr(layer, block), pin_v)

        rows = [
            ("write_block from pageable", write(pageable_k, pageable_v)),
            ("write_block from pinned", write(pin_k, pin_v)),
            ("read_block into pageable", read_pageable),
            ("read_block into pinned (copy_d2h)", read_pinned),
        ]
        print(f"host I/O, {len(blocks)} blocks x {config.num_layers} layers x K,V of {side // 1024} KiB:")
        for label, work in rows:
            ms = timer.time(work, max(1, reps // 3))
            print(f"  {label:<36}  {ms:9.3f} ms  {_gbps(nbytes, ms):8.1f} GB/s")
    finally:
        timer.close()
        pin.free()
