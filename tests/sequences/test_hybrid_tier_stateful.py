"""The hybrid state machine (test_hybrid_stateful.py) with the prefix cache over a small
HybridHostTier: evictions of every group demote to the host (whose LRU drops in turn), a
`demote` rule pushes entries down on purpose, and under the same checks every match equals
the brute-force reference over the entries of both tiers (a host-held entry counts), every
live sequence reads back exactly its K/V and state (promoted blocks and checkpoints
included), and every count and host index stays consistent."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from pagedkv import HybridHostTier, PrefixCache
from test_hybrid_stateful import HybridMachine


class TieredMachine(HybridMachine):
    def _prefix_cache(self):
        self.tier = HybridHostTier(self.cache, [10, 6, None], self.gpu, num_state_slots=4)
        return PrefixCache(self.cache, host_tier=self.tier)

    @rule(group=st.integers(0, 2), n=st.integers(1, 4))
    def demote(self, group, n):
        """Evict (demote) up to n entries of one group that only the cache holds."""
        before = self.prefix.num_host_entries(group) + self.prefix.num_cached(group)
        got = self.prefix.evict(group, n)
        after = self.prefix.num_host_entries(group) + self.prefix.num_cached(group)
        assert after <= before and got <= n

    @rule()
    def demote_everything(self):
        """Every entry only the cache holds goes to the host (or is dropped where it is full)."""
        for group in range(3):
            self.prefix.evict(group, 99)
        assert all(self.cache.group(g).ref_count(e) > 1 for _, _, g, e in self.prefix.entries())

    @rule(data=st.data(), extra=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def demote_then_readd(self, data, extra):
        """Demote everything, then add a prompt that extends a cached checkpoint's chain: its
        hit, if any, needs what was just demoted, promoted in one swap."""
        chains = sorted(tokens for tokens, g in self._entries() if g == 2)
        if not chains:
            return
        chain = data.draw(st.sampled_from(chains))
        self.demote_everything()
        self._add_prompt(list(chain) + extra)

    def teardown(self):
        self.prefix.check_invariants()


TieredMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)
TestHybridTiered = TieredMachine.TestCase
