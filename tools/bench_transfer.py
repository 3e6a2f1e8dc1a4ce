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
- hybrid 1->2 split HND: a HybridKvTransfer of a hybrid cache of the same layers (even
  layers full, odd layers sliding) plus one Mamba-like state layer, each group's scattered
  pairs and one state slot per rank (replicated, sent whole): its descriptors beside the
  plain 1->2 HND split's (the groups add only the state rows, checked as a ceiling).

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
            split_descs = _layouts_and_splits(gpu, layers, blocks, repeats, copy_gbs, scattered_descs)
            _hybrid_split(gpu, layers, blocks, repeats, copy_gbs, scattered_descs, split_descs)
    finally:
        a.release(gpu)
        b.release(gpu)
        if args.gpu:
            gpu.close()


def _layouts_and_splits(gpu, layers: int, blocks: int, repeats: int, copy_gbs: float, same_descs: int) -> int:
    """The HND same-layout transfer and the 1->2 head splits (HND, NHD) of the scattered
    pairs; returns the 1->2 HND split's descriptor count."""
    split_descs = 0
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
                        split_descs = sum(descs)
                for a in agents[1:]:
                    a.notifications()
            finally:
                for a in agents:
                    a.close()
    finally:
        for c in caches:
            c.release(gpu)
    return split_descs


STATE = (((8, 64, 16), "float32"),)
"""The hybrid bench's state layer: one 32 KiB float32 tensor a slot (a Mamba-2-like SSM state)."""


def _hybrid_split(gpu, layers: int, blocks: int, repeats: int, copy_gbs: float, same_descs: int,
                  split_descs: int) -> None:
    """A HybridKvTransfer 1->2 HND split of the scattered pairs in every attention group and one state slot."""
    from pagedkv.core.layer_groups import LayerGroup
    from pagedkv.tiers.hybrid_transfer import HybridKvTransfer

    groups = (LayerGroup("full", tuple(range(0, layers, 2))),
              LayerGroup("sliding", tuple(range(1, layers, 2)), window=16 * blocks),
              LayerGroup("state", (layers,), state=STATE))

    def cache(heads: int, rank: int, size: int) -> PagedKvCache:
        config = KvCacheConfig(block_size=16, num_kv_heads=heads, head_dim=128, num_layers=layers + 1, dtype="bf16",
                               layout="HND", tp_rank=rank, tp_size=size, layer_groups=groups)
        made = PagedKvCache(config, blocks, gpu, num_state_slots=2)
        for g in range(3):
            made.group(g).alloc_blocks(blocks if g < 2 else 1)
        return made

    caches = [cache(8, 0, 1)] + [cache(4, r, 2) for r in range(2)]
    agents = []
    try:
        agents = [HybridKvTransfer(c, gpu, f"bench-hybrid-{i}") for i, c in enumerate(caches)]
        names = [agents[0].connect(a.metadata()) for a in agents[1:]]
        for a in agents[1:]:
            a.connect(agents[0].metadata())
        half, dst = list(range(0, blocks, 2)), list(range(blocks - 1, -1, -1))[: blocks // 2]
        src_ids, dst_ids = {0: half, 1: half, 2: [0]}, {0: dst, 1: dst, 2: [0]}
        descs: list[int] = []

        def send() -> None:
            handles = [agents[0].send(p, src_ids, dst_ids) for p in names]
            for h in handles:
                h.wait(60)
            descs[:] = [sum(x.descriptors for x in h.handles.values()) for h in handles]

        send()
        seconds = best_of(send, repeats)
        nbytes = blocks // 2 * sum(caches[0].group(g).config().block_bytes_kv_all_layers() for g in (0, 1))
        nbytes += 2 * caches[0].layout().slot_bytes(2)
        gbs = nbytes / seconds / 1e9
        print(f"  hybrid 1->2 split {gbs:8.2f} GB/s  ({sum(descs)} descriptors = {sum(descs) / same_descs:.2f}x the "
              f"same-layout transfer, {sum(descs) / split_descs:.3f}x the plain 1->2 HND split; "
              f"{seconds * 1e3:.2f} ms)  = {gbs / copy_gbs:.2f}x the backend copy")
        ceiling("hybrid 1->2 HND split descriptors vs the plain split", sum(descs) / split_descs,
                1 + 2 / split_descs)
        for a in agents[1:]:
            a.notifications()
    finally:
        for a in agents:
            a.close()
        for c in caches:
            c.release(gpu)
