"""DiskTier's own I/O: consecutive slots read in one vectored read with each block's
checksum checked on its own, the index scan stopping at a torn or foreign record, and a
failed index append cut away so later records stay reachable."""

from __future__ import annotations

import os

import numpy as np

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.tiers import disk_index
from pagedkv.tiers.disk_index import IndexRecord
from pagedkv.tiers.disk_layout import INDEX_FILE, SLOTS_FILE
from pagedkv.tiers.disk_tier import DiskTier
from pagedkv.tiers.host_tier import HostTier


def _tiers(tmp_path, **disk_args):
    gpu = HostBackend(capacity_bytes=1 << 26)
    config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=32, num_layers=2, dtype="bf16")
    cache = PagedKvCache(config, 2, gpu)
    tier = HostTier(cache, 8, gpu)
    disk = DiskTier(tmp_path, 16 * 4096, **disk_args)
    disk.bind(tier)
    rng = np.random.default_rng(5)
    for m in tier._memories:
        m.array[:] = rng.integers(0, 256, m.array.size, dtype=np.uint8)
    return gpu, cache, tier, disk


def _write(tier, disk, hosts):
    slots = []
    for h in hosts:
        slot = disk.alloc_slot()
        assert disk.write(slot, tier.block_rows(h), IndexRecord(slot, 0, 0, 0, 100 + h, 7, 0, bytes(32 * h % 256 for _ in range(32))))
        slots.append(slot)
    disk.flush()
    return slots


def test_consecutive_slots_are_one_read_and_each_block_is_checked_alone(tmp_path):
    gpu, cache, tier, disk = _tiers(tmp_path)
    try:
        slots = _write(tier, disk, [0, 1, 2, 3])
        assert slots == [0, 1, 2, 3]
        with open(tmp_path / SLOTS_FILE, "r+b") as f:
            f.seek(2 * 4096 + 5)
            f.write(b"\x00\x01\x02")
        calls = []
        real = disk._io.ops.preadv
        disk._io.ops.preadv = lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off)
        out = [[np.zeros(r.nbytes, np.uint8) for r in tier.block_rows(0)] for _ in slots]
        assert disk.read(slots, out) == [True, True, False, True]
        assert calls == [4 * 4 + 3]  # 4 rows a block, 3 paddings: one call
        for i in (0, 1, 3):
            assert all(np.array_equal(a, b) for a, b in zip(out[i], tier.block_rows(i)))
        assert disk.stats().failed_reads == 1 and disk.stats().reads == 3
    finally:
        disk.close()
        tier.release(gpu)
        cache.release(gpu)


def test_the_scan_stops_at_a_bad_record_and_a_failed_append_is_cut_away(tmp_path):
    gpu, cache, tier, disk = _tiers(tmp_path)
    try:
        _write(tier, disk, [0, 1])
        real = disk._io.ops.pwrite

        def half(fd, data, offset):  # a torn append: half the bytes, then the error
            real(fd, data[: len(data) // 2], offset)
            raise OSError(28, "No space left on device")

        disk._io.ops.pwrite = half
        _write(tier, disk, [2])
        assert disk.stats().failed_writes == 1
        disk._io.ops.pwrite = real
        _write(tier, disk, [3])
    finally:
        disk.close()
        tier.release(gpu)
        cache.release(gpu)
    data = (tmp_path / INDEX_FILE).read_bytes()
    records, end = disk_index.scan(data, 4)
    assert [r.hash for r in records] == [100, 101, 103] and end == len(data)  # the torn one is gone
    size = 52 + 8 * 4 + 4  # a record of a 4-token block
    foreign = data[:end] + b"XXXX" + data[disk_index.HEADER_BYTES + 4 : disk_index.HEADER_BYTES + size]
    assert len(disk_index.scan(foreign, 4)[0]) == 3
    flipped = bytearray(data)
    flipped[disk_index.HEADER_BYTES + size + 30] ^= 1  # the second record's CRC fails: the rest is not trusted
    assert [r.hash for r in disk_index.scan(bytes(flipped), 4)[0]] == [100]
    assert os.path.getsize(tmp_path / INDEX_FILE) == disk_index.HEADER_BYTES + 3 * size
