"""KV section of tools/bench.py (`--section kv`, a GPU section): the device KV row kernels
(kv_rows.cu) per side format, timed with CUDA events, beside the measured DRAM bandwidth
and the host-staged path they replace.

A decode step writes 256 tokens of 8 KV heads x head_dim 128 into each of 32 layers (one
write_tokens per layer); a prefill writes 32,768 tokens into one layer; a read decodes the
prefill's slots to BF16; a checksum reduces both sides of the prefill layer's blocks
exactly on the device (`reduce_kv_blocks`, what debug_kv_checksum_per_layer runs per side).
GB/s count DRAM bytes: the BF16 rows read, the data and scale rows written, the int64 slots
read (a read the reverse; a checksum reads the stored bytes and the int32 block list).
Floors (issue 10): bf16 and fp8 prefill writes >= 70% of the bandwidth, nvfp4 and turbo
>= 40%, checksums >= 70%; the device decode step >= 20x the host-staged one. `--quick` shrinks every size (a smoke run: over the libcuda stub the
figures are the CPU harness's, not a GPU's, and the floors say nothing).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from bench_gpu import EventTimer, _gbps, copy_traffic
from floors import floor

SIDE_FORMATS = ("bf16", "fp8", "nvfp4", "turbo4", "turbo3", "turbo2", "turbo8")
HEADS, HEAD_DIM, BLOCK = 8, 128, 16
FULL = {"decode_tokens": 256, "layers": 32, "prefill_tokens": 32768, "bandwidth_bytes": 1 << 30, "reps": 10, "warmup": 1}
QUICK = {"decode_tokens": 4, "layers": 1, "prefill_tokens": 16, "bandwidth_bytes": 1 << 16, "reps": 1, "warmup": 0}
"""A smoke run's sizes: one layer, one block, no warm-up (the CPU harness runs a turbo row
kernel at well under a thousandth of a GPU's speed)."""
WRITE_FLOORS = {"bf16": 0.70, "fp8": 0.70}
"""Prefill write traffic as a fraction of DRAM bandwidth; the other formats need 0.40."""
STAGED_RATIO_FLOOR = 20.0
CHECKSUM_FLOOR = 0.70
"""Checksum read traffic as a fraction of DRAM bandwidth, every format."""


def run(args) -> None:
    """Measure and print the KV section (skipped without a CUDA driver)."""
    from pagedkv.driver import CudaBackend, is_available

    if not is_available():
        print("[kv] no CUDA driver or GPU on this machine: section skipped")
        return
    sizes = QUICK if getattr(args, "quick", False) else FULL
    with CudaBackend() as gpu:
        print(f"device: {gpu.device_name}, {gpu.sm_count} SMs"
              + ("  (libcuda stub: CPU harness figures, not a GPU's)" if "stub" in gpu.device_name else ""))
        stream = gpu.create_stream()
        timer = EventTimer(stream)
        try:
            bandwidth = _bandwidth(gpu, stream, timer, sizes)
            print(f"DRAM bandwidth (cuMemcpyDtoD of {sizes['bandwidth_bytes'] >> 20} MiB): {bandwidth:8.1f} GB/s")
            print(f"{'format':<8} {'decode ms':>10} {'staged ms':>10} {'x staged':>9} {'prefill GB/s':>13} "
                  f"{'of DRAM':>8} {'read GB/s':>10} {'sum GB/s':>9} {'of DRAM':>8}")
            for fmt in SIDE_FORMATS:
                _bench_format(gpu, stream, timer, fmt, sizes, bandwidth)
        finally:
            timer.close()
            gpu.destroy_stream(stream)


def _bandwidth(gpu, stream, timer, sizes) -> float:
    n = sizes["bandwidth_bytes"]
    a, b = gpu.alloc(n), gpu.alloc(n)
    try:
        ms = timer.time(lambda: gpu.copy_d2d(a, b, n, stream), sizes["reps"], sizes["warmup"])
    finally:
        gpu.free(a)
        gpu.free(b)
    return _gbps(copy_traffic(n), ms)


def _device_rows(gpu, tokens, rng):
    from pagedkv import DeviceArray

    host = rng.normal(size=(tokens, HEADS, HEAD_DIM)).astype(ml_dtypes.bfloat16)
    ptr = gpu.alloc(host.nbytes)
    gpu.copy_h2d(host.view(np.uint16), ptr)
    return host, DeviceArray(ptr, host.shape, "bfloat16")


def _bench_format(gpu, stream, timer, fmt, sizes, bandwidth) -> None:
    from pagedkv import DeviceArray, KvCacheConfig, PagedKvCache
    from pagedkv.core.dtype import KvCacheDtype, side_bytes

    rng = np.random.default_rng(0)
    decode, layers, prefill, reps = sizes["decode_tokens"], sizes["layers"], sizes["prefill_tokens"], sizes["reps"]
    blocks = -(-prefill // BLOCK)
    config = KvCacheConfig(block_size=BLOCK, num_kv_heads=HEADS, head_dim=HEAD_DIM, num_layers=layers, dtype=fmt)
    cache = PagedKvCache(config, blocks, gpu)
    cache.alloc_blocks(blocks)
    owned = []
    try:
        host_k, k = _device_rows(gpu, prefill, rng)
        host_v, v = _device_rows(gpu, prefill, rng)
        slots_host = rng.permutation(blocks * BLOCK)[:prefill].astype(np.int64)
        slots_ptr = gpu.alloc(slots_host.nbytes)
        gpu.copy_h2d(slots_host, slots_ptr)
        outs = [gpu.alloc(prefill * HEADS * HEAD_DIM * 2) for _ in range(2)]
        owned = [k.ptr, v.ptr, slots_ptr, *outs]
        slots = DeviceArray(slots_ptr, (prefill,), "int64")
        step_k = DeviceArray(k.ptr, (decode, HEADS, HEAD_DIM), "bfloat16")
        step_v = DeviceArray(v.ptr, (decode, HEADS, HEAD_DIM), "bfloat16")
        step_slots = DeviceArray(slots_ptr, (decode,), "int64")

        def step() -> None:
            for layer in range(layers):
                cache.write_tokens(layer, step_slots, step_k, step_v, gpu, stream)

        def staged() -> None:
            for layer in range(layers):
                cache.write_tokens(layer, slots_host[:decode], host_k[:decode], host_v[:decode], gpu, stream)

        warmup = sizes["warmup"]
        decode_ms = timer.time(step, reps, warmup)
        staged_ms = timer.time(staged, 1, warmup=0)
        prefill_ms = timer.time(lambda: cache.write_tokens(0, slots, k, v, gpu, stream), reps, warmup)
        out_k, out_v = (DeviceArray(o, (prefill, HEADS, HEAD_DIM), "bfloat16") for o in outs)
        read_ms = timer.time(lambda: cache.read_tokens(0, slots, gpu, out_k=out_k, out_v=out_v, stream=stream), reps,
                             warmup)
        n = HEADS * HEAD_DIM
        side_fmt = KvCacheDtype.parse(fmt)
        stored = 2 * side_bytes(side_fmt, prefill * n)
        traffic = 2 * prefill * n * 2 + stored + 8 * prefill
        write_gbps, read_gbps = _gbps(traffic, prefill_ms), _gbps(traffic, read_ms)
        pools, all_blocks = cache.pools(), np.arange(blocks, dtype=np.int64)

        def checksum() -> None:
            for side in "KV":
                gpu.reduce_kv_blocks(pools.regions(), pools.region_index(0, side), all_blocks, side_fmt, BLOCK, n, stream)

        checksum_ms = timer.time(checksum, reps, warmup)
        checksum_gbps = _gbps(2 * side_bytes(side_fmt, blocks * BLOCK * n) + 2 * 4 * blocks, checksum_ms)
        ratio = staged_ms / decode_ms
        print(f"{fmt:<8} {decode_ms:10.3f} {staged_ms:10.3f} {ratio:8.1f}x {write_gbps:13.1f} "
              f"{write_gbps / bandwidth * 100:7.1f}% {read_gbps:10.1f} {checksum_gbps:9.1f} "
              f"{checksum_gbps / bandwidth * 100:7.1f}%")
        floor(f"{fmt} prefill write vs DRAM bandwidth", write_gbps / bandwidth, WRITE_FLOORS.get(fmt, 0.40))
        floor(f"{fmt} device decode step vs host-staged", ratio, STAGED_RATIO_FLOOR)
        floor(f"{fmt} checksum vs DRAM bandwidth", checksum_gbps / bandwidth, CHECKSUM_FLOOR)
    finally:
        gpu.synchronize(stream)
        for p in owned:
            gpu.free(p)
        cache.release(gpu)
