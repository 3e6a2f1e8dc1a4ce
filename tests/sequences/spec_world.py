"""A seeded random engine over SequenceTable + PrefixCache with speculative decoding, and
its reference (imported by test_speculative.py; not a test module).

The engine writes, every step, the K and V rows of the positions the step's `slot_mapping`
names; a position's row is a function of the ids up to it (committed ids, then the step's
draft ids), as a model's KV is, so a prefix-cache match must find exactly the rows the
reference expects. The audit reads a sequence's every position back (`token_slots`, then
`read_tokens`, which repeats slots where sequences share blocks) and compares row by row.
"""

from __future__ import annotations

import numpy as np

from pagedkv import HostBackend, KvCacheConfig, KvCacheExhausted, PagedKvCache, PrefixCache, SequenceTable

BS = 4
HEAD_DIM = 16
BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36])


def rows_of(ids: list[int], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """The K and V rows of positions [start, stop) of a sequence whose ids are `ids`:
    bytes of a rolling hash of the ids up to each position (exact in BF16)."""
    h = 0
    hashes = []
    for p in range(stop):
        h = (h * 1000003 + ids[p] + 1) & 0xFFFFFFFF
        if p >= start:
            hashes.append(h)
    n = stop - start
    k = np.zeros((n, 1, HEAD_DIM), np.float32)
    v = np.zeros((n, 1, HEAD_DIM), np.float32)
    for i, h in enumerate(hashes):
        k[i, 0, :4] = [(h >> s) & 0xFF for s in (0, 8, 16, 24)]
        v[i, 0, :4] = [((h ^ 0x9E3779B9) >> s) & 0xFF for s in (24, 16, 8, 0)]
        k[i, 0, 4] = v[i, 0, 5] = (start + i) % 251
    return k, v


class SpecWorld:
    """The table under test, and per live sequence the reference: its committed ids and
    its current draft ids (the latest append's lookahead)."""

    def __init__(self, seed: int, num_blocks: int = 40, window: int | None = None, audit_every: int = 1):
        self.rng = np.random.default_rng(seed)
        self.gpu = HostBackend(1 << 26)
        cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=HEAD_DIM, num_layers=1, dtype="bf16",
                            cache_blocks_per_seq=window)
        self.cache = PagedKvCache(cfg, num_blocks, self.gpu)
        self.prefix = PrefixCache(self.cache)
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)
        self.window = window
        self.ids: dict[int, list[int]] = {}
        self.drafts: dict[int, list[int]] = {}
        self.next_id = 0
        self.steps = 0
        self.violations: list[str] = []
        self.exhausted = 0
        self.audit_every = audit_every

    # -- the engine's side of a step --------------------------------------------------

    def _write_step(self, seq: int) -> None:
        """Write the rows of the positions the sequence's latest step introduced."""
        table = self.table
        slots = np.asarray(table.slot_mapping([seq]))
        end = table.num_tokens(seq) + table.num_lookahead(seq)
        start = end - slots.size
        every = table.token_slots(seq, start, end).host
        if not np.array_equal(slots, every):
            self.violations.append(f"step {self.steps}: slot_mapping of {seq} {slots.tolist()} != {every.tolist()}")
        k, v = rows_of(self.ids[seq] + self.drafts[seq], start, end)
        self.cache.write_tokens(0, slots, k, v, self.gpu, 0)

    def audit(self, seq: int) -> None:
        """Every held position of `seq` reads back the reference's row."""
        table = self.table
        ids = self.ids[seq] + self.drafts[seq]
        if table.num_tokens(seq) != len(self.ids[seq]) or table.num_lookahead(seq) != len(self.drafts[seq]):
            self.violations.append(f"step {self.steps}: {seq} counts {table.num_tokens(seq)}+"
                                   f"{table.num_lookahead(seq)}, reference {len(self.ids[seq])}+{len(self.drafts[seq])}")
            return
        first = table.first_block_position(seq)
        slots = table.token_slots(seq, first).host
        k, v = self.cache.read_tokens(0, slots, self.gpu)
        want_k, want_v = rows_of(ids, first, len(ids))
        if not (np.array_equal(k, want_k) and np.array_equal(v, want_v)):
            bad = int(np.flatnonzero(~(k == want_k).all(axis=(1, 2)) | ~(v == want_v).all(axis=(1, 2)))[0])
            self.violations.append(f"step {self.steps}: sequence {seq} position {first + bad} reads the wrong KV")

    # -- operations -------------------------------------------------------------------

    def add(self) -> int | None:
        base = BASES[self.rng.integers(len(BASES))]
        prompt = base[: self.rng.integers(1, len(base) + 1)] + self.rng.integers(0, 60, self.rng.integers(0, 6)).tolist()
        if self.window is not None and -(-len(prompt) // BS) > self.window:
            prompt = prompt[: self.window * BS]
        seq, self.next_id = self.next_id, self.next_id + 1
        try:
            self.table.add(seq, prompt)
        except KvCacheExhausted:
            self.exhausted += 1
            return None
        self.ids[seq], self.drafts[seq] = list(prompt), []
        self._write_step(seq)
        return seq

    def append(self, seq: int) -> None:
        n = int(self.rng.choice([0, 1, 1, 1, 2, 3]))
        k = int(self.rng.choice([0, 0, 1, 2, 4, 4]))
        new = self.rng.integers(0, 60, n).tolist()
        if self.window is not None:
            committed = len(self.ids[seq])
            while k and -(-(committed + n + k) // BS) - committed // BS > self.window:
                k -= 1
        given = new if self.rng.random() < 0.9 else None  # an id given only as a count now and then
        try:
            self.table.append(seq, n, given, lookahead=k)
        except KvCacheExhausted:
            self.exhausted += 1
            return
        self.ids[seq] += new
        self.drafts[seq] = self.rng.integers(0, 60, k).tolist()
        self._write_step(seq)

    def truncate(self, seq: int) -> None:
        first = self.table.first_block_position(seq)
        committed = len(self.ids[seq])
        keep = int(self.rng.integers(max(first, committed - 5), committed + 1))
        self.table.truncate(seq, keep)
        del self.ids[seq][keep:]
        self.drafts[seq] = []

    def fork(self, seq: int) -> None:
        child, self.next_id = self.next_id, self.next_id + 1
        self.table.fork(seq, child)
        self.ids[child], self.drafts[child] = list(self.ids[seq]), []

    def free(self, seq: int) -> None:
        self.table.free(seq)
        del self.ids[seq], self.drafts[seq]

    def step(self) -> None:
        """One random operation, the engine's writes, then the checks."""
        self.steps += 1
        live = list(self.ids)
        roll = self.rng.random()
        touched = None
        if not live or (roll < 0.12 and len(live) < 6):
            touched = self.add()
        else:
            seq = live[self.rng.integers(len(live))]
            touched = seq
            if roll < 0.55:
                self.append(seq)
            elif roll < 0.75:
                self.truncate(seq)
            elif roll < 0.82 and len(live) < 6:
                self.fork(seq)
                touched = self.next_id - 1
            elif roll < 0.9:
                self.table.cache_prefix(seq)
            else:
                self.free(seq)
                touched = None
        if touched is not None and self.steps % self.audit_every == 0:
            self.audit(touched)

    def check_all(self) -> None:
        self.table.check_invariants()
        for seq in self.ids:
            self.audit(seq)

    def close(self) -> None:
        for seq in list(self.ids):
            self.free(seq)
        self.table.check_invariants()
        self.prefix.close()
        self.table.release()
        self.cache.release(self.gpu)
