"""The hybrid state machine (test_hybrid_stateful.py) over three tiers: the prefix cache with
a small HybridHostTier and a small HybridDiskTier below it, so evictions of every group go
device -> host -> disk (each tier's LRU dropping in turn) and adds promote disk -> host ->
device. Under the same checks every match equals the brute-force reference over the entries
of all three tiers (a host- or disk-held entry counts), every live sequence reads back exactly
its K/V and state (promoted blocks and checkpoints included), and every index stays consistent."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis.stateful import rule
from test_hybrid_tier_stateful import TieredMachine

from pagedkv import HybridDiskTier, HybridHostTier, PrefixCache


class DiskMachine(TieredMachine):
    def _prefix_cache(self):
        self.directory = tempfile.mkdtemp(prefix="pagedkv-hdisk-")
        self.tier = HybridHostTier(self.cache, [2, 2, None], self.gpu, num_state_slots=1)
        self.disk = HybridDiskTier(self.directory, 5 * 4096)  # five slots a group
        return PrefixCache(self.cache, host_tier=self.tier, disk_tier=self.disk)

    def _entries(self) -> dict:
        both = self.prefix.entries() + self.prefix.host_entries() + self.prefix.disk_entries()
        return {(tokens, g): entry for _, tokens, g, entry in both}

    @rule()
    def finish_writes(self):
        """Every queued disk write lands (the entries stay where they are)."""
        before = sorted(self.prefix.disk_entries())
        self.disk.flush()
        self.prefix.check_invariants()
        assert sorted(self.prefix.disk_entries()) == before

    def teardown(self):
        try:
            self.prefix.check_invariants()
            stats = self.prefix.stats()
            assert stats.device_hit_tokens + stats.host_hit_tokens + stats.disk_hit_tokens == stats.hit_tokens
        finally:
            self.prefix.close()
            self.disk.close()
            shutil.rmtree(self.directory, ignore_errors=True)


DiskMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)
TestHybridDisk = DiskMachine.TestCase
