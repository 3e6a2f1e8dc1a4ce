"""Disk-tier section of tools/bench.py (`--section disk`): demotion and promotion GB/s of a
DiskTier beside this machine's sequential file write and read ceiling measured in the same
run and directory, the restart time of a directory of 100k cached blocks, and per tier
format the compression ratio and encode/decode GB/s (HostTier(format=...) on HostBackend,
the host codecs; on a GPU the same swaps run the KV row kernels), plus zstd on BF16.

- ceiling: one file of as many distinct bytes as the tier's written sequentially in 1 MiB
  writes then fsynced,
  and read back in 1 MiB reads after its pages were dropped from the page cache
  (posix_fadvise DONTNEED on that file only);
- demote: host blocks written into disk slots through the tier's I/O thread (staging copy,
  XXH3 checksum, pwritev, index append; a write queue the size of the batch), then fsynced:
  bytes / time, floor 70% of the write ceiling;
- promote: the slots' pages dropped likewise, then read back into host blocks in batches
  of 64 (preadv into the rows, checksums verified): floor 70% of the read ceiling;
- restart: `PrefixCache(..., disk_tier=DiskTier(dir))` over an index of 100k blocks (1,000
  chains of 100) until its chains match: ceiling 2 s.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np

from floors import ceiling, floor

FLOOR_OF_CEILING = 0.70
RESTART_BLOCKS = 100_000
RESTART_SECONDS = 2.0
MIB = 1 << 20
ROUNDS = 5
"""Interleaved rounds of ceiling and tier figures; the best of each is compared. Page-cache
writes on a shared virtual machine vary tenfold from one second to the next (128 MiB took
0.03 s, then 0.35 s, in back-to-back runs here), so one round of each compares two
moments, not two code paths."""


def _drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _ceilings(directory: str, nbytes: int) -> tuple[float, float]:
    path = os.path.join(directory, "ceiling.bin")
    # distinct bytes, as the tier writes (one 1 MiB chunk written again and again is read from
    # the CPU's caches, not memory: a ceiling no tier of nbytes of KV could reach)
    data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for at in range(0, nbytes - nbytes % MIB, MIB):
        os.write(fd, data[at : at + MIB])
    os.fsync(fd)
    os.close(fd)
    write = nbytes / (time.perf_counter() - start)
    _drop_pages(path)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, MIB):
        pass
    os.close(fd)
    read = nbytes / (time.perf_counter() - start)
    os.remove(path)
    return write, read


def _tiers(directory: str, blocks: int, layers: int):
    from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
    from pagedkv.tiers.disk_tier import DiskTier
    from pagedkv.tiers.host_tier import HostTier

    gpu = HostBackend(capacity_bytes=4 << 30)
    config = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=128, num_layers=layers, dtype="bf16")
    cache = PagedKvCache(config, 4, gpu)
    tier = HostTier(cache, blocks, gpu)
    disk = DiskTier(directory, blocks * tier.block_bytes() + 4096, queue_blocks=blocks)  # the batch fits the queue
    disk.bind(tier)
    rng = np.random.default_rng(1)
    for m in tier._memories:
        m.array[:] = rng.integers(0, 256, m.array.size, dtype=np.uint8)
    return gpu, cache, tier, disk


def _demote(tier, disk, blocks: int) -> tuple[float, list[int]]:
    from pagedkv.tiers.disk_index import IndexRecord

    slots = []
    start = time.perf_counter()
    for h in range(blocks):
        slot = disk.alloc_slot()
        while slot is None:  # every staging slot busy (not with a queue of the batch): the engine would skip
            disk.poll()
            time.sleep(0.001)
            slot = disk.alloc_slot()
        meta = IndexRecord(slot, 0, 0, 0, h + 1, 0, 0, h.to_bytes(8, "little") * 16)
        disk.write(slot, tier.block_rows(h), meta)
        slots.append(slot)
    disk.flush()
    os.fsync(disk._io._slots_fd)
    seconds = time.perf_counter() - start
    return blocks * tier.block_bytes() / seconds, slots


def _promote(tier, disk, slots: list[int]) -> float:
    from pagedkv.tiers.disk_layout import SLOTS_FILE

    _drop_pages(os.path.join(disk.directory(), SLOTS_FILE))
    start = time.perf_counter()
    for at in range(0, len(slots), 64):
        batch = slots[at : at + 64]
        ok = disk.read(batch, [tier.block_rows(h) for h in range(at, at + len(batch))])
        assert all(ok), "a block failed its checksum"
    return len(slots) * tier.block_bytes() / (time.perf_counter() - start)


def _restart(directory: str, blocks: int) -> float:
    from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache
    from pagedkv.sequences.hashing import chain_digest, root_hash
    from pagedkv.tiers import disk_index, disk_layout
    from pagedkv.tiers.disk_tier import DiskTier
    from pagedkv.tiers.host_tier import HostTier

    gpu = HostBackend(capacity_bytes=1 << 28)
    config = KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(config, 8, gpu)
    tier = HostTier(cache, 8, gpu)
    layout = disk_layout.describe(tier.rows(), 16, False, None, None)
    fingerprint = disk_layout.fingerprint(layout)
    os.makedirs(directory)
    disk_layout.write_layout(directory, layout, blocks)
    chain = 100
    parts = [disk_index.header(fingerprint)]
    root = root_hash(0)
    for c in range(blocks // chain):
        parent = root
        for j in range(chain):
            tokens = np.arange(16, dtype="<i8") + (c * chain + j) * 16
            key = tokens.tobytes()
            digest = int.from_bytes(chain_digest(parent.to_bytes(8, "little"), key), "little")
            parts.append(disk_index.encode(disk_index.IndexRecord(c * chain + j, 2048, 0, 0, digest, parent, 0, key)))
            parent = digest
    with open(os.path.join(directory, disk_layout.INDEX_FILE), "wb") as f:
        f.write(b"".join(parts))
    with open(os.path.join(directory, disk_layout.SLOTS_FILE), "wb") as f:
        f.truncate(blocks * layout["slot_bytes"])
    start, cpu = time.perf_counter(), time.process_time()
    disk = DiskTier(directory)
    prefix = PrefixCache(cache, host_tier=tier, disk_tier=disk)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    probe = [int(t) for t in np.arange(chain * 16 + 1) + (blocks // chain - 1) * chain * 16]
    found = prefix.match(probe)
    assert found.disk_num_tokens == chain * 16, found
    prefix.close()
    disk.close()
    tier.release(gpu)
    cache.release(gpu)
    return seconds, cpu


def _formats(quick: bool) -> None:
    from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
    from pagedkv.tiers.host_tier import HostTier
    from timing import best_of

    gpu = HostBackend(capacity_bytes=1 << 30)
    config = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=128, num_layers=2, dtype="bf16")
    blocks = 8 if quick else 32
    cache = PagedKvCache(config, blocks, gpu)
    held = cache.alloc_blocks(blocks)
    rng = np.random.default_rng(2)
    for layer in range(2):
        x = rng.normal(size=(2, blocks * 16, 8, 128)).astype(np.float32)
        cache.write_tokens(layer, np.arange(blocks * 16), x[0], x[1], gpu, 0)
    raw = blocks * config.block_bytes_kv_all_layers()
    print(f"  tier formats of a BF16 cache ({blocks} blocks x 2 layers, 8 x 128, block 16; host codecs, "
          "GB/s of BF16 bytes):")
    for fmt in ("fp8", "nvfp4", "turbo8", "turbo4", "turbo4k_turbo3v", "turbo3", "turbo2"):
        tier = HostTier(cache, blocks, gpu, format=fmt, staging_blocks=blocks)
        hosts = tier.alloc(blocks)
        down = best_of(lambda: tier.swap_out(held, hosts, 0).wait(), 1 if quick else 3)
        back = best_of(lambda: tier.swap_in(hosts, held, 0).wait(), 1 if quick else 3)
        print(f"    {fmt:<16} ratio {raw / (blocks * tier.block_bytes()):5.2f}x  encode {raw / down / 1e9:6.3f} GB/s  "
              f"decode {raw / back / 1e9:6.3f} GB/s")
        tier.release(gpu)
    try:
        import zstandard
    except ImportError:
        print("    zstd: not installed (pip install 'pagedkv[zstd]')")
    else:
        data = np.concatenate([cache.read_block(layer, b, gpu)[0] for b in held for layer in range(2)]).tobytes()
        packed = zstandard.ZstdCompressor(level=1).compress(data)
        down = best_of(lambda: zstandard.ZstdCompressor(level=1).compress(data), 1 if quick else 3)
        back = best_of(lambda: zstandard.ZstdDecompressor().decompress(packed), 1 if quick else 3)
        print(f"    {'bf16 + zstd':<16} ratio {len(data) / len(packed):5.2f}x  encode {len(data) / down / 1e9:6.3f} GB/s  "
              f"decode {len(data) / back / 1e9:6.3f} GB/s  (lossless; model-shaped normal values)")
    cache.free_blocks(held)
    cache.release(gpu)


def _round(root: str, k: int, blocks: int, layers: int) -> tuple[float, float, float, float, int]:
    """One round: the file ceilings, then a fresh tier's demotion and promotion, in one
    directory: (write ceiling, read ceiling, demote, promote) in bytes/s, and the bytes moved."""
    gpu, cache, tier, disk = _tiers(os.path.join(root, f"tier{k}"), blocks, layers)
    try:
        nbytes = blocks * tier.block_bytes()
        write_ceiling, read_ceiling = _ceilings(root, nbytes)
        demote, slots = _demote(tier, disk, blocks)
        promote = _promote(tier, disk, slots)
    finally:
        disk.close()
        tier.release(gpu)
        cache.release(gpu)
    shutil.rmtree(os.path.join(root, f"tier{k}"), ignore_errors=True)
    return write_ceiling, read_ceiling, demote, promote, nbytes


def run(args) -> None:
    """Measure and print the disk section."""
    quick = getattr(args, "quick", False)
    blocks, layers = (16, 4) if quick else (256, 8)
    rounds = 1 if quick else ROUNDS
    root = tempfile.mkdtemp(prefix="pagedkv-bench-disk-", dir=os.environ.get("PAGEDKV_BENCH_DIR"))
    try:
        results = [_round(root, k, blocks, layers) for k in range(rounds)]
        write_ceiling, read_ceiling, demote, promote = (max(r[i] for r in results) for i in range(4))
        print(f"  disk tier: {blocks} blocks of {results[0][4] // blocks // 1024} KiB ({results[0][4] / MIB:.0f} MiB) "
              f"in {root}; best of {rounds} interleaved rounds (ceiling, demote, promote in each)")
        for k, (w, r, d, p, _) in enumerate(results):
            print(f"    round {k}: write {w / 1e9:6.3f} read {r / 1e9:6.3f} demote {d / 1e9:6.3f} promote {p / 1e9:6.3f} GB/s")
        print(f"  sequential file write {write_ceiling / 1e9:6.3f} GB/s, read {read_ceiling / 1e9:6.3f} GB/s (ceiling)")
        print(f"  demote host -> disk   {demote / 1e9:6.3f} GB/s = {demote / write_ceiling:.2f}x the write ceiling")
        print(f"  promote disk -> host  {promote / 1e9:6.3f} GB/s = {promote / read_ceiling:.2f}x the read ceiling")
        floor("disk demote vs sequential write", demote / write_ceiling, FLOOR_OF_CEILING)
        floor("disk promote vs sequential read", promote / read_ceiling, FLOOR_OF_CEILING)
        restart_blocks = RESTART_BLOCKS // 10 if quick else RESTART_BLOCKS
        seconds, cpu = _restart(os.path.join(root, "restart"), restart_blocks)
        print(f"  restart with {restart_blocks} cached blocks: {seconds:.3f} s until its chains match "
              f"({cpu:.3f} s of CPU; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
        ceiling(f"restart of {restart_blocks} blocks / {RESTART_SECONDS:g} s", seconds / RESTART_SECONDS, 1.0)
        _formats(quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)
