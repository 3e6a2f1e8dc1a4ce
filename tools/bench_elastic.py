"""Elastic pools benchmark: what mapping costs and what the elastic allocator costs when it
maps nothing, each beside its baseline in one run (best of several repeats).

- map_chunk / unmap_chunk per chunk vs alloc / free of the same bytes on the same backend;
- alloc_block+free_block pairs and alloc_blocks(64)+free_blocks of an elastic cache whose
  blocks are all resident vs the same calls on a cache that is not elastic (ceiling 1.2x);
- memory after a burst: free bytes (mem_info) before, at the peak and after free + shrink.

On HostBackend by default; with `--gpu` the same on CudaBackend (device 0), whose figures
come from cuMemGetInfo and the driver's own map/unmap.
"""

from __future__ import annotations

import time

from floors import ceiling
from timing import alloc_free_pairs, best_of
from pagedkv import HostBackend, KvCacheConfig, PagedKvCache

ALLOC_CEILING = 1.2
"""An elastic cache's alloc path with nothing to map may cost at most this times the non-elastic one."""




def _backend(gpu_flag: bool):
    if gpu_flag:
        from pagedkv.driver import CudaBackend

        return CudaBackend()
    return HostBackend(capacity_bytes=8 << 30, vmm_granularity=2 << 20)


def _map_unmap(gpu, chunks: int, repeats: int) -> None:
    g = gpu.vmm_granularity()
    base = gpu.reserve_address(chunks * g)

    def map_all():
        for i in range(chunks):
            gpu.map_chunk(base.offset(i * g), g)

    def unmap_all():
        for i in range(chunks):
            gpu.unmap_chunk(base.offset(i * g), g)

    t_map = t_unmap = float("inf")
    for _ in range(repeats):
        t_map = min(t_map, best_of(map_all, 1))
        t_unmap = min(t_unmap, best_of(unmap_all, 1))
    gpu.release_address(base)
    ptrs: list = []
    t_alloc = t_free = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        ptrs = [gpu.alloc(g) for _ in range(chunks)]
        t_alloc = min(t_alloc, time.perf_counter() - start)
        start = time.perf_counter()
        for p in ptrs:
            gpu.free(p)
        t_free = min(t_free, time.perf_counter() - start)
    per = 1e6 / chunks
    print(
        f"  map_chunk   {t_map * per:8.1f} us/chunk of {g >> 10} KiB   (alloc {t_alloc * per:8.1f} us: {t_map / t_alloc:5.2f}x)\n"
        f"  unmap_chunk {t_unmap * per:8.1f} us/chunk              (free  {t_free * per:8.1f} us: {t_unmap / t_free:5.2f}x)"
    )


def _caches(gpu, num_blocks: int):
    config = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=128, num_layers=2, dtype="bf16")
    plain = PagedKvCache(config, num_blocks, gpu)
    elastic = PagedKvCache(config, num_blocks, gpu, elastic=True)
    elastic.reserve(num_blocks, gpu)  # everything resident: the alloc path maps nothing
    return plain, elastic


def _alloc_path(gpu, pairs: int, batches: int, repeats: int) -> None:
    plain, elastic = _caches(gpu, 1024)

    def batch(cache):
        def run():
            alloc, free = cache.alloc_blocks, cache.free_blocks
            for _ in range(batches):
                free(alloc(64))
        return run

    t = {name: float("inf") for name in ("pp", "pe", "bp", "be")}
    for _ in range(repeats):  # interleaved, so both sides see the same machine
        t["pp"] = min(t["pp"], best_of(alloc_free_pairs(plain, pairs), 1))
        t["pe"] = min(t["pe"], best_of(alloc_free_pairs(elastic, pairs), 1))
        t["bp"] = min(t["bp"], best_of(batch(plain), 1))
        t["be"] = min(t["be"], best_of(batch(elastic), 1))
    print(
        f"  alloc_block+free_block  non-elastic {t['pp'] / pairs * 1e9:6.0f} ns   elastic {t['pe'] / pairs * 1e9:6.0f} ns per pair\n"
        f"  alloc_blocks(64)+free   non-elastic {t['bp'] / batches / 64 * 1e9:6.0f} ns   elastic {t['be'] / batches / 64 * 1e9:6.0f} ns per block"
    )
    ceiling("elastic vs non-elastic alloc+free pair (resident)", t["pe"] / t["pp"], ALLOC_CEILING)
    ceiling("elastic vs non-elastic alloc_blocks(64)+free_blocks (resident)", t["be"] / t["bp"], ALLOC_CEILING)
    plain.release(gpu)
    elastic.release(gpu)


def _burst(gpu, num_blocks: int) -> None:
    config = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=128, num_layers=4, dtype="bf16")
    cache = PagedKvCache(config, num_blocks, gpu, elastic=True)
    free0, _ = gpu.mem_info()
    base = cache.alloc_blocks(num_blocks // 16)
    free_base, _ = gpu.mem_info()
    burst = cache.alloc_blocks(num_blocks - len(base))
    free_peak, _ = gpu.mem_info()
    cache.free_blocks(burst)
    start = time.perf_counter()
    returned = cache.shrink(gpu)
    t_shrink = time.perf_counter() - start
    free_after, _ = gpu.mem_info()
    mib = 1 << 20
    print(
        f"  burst of {len(burst)} blocks over {len(base)} kept ({config.block_bytes_kv_all_layers() >> 10} KiB a block "
        f"in all layers, {cache.pools().step_blocks()} blocks a mapping step)\n"
        f"  free before {free0 / mib:10.1f} MiB, with the base {free_base / mib:10.1f} MiB, at the peak {free_peak / mib:10.1f} MiB, "
        f"after free+shrink {free_after / mib:10.1f} MiB\n"
        f"  shrink returned {returned / mib:.1f} MiB in {t_shrink * 1e3:.1f} ms "
        f"({(free_after - free_peak) / mib:.1f} MiB by mem_info; the burst mapped {(free_base - free_peak) / mib:.1f} MiB)"
    )
    cache.release(gpu)


def run(args) -> None:
    """Print the three elastic measurements; `args.quick` runs fewer repetitions."""
    quick = getattr(args, "quick", False)
    gpu = _backend(getattr(args, "gpu", False))
    kind = type(gpu).__name__
    print(f"  backend: {kind}, granularity {gpu.vmm_granularity() >> 10} KiB")
    _map_unmap(gpu, 16 if quick else 64, 2 if quick else 5)
    _alloc_path(gpu, 5_000 if quick else 50_000, 100 if quick else 1_000, 3 if quick else 7)
    _burst(gpu, 512 if quick else 2048)
    close = getattr(gpu, "close", None)
    if close is not None:
        close()
