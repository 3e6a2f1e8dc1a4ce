"""Hypothesis state machine: the cache's allocator against a plain model (a stack, a count
list and the set of blocks an attached reclaimer holds)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv import HostBackend, KvCacheConfig, KvCacheExhausted, PagedKvCache, RefCountError

from conftest import HeldSet

N = 6
blocks = st.integers(0, N - 1)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.gpu = HostBackend(capacity_bytes=1 << 20)
        cfg = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
        self.cache = PagedKvCache(cfg, N, self.gpu)
        self.reclaimer = HeldSet()
        self.cache.attach_prefix_cache(self.reclaimer)
        # the model: the free stack (top = last) and a count per block
        self.stack = list(range(N - 1, -1, -1))
        self.refs = [0] * N

    def _model_push(self, b):
        self.stack.append(b)

    @rule()
    def alloc(self):
        if self.stack:
            want = self.stack.pop()
            assert self.cache.alloc_block() == want
            self.refs[want] = 1
        else:
            with pytest.raises(KvCacheExhausted):
                self.cache.alloc_block()
            assert self.cache.try_alloc_block() is None

    @rule(n=st.integers(0, N + 1))
    def alloc_blocks(self, n):
        if n <= len(self.stack):
            want = [self.stack.pop() for _ in range(n)]
            assert self.cache.alloc_blocks(n) == want
            for b in want:
                self.refs[b] = 1
        else:
            with pytest.raises(KvCacheExhausted):
                self.cache.alloc_blocks(n)

    @rule(b=blocks)
    def inc(self, b):
        if self.refs[b]:
            self.cache.inc_ref(b)
            self.refs[b] += 1
        else:
            with pytest.raises(RefCountError):
                self.cache.inc_ref(b)

    @rule(b=blocks)
    def cache_block(self, b):
        # what PrefixCache.insert does: its own reference on a held block
        if self.refs[b] and b not in self.reclaimer.held:
            self.cache.inc_ref(b)
            self.refs[b] += 1
            self.reclaimer.held.add(b)

    def _expect_dec(self, b, call):
        if self.refs[b] == 1 and b in self.reclaimer.held:
            with pytest.raises(RefCountError, match=f"would free block {b}, which the prefix cache still holds"):
                call(b)
            return None, None
        if self.refs[b]:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._model_push(b)
            return call(b), self.refs[b] == 0
        with pytest.raises(RefCountError):
            call(b)
        return None, None

    @rule(b=blocks)
    def dec(self, b):
        got, want = self._expect_dec(b, self.cache.dec_ref)
        assert got is want

    @rule(b=blocks)
    def free(self, b):
        self._expect_dec(b, self.cache.free_block)

    @rule(b=blocks)
    def return_evicted(self, b):
        if b in self.reclaimer.held:
            self.cache.return_evicted_block(b)  # while held, as PrefixCache does; then it forgets
            self.reclaimer.held.discard(b)
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._model_push(b)
        else:
            with pytest.raises(RefCountError, match="which no attached prefix cache holds"):
                self.cache.return_evicted_block(b)

    @rule(data=st.data())
    def free_table(self, data):
        held = [b for b in range(N) if self.refs[b]]
        if not held:
            return
        table = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=len(held) + 2))
        listed = {b: table.count(b) for b in table}
        if any(self.refs[b] < n for b, n in listed.items()):
            with pytest.raises(RefCountError, match="at count 0"):
                self.cache.free_blocks(table)
            return  # refused: nothing changed (the invariant checks it)
        if any(self.refs[b] == n and b in self.reclaimer.held for b, n in listed.items()):
            with pytest.raises(RefCountError, match="which the prefix cache still holds"):
                self.cache.free_blocks(table)
            return
        self.cache.free_blocks(table)
        for b in reversed(table):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._model_push(b)

    @invariant()
    def consistent(self):
        free = self.cache.allocator()._free
        assert len(set(free)) == len(free), f"duplicate on the free list: {free}"
        assert all(self.cache.ref_count(b) == 0 for b in free), "a free block is referenced"
        referenced = [b for b in range(N) if self.cache.ref_count(b) > 0]
        assert len(free) + len(referenced) == N
        assert sorted(free + referenced) == list(range(N))
        assert [self.cache.ref_count(b) for b in range(N)] == self.refs
        assert free == self.stack  # same order: LIFO reuse
        assert self.cache.num_free_blocks() == len(self.stack)
        self.cache.check_invariants()

    def teardown(self):
        self.cache.release(self.gpu)
        assert self.gpu.live_allocations() == 0


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocator = AllocatorMachine.TestCase
