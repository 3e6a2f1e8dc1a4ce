"""KV transfer benchmark: NIXL loopback GB/s between two caches in one process, beside a plain
copy of the same bytes on the same backend in the same run.

Two KvTransfer agents, each over its own cache (BF16, 8 KV heads, head_dim 128, 16-token
blocks: 64 KiB of K and V per block per layer), exchange every layer's K and V of 256 blocks:
- contiguous: block i to block i (one descriptor per pool, runs merged);
- scattered: every other block to the reversed ids (one descriptor per block per pool);
- baseline: `gpu.copy_d2d` of each pool's same bytes (the backend's own device copy).

Then the layouts and TP splits, on the same blocks (the scattered pairs):
- HND scattered: the same transfer between two HND caches (the same descriptors);
- 1->2 split HND: a TP 1 HND cache sends each block's heads [0, 4) to one TP 2 rank and
  [4, 8) to the other (one descriptor per block per pool per rank: at most 2x the
  same-layout transfer, checked as a ceiling);
- 1->2 split NHD: the same from NHD caches (one descriptor per token per block per pool:
  a head range is not contiguous in an NHD block), for comparison.

On HostBackend (DRAM) by default, 8 layers: a smoke figure of UCX over loopback. With
`--gpu`, CudaBackend (VRAM to VRAM on device 0), 32 layers. Needs NIXL
(`pip install --no-deps nixl-cu13==1.5.1`); without it the section says so and measures nothing.
"""

from __future__ import annotations

from floors import ceiling
from timing import best_of
from pagedkv import HostBackend, KvCacheConfig, PagedKvCache

BLOCKS = 256
"""Blocks sent per transfer (the issue's 256 blocks)."""
GPU_LAYERS = 32
"""Layers on a GPU (the issue's 32); the CPU smoke run uses CPU_LAYERS."""
CPU_LAYERS = 8


def _backend(gpu_flag: bool):
    if gpu_flag:
        from pagedkv.driver import CudaBackend

        return CudaBackend(), "CudaBackend (VRAM)"
    return HostBackend(capacity_bytes=8 << 30), "HostBackend (DRAM)"


def _baseline(gpu, a: PagedKvCache, b: PagedKvCache, layers: int, blocks: int) -> None:
    stream = gpu.default_stream()
    for layer in range(layers):
        for pool_a, pool_b, stride in ((a.k_pool_ptr(layer), b.k_pool_ptr(layer), a.pools().k_stride(layer)),
                                       (a.v_pool_ptr(layer), b.v_pool_ptr(layer), a.pools().v_stride(layer))):
            gpu.copy_d2d(pool_a, pool_b, blocks * stride, stream)
    gpu.synchronize(stream)


def run(args) -> None:
    """Print NIXL loopback GB/s (contiguous and scattered) beside the backend's own copy."""
    from pagedkv.tiers.transfer import KvTransfer, NixlUnavailable, load_nixl

    try:
        load_nixl()
    except NixlUnavailable as err:
        print(f"  skipped: {err}")
        return
    layers = GPU_LAYERS if args.gpu else CPU_LAYERS
    blocks = BLOCKS if not args.quick else 32
    repeats = 3 if args.quick else 10
    gpu, kind = _backend(args.gpu)
    config = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=128, num_layers=layers, dtype="bf16")
    a = PagedKvCache(config, blocks, gpu)
    b = PagedKvCache(config, blocks, gpu)
    try:
        src = a.alloc_blocks(blocks)
        dst = b.alloc_blocks(blocks)
        nbytes = blocks * config.block_bytes_kv_all_layers()
        print(f"  backend: {kind}; {blocks} blocks x {layers} layers, {nbytes / 2**20:.0f} MiB a transfer")
        with KvTransfer(a, gpu, "bench-sender") as sender, KvTransfer(b, gpu, "bench-receiver") as receiver:
            peer = sender.connect(receiver.metadata())
            half = src[::2]
            scattered_dst = dst[::-1][: len(half)]

            def contiguous():
                sender.send(peer, src, dst).wait(60)

            def scattered():
                sender.send(peer, half, scattered_dst).wait(60)

            contiguous()  # connection set-up and first-touch outside the timing
            t_contig = best_of(contiguous, repeats)
            t_scatter = best_of(scattered, repeats)
            receiver.notifications()
        t_copy = best_of(lambda: _baseline(gpu, a, b, layers, blocks), repeats)
        copy_gbs = nbytes / t_copy / 1e9
        for label, seconds, moved, descs in (
            ("contiguous", t_contig, nbytes, 2 * layers),
            ("scattered", t_scatter, nbytes // 2, 2 * layers * len(half)),
        ):
            gbs = moved / seconds / 1e9
            print(f"  NIXL {label:<10} {gbs:8.2f} GB/s  ({descs} descriptors, {seconds * 1e3:.2f} ms)"
                  f"  = {gbs / copy_gbs:.2f}x the backend copy")
        print(f"  backend copy_d2d{copy_gbs:8.2f} GB/s  ({t_copy * 1e3:.2f} ms)")
        scattered_descs = 2 * layers * len(half)
        if args.gpu:
            print("  HND and TP splits: skipped (CudaBackend refuses layout='HND': its KV kernels are NHD only)")
        else:
            _layouts_and_splits(gpu, layers, blocks, repeats, copy_gbs, scattered_descs)
    finally:
        a.release(gpu)
        b.release(gpu)
        if args.gpu:
            gpu.close()


def _layouts_and_splits(gpu, layers: int, blocks: int, repeats: int, copy_gbs: float, same_descs: int) -> None:
    """The HND same-layout transfer and the 1->2 head splits (HND, NHD) of the scattered pairs."""
    from pagedkv.tiers.transfer import KvTransfer

    def cache(layout: str, heads: int = 8, rank: int = 0, size: int = 1) -> PagedKvCache:
        config = KvCacheConfig(block_size=16, num_kv_heads=heads, head_dim=128, num_layers=layers, dtype="bf16",
                               layout=layout, tp_rank=rank, tp_size=size)
        made = PagedKvCache(config, blocks, gpu)
        made.alloc_blocks(blocks)
        return made

    caches: list[PagedKvCache] = []
    try:
        for layout in ("HND", "NHD"):
            src = cache(layout)
            caches.append(src)
            nbytes = blocks // 2 * src.config().block_bytes_kv_all_layers()
            half, dst = list(range(0, blocks, 2)), list(range(blocks - 1, -1, -1))[: blocks // 2]
            receivers = [cache("HND")] if layout == "HND" else []
            receivers += [cache(layout, 4, r, 2) for r in range(2)]
            caches += receivers
            agents = [KvTransfer(c, gpu, f"bench-{layout}-{i}") for i, c in enumerate([src] + receivers)]
            try:
                names = [agents[0].connect(a.metadata()) for a in agents[1:]]
                jobs = [("scattered", names[:1])] if layout == "HND" else []
                jobs.append(("1->2 split", names[-2:]))
                for label, peers in jobs:
                    descs = []

                    def send(peers=peers, descs=descs):
                        handles = [agents[0].send(p, half, dst) for p in peers]
                        for h in handles:
                            h.wait(60)
                        descs[:] = [h.descriptors for h in handles]

                    send()
                    seconds = best_of(send, repeats)
                    gbs = nbytes / seconds / 1e9
                    print(f"  {layout} {label:<11} {gbs:8.2f} GB/s  ({sum(descs)} descriptors = "
                          f"{sum(descs) / same_descs:.2f}x the same-layout transfer, {seconds * 1e3:.2f} ms)"
                          f"  = {gbs / copy_gbs:.2f}x the backend copy")
                    if layout == "HND" and label == "1->2 split":
                        ceiling("1->2 HND split descriptors vs same-layout", sum(descs) / same_descs, 2.0)
                for a in agents[1:]:
                    a.notifications()
            finally:
                for a in agents:
                    a.close()
    finally:
        for c in caches:
            c.release(gpu)
