"""A hypothesis state machine over a hybrid cache (a full, a sliding and a state group) with
eviction pressure, fork, cache_prefix and exhaustion: every match equals a brute-force
reference computed from the cached entries, and every live sequence reads back exactly the
K/V and state it was given (values are a function of the token prefix, so a sequence that
read another's memory would see other values)."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv import HostBackend, KvCacheConfig, KvCacheExhausted, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.groups.window import window_blocks_for_match

BS, WINDOW, EVERY = 2, 5, 4
GROUPS = (
    LayerGroup("full", (0,)),
    LayerGroup("sliding", (1,), window=WINDOW),
    LayerGroup("state", (2,), state=(((4,), "float32"),), checkpoint_every=EVERY),
)
BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5])


def _digest(prefix: tuple) -> bytes:
    return hashlib.blake2b(np.asarray(prefix, np.int64).tobytes(), digest_size=16).digest()


def kv_row(prefix: tuple, side: int) -> np.ndarray:
    """The K (side 0) or V row of the last token of `prefix`: bf16-exact halves in [-16, 16)."""
    raw = np.frombuffer(_digest(prefix + (side,)), np.uint8)
    return ((raw.astype(np.float32) % 64) - 32) / 2


def state_of(prefix: tuple) -> np.ndarray:
    """The recurrent state after `prefix` (zeros for the empty one)."""
    if not prefix:
        return np.zeros(4, np.float32)
    return np.frombuffer(_digest(prefix + (-1,)), np.uint8)[:4].astype(np.float32)


def common(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference_match(entries: dict, prompt: list[int]) -> int:
    """The match rule, by brute force over every candidate p."""
    best = 0
    for p in range(BS, len(prompt), BS):
        full = all((tuple(prompt[: (i + 1) * BS]), 0) in entries for i in range(p // BS))
        sliding = all((tuple(prompt[: (i + 1) * BS]), 1) in entries for i in window_blocks_for_match(p, WINDOW, BS))
        if full and sliding and (tuple(prompt[:p]), 2) in entries:
            best = p
    return best


class HybridMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.gpu = HostBackend()
        config = KvCacheConfig(BS, 1, 16, 3, "bf16", layer_groups=GROUPS)
        self.cache = PagedKvCache(config, [20, 12, None], self.gpu, num_state_slots=10)
        self.prefix = self._prefix_cache()
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.skipped = 0

    def _prefix_cache(self):
        """The prefix cache under test (a variant gives it a host tier)."""
        return PrefixCache(self.cache)

    def _entries(self) -> dict:
        """(tokens, group) -> id of every cached entry, on the device or (a variant) the host."""
        both = self.prefix.entries() + self.prefix.host_entries()
        return {(tokens, g): entry for _, tokens, g, entry in both}

    def _write_step(self, sid: int, old: int, prompt_ends: tuple = ()) -> None:
        """The engine's part of a step from `old` tokens: K/V of the step's positions, the
        live state, the checkpoint states at its positions (each multiple of EVERY past `old`,
        and for an add `prompt_ends`: the prompt's last whole block and the branch point)."""
        toks = self.tokens[sid]
        for layer, group in ((0, 0), (1, 1)):
            export = self.table.slot_mapping([sid], group=group)
            slots = np.asarray(export)
            first = len(toks) - slots.size
            if slots.size:
                k = np.stack([kv_row(tuple(toks[: first + i + 1]), 0) for i in range(slots.size)])[:, None, :]
                v = np.stack([kv_row(tuple(toks[: first + i + 1]), 1) for i in range(slots.size)])[:, None, :]
                self.cache.write_tokens(layer, slots, k, v, self.gpu, 0)
        (live,) = np.asarray(self.table.state_slots([sid])).tolist()
        self.cache.write_state(2, live, state_of(tuple(toks)), self.gpu)
        pairs = self.table.step_checkpoints(sid)
        (ckpt,) = np.asarray(self.table.checkpoint_slots([sid])).tolist()
        assert ckpt == (pairs[-1][1] if pairs else -1)
        want = set(range((old // EVERY + 1) * EVERY, len(toks) + 1, EVERY)) | {p for p in prompt_ends if p > old}
        # short of slots, the step skips the shallowest (counted) and takes every slot there was
        skipped, self.skipped = self.table.skipped_checkpoints() - self.skipped, self.table.skipped_checkpoints()
        assert [pos for pos, _ in pairs] == sorted(want)[skipped:]
        if skipped:
            assert self.cache.num_free_blocks(group=2) == 0
        for pos, slot in pairs:
            self.cache.write_state(2, slot, state_of(tuple(toks[:pos])), self.gpu)

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(1, 12), extra=st.lists(st.integers(1, 3), max_size=3))
    def add(self, base, cut, extra):
        self._add_prompt(BASES[base][:cut] + extra)

    def _add_prompt(self, prompt: list[int]) -> None:
        """Add `prompt` as a new sequence: its hit checked against the reference, then written."""
        entries = self._entries()
        expected = reference_match(entries, prompt)
        sid = self.next_id
        self.next_id += 1
        try:
            got = self.table.add(sid, prompt)
        except KvCacheExhausted:
            assert sid not in self.table
            return
        assert got == expected
        device = {(tokens, g): entry for _, tokens, g, entry in self.prefix.entries()}  # host hits promoted now
        assert self.table.blocks(sid, 0)[: got // BS] == [device[(tuple(prompt[: (i + 1) * BS]), 0)] for i in range(got // BS)]
        (live,) = np.asarray(self.table.state_slots([sid])).tolist()
        np.testing.assert_array_equal(self.cache.read_state(2, live, self.gpu), state_of(tuple(prompt[:got])))
        self.tokens[sid] = prompt
        # the branch point: how far the prompt (but its last token) follows a cached chain
        shared = max((common(t, prompt[:-1]) // BS * BS for t, _ in entries), default=0)
        self._write_step(sid, got, ((len(prompt) // BS) * BS, shared))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(1, 3), min_size=1, max_size=5))
    def append(self, data, new):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.table.num_tokens(sid)
        try:
            self.table.append(sid, token_ids=new)
        except KvCacheExhausted:
            assert self.table.num_tokens(sid) == before
            return
        self.tokens[sid] = self.tokens[sid] + new
        self._write_step(sid, before)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        try:
            self.table.fork(sid, child)
        except KvCacheExhausted:
            return
        self.tokens[child] = list(self.tokens[sid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.table.free(sid)
        del self.tokens[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache_prefix(self, data):
        self.table.cache_prefix(data.draw(st.sampled_from(sorted(self.tokens))))

    @rule(group=st.integers(0, 2), n=st.integers(1, 12))
    def pressure(self, group, n):
        """Another user takes n blocks (or slots) of one group and gives them back: eviction."""
        target = self.cache.group(group)
        try:
            taken = target.alloc_blocks(n)
        except KvCacheExhausted:
            return
        target.free_blocks(taken)

    @invariant()
    def counts_and_contents(self):
        self.table.check_invariants()
        for sid, toks in self.tokens.items():
            n = len(toks)
            for layer, group in ((0, 0), (1, 1)):
                blocks = self.table.blocks(sid, group)
                first = self.table.first_block_position(sid, group)
                positions = range(first, n)
                slots = [blocks[(p - first) // BS] * BS + p % BS for p in positions]
                if not slots:
                    continue
                k, v = self.cache.read_tokens(layer, slots, self.gpu)
                want_k = np.stack([kv_row(tuple(toks[: p + 1]), 0) for p in positions])
                want_v = np.stack([kv_row(tuple(toks[: p + 1]), 1) for p in positions])
                np.testing.assert_array_equal(k[:, 0, :], want_k)
                np.testing.assert_array_equal(v[:, 0, :], want_v)
            (live,) = np.asarray(self.table.state_slots([sid])).tolist()
            if self.table.num_tokens(sid) == n:
                np.testing.assert_array_equal(self.cache.read_state(2, live, self.gpu), state_of(tuple(toks)))


HybridMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestHybrid = HybridMachine.TestCase
