"""A host entry the disk tier cannot queue (every staging slot busy: its write queue full)
is counted in `stats().disk_skipped_writes`, per group, exactly once."""

from __future__ import annotations

import threading

from shared_helpers import counting_host, hybrid_tier_config
from test_hybrid_disk_tiers import DiskWorld, where

from pagedkv import HybridDiskTier, HybridHostTier, PagedKvCache, PrefixCache, SequenceTable


class QueueOfOne(DiskWorld):
    """DiskWorld with one staging slot per group and an I/O thread held until `go` is set."""

    def __init__(self, directory):
        self.gpu = counting_host()
        self.cache = PagedKvCache(hybrid_tier_config(), [16, 16, None], self.gpu, num_state_slots=8)
        self.tier = HybridHostTier(self.cache, [1, 1, None], self.gpu, num_state_slots=1)
        self.disk = HybridDiskTier(directory, 1 << 20, queue_blocks=1)
        self.events: list = []
        self.prefix = PrefixCache(self.cache, on_event=self.events.append, host_tier=self.tier, disk_tier=self.disk)
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)
        import numpy as np

        self.rng = np.random.default_rng(7)
        self.go = threading.Event()
        for g in range(3):
            ops = self.disk.group(g)._io.ops
            write = ops.pwritev

            def held(*args, _write=write):
                assert self.go.wait(10)
                return _write(*args)

            ops.pwritev = held


def test_writes_a_full_queue_cannot_take_are_counted_as_skipped(tmp_path):
    world = QueueOfOne(tmp_path / "t")
    try:
        world.cached_prompt()
        world.push_down()  # host tiers of one: group 0 drops 3 entries, groups 1 and 2 one each
        s = world.prefix.stats()
        assert s.host_evictions == (3, 1, 1)
        assert s.disk_demotions == (1, 1, 1)  # the one staging slot of each group: the first write
        assert s.disk_skipped_writes == (2, 0, 0)  # group 0's other two: the queue was full
        world.go.set()
        world.disk.flush()
        world.prefix.check_invariants()
        assert sorted(k for k, tier in where(world).items() if tier == "disk") == [(16, 0), (16, 1), (16, 2)]
        assert world.prefix.stats().disk_skipped_writes == (2, 0, 0)
    finally:
        world.go.set()
        world.close()


def test_the_one_group_cache_counts_them_too(tmp_path):
    from disk_world import DiskWorld as OneGroupWorld
    from disk_world import prompt

    world = OneGroupWorld(tmp_path, queue_blocks=1)
    go = threading.Event()
    write = world.disk._io.ops.pwritev

    def held(*args):
        assert go.wait(10)
        return write(*args)

    world.disk._io.ops.pwritev = held
    try:
        for c in range(1, 4):  # 3 chains of 3 blocks through a 4-block device and a 3-block host tier
            world.fill(f"p{c}", prompt(c, 3))
            world.pressure()
        s = world.prefix.stats()
        assert s.host_evictions == 6 and s.disk_demotions == 1  # the queue's one staging slot
        assert s.disk_skipped_writes == 5  # every other host drop: the queue was full
        # the one written (chain 1's leaf, the host's oldest) left with its parent, which was not written
        assert s.disk_cached_blocks == 0 and s.disk_evictions == 0
        go.set()
        world.disk.flush()
        world.prefix.check_invariants()
        assert world.prefix.stats().disk_skipped_writes == 5
    finally:
        go.set()
        world.close()
