"""Random add/append/fork/free/evict/match sequences against SequenceTable + PrefixCache.

After every step: the cache's, the prefix cache's and the table's invariants hold, every
block's count equals the references the table and the prefix cache hold, and every live
sequence reads back exactly its own tokens. Each token's id is written into its KV slot
(layer 0, K side, first 4 bytes of the token's row) through `slot_mapping`, so a wrong
prefix match, a missing copy-on-write or a block handed out twice shows as wrong data.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv import (
    HostBackend,
    KvCacheConfig,
    KvCacheExhausted,
    PagedKvCache,
    PrefixCache,
    SequenceTable,
)

BS = 4
NUM_BLOCKS = 20
HEAD_DIM = 16
ROW_BYTES = HEAD_DIM * 2  # one head of BF16 per token row
BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21, 22, 23], [30, 31, 32, 33, 34])


class SequenceMachine(RuleBasedStateMachine):
    """The model: each live sequence's full list of token ids, and a snapshot taken before
    any operation that may fail, to check all-or-nothing."""

    window: int | None = None

    def __init__(self):
        super().__init__()
        self.gpu = HostBackend(capacity_bytes=1 << 26)
        config = KvCacheConfig(
            block_size=BS, num_kv_heads=1, head_dim=HEAD_DIM, num_layers=1, dtype="bf16",
            cache_blocks_per_seq=self.window,
        )
        self.cache = PagedKvCache(config, NUM_BLOCKS, self.gpu)
        self.prefix = PrefixCache(self.cache)
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.next_token = 1000

    # -- helpers -------------------------------------------------------------------

    def _snapshot(self):
        counts = [self.cache.ref_count(b) for b in range(NUM_BLOCKS)]
        return counts, self.cache.num_free_blocks(), self.prefix.num_cached_blocks()

    def _write_step(self, seq_id: int) -> None:
        """Write the ids of the step's tokens into the slots `slot_mapping` names."""
        slots = self.table.slot_mapping([seq_id]).host.tolist()
        tokens = self.tokens[seq_id][len(self.tokens[seq_id]) - len(slots) :]
        for slot, token in zip(slots, tokens):
            block, offset = divmod(slot, BS)
            k, _ = self.cache.read_block(0, block, self.gpu)
            k[offset * ROW_BYTES : offset * ROW_BYTES + 4] = np.frombuffer(np.uint32(token).tobytes(), np.uint8)
            self.cache.write_block(0, block, k, None, self.gpu)

    def _read_tokens(self, blocks: list[int], first_position: int, count: int) -> list[int]:
        out = []
        for position in range(first_position, first_position + count):
            block = blocks[position // BS - first_position // BS]
            k, _ = self.cache.read_block(0, block, self.gpu)
            row = position % BS
            out.append(int(k[row * ROW_BYTES : row * ROW_BYTES + 4].view(np.uint32)[0]))
        return out

    def _fresh_tokens(self, n: int) -> list[int]:
        start, self.next_token = self.next_token, self.next_token + n
        return list(range(start, start + n))

    # -- rules ---------------------------------------------------------------------

    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 12), tail=st.integers(0, 6))
    def add(self, base, cut, tail):
        prompt = base[:cut] + self._fresh_tokens(tail)
        seq_id, before = self.next_id, self._snapshot()
        self.next_id += 1
        needed = -(-len(prompt) // BS)
        try:
            matched = self.table.add(seq_id, prompt)
        except KvCacheExhausted:
            assert self._snapshot() == before
            return
        except ValueError:
            assert self.window is not None and needed > self.window
            assert self._snapshot() == before
            return
        assert matched % BS == 0 and matched < max(len(prompt), 1)
        self.tokens[seq_id] = prompt
        self._write_step(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 6), known=st.booleans())
    def append(self, data, n, known):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        new = self._fresh_tokens(n)
        before = self._snapshot()
        try:
            self.table.append(seq_id, n, token_ids=new if known else None)
        except KvCacheExhausted:
            assert self._snapshot() == before
            return
        except ValueError:
            assert self.window is not None
            assert self._snapshot() == before
            return
        self.tokens[seq_id] = self.tokens[seq_id] + new
        self._write_step(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        dst, self.next_id = self.next_id, self.next_id + 1
        self.table.fork(src, dst)
        self.tokens[dst] = list(self.tokens[src])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.table.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache_prefix(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        cached = self.prefix.num_cached_blocks()
        added = self.table.cache_prefix(seq_id)
        assert self.prefix.num_cached_blocks() == cached + added

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        cached = self.prefix.num_cached_blocks()
        evicted = self.prefix.evict(n)
        assert len(evicted) <= n and self.prefix.num_cached_blocks() == cached - len(evicted)
        assert all(self.cache.ref_count(b) == 0 for b in evicted)

    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 12))
    def match(self, base, cut):
        query = base[:cut]
        blocks, num_tokens = self.prefix.match(query)
        assert num_tokens == len(blocks) * BS <= len(query)
        assert self._read_tokens(blocks, 0, num_tokens) == query[:num_tokens]
        self.cache.free_blocks(blocks)

    # -- checks after every step ---------------------------------------------------

    @invariant()
    def counts_match_holders(self):
        self.table.check_invariants()

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, tokens in self.tokens.items():
            assert self.table.num_tokens(seq_id) == len(tokens)
            first = self.table.first_block_position(seq_id)
            held = self._read_tokens(self.table.blocks(seq_id), first, len(tokens) - first)
            assert held == tokens[first:]


class WindowedSequenceMachine(SequenceMachine):
    """The same machine with a sliding window of 3 blocks per sequence."""

    window = 3


TestSequences = SequenceMachine.TestCase
TestSequences.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowedSequences = WindowedSequenceMachine.TestCase
TestWindowedSequences.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
