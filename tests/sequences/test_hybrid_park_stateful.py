"""The hybrid state machine (test_hybrid_stateful.py) with a host tier: sequences are parked
(`swap_out`: every group's blocks, the live slot and pending checkpoints) and brought back
(`swap_in`) between the other steps, under the same checks: every match equals the
brute-force reference, every live sequence reads back exactly its K/V and state, and a
checkpoint that went through the host tier still gives the state a later hit copies."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from pagedkv import HybridHostTier, KvCacheExhausted
from test_hybrid_stateful import HybridMachine


class ParkingMachine(HybridMachine):
    def __init__(self):
        super().__init__()
        self.tier = HybridHostTier(self.cache, [24, 16, None], self.gpu, num_state_slots=12)
        self.parked: dict[int, tuple] = {}  # sequence id -> (ParkedSequence, tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def park(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        try:
            parked = self.table.swap_out(sid, self.tier)
        except KvCacheExhausted:  # the host tier is full: nothing changed
            assert sid in self.table
            return
        assert sid not in self.table and parked.num_tokens() == len(self.tokens[sid])
        self.parked[sid] = (parked, self.tokens.pop(sid))

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def resume(self, data):
        sid = data.draw(st.sampled_from(sorted(self.parked)))
        parked, toks = self.parked[sid]
        try:
            self.table.swap_in(parked)
        except KvCacheExhausted:  # a group is out of blocks: it stays parked
            assert sid not in self.table and parked.is_parked()
            return
        del self.parked[sid]
        self.tokens[sid] = toks  # the invariant now checks its K/V and state, in fresh blocks

    @invariant()
    def host_blocks_are_the_parked_ones(self):
        for g in range(3):
            held = sum(len(parked.host[g]) for parked, _ in self.parked.values())
            assert self.tier.group(g).num_blocks() - self.tier.num_free_blocks(g) == held


ParkingMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestParking = ParkingMachine.TestCase
