"""SequenceTable.append_decode (the batched decode append) against the per-call appends it
stands for: a seeded random run of adds, forks, frees and decode steps through both ways,
compared after every step (same blocks, exports, events and pending copies); a window
table (same counts); and every refusal leaving the table as it was."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheExhausted, PagedKvCache, PrefixCache, SequenceTable

BS = 4


def world(num_blocks: int, window: int | None = None, gpu: bool = False, prefix: bool = True):
    events: list = []
    backend = HostBackend(capacity_bytes=1 << 24)
    config = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=8, num_layers=1, dtype="bf16",
                           cache_blocks_per_seq=window)
    cache = PagedKvCache(config, num_blocks, backend)
    cached = PrefixCache(cache, on_event=events.append) if prefix else None
    return SequenceTable(cache, cached, backend if gpu else None), events


def state(table: SequenceTable) -> tuple:
    """Everything the two ways must agree on: per sequence (in batch order) its record,
    every whole-batch export, the cache's counts, the pending copies."""
    seqs = [(i, s.blocks, s.num_tokens, s.step_start, s.tokens, s.tokens_known, s.dropped, s.maybe_shared, s.room)
            for i, s in zip(table.batch_ids(), (table._seqs[i] for i in table.batch_ids()))]
    exports = (table.block_table().host, *table.page_table().host, table.slot_mapping().host, table.seq_lens().host)
    alloc = table._cache.allocator()
    refs = [alloc.ref_count(b) for b in range(table._cache.num_blocks())]
    return repr(seqs), [e.tobytes() for e in exports], refs, table._cache.num_free_blocks(), list(table._pending_copies)


def random_twins(seed: int, gpu: bool, steps: int = 120) -> tuple[int, int, int]:
    """Drive a per-call table and an append_decode table through the same seeded work;
    returns (decode steps with a block allocated, evicted blocks, copy-on-write copies left
    pending) so the test can check the run reached those paths."""
    rng = random.Random(seed)
    (one, one_events), (two, two_events) = world(40, gpu=gpu), world(40, gpu=gpu)
    prompts = [[rng.randrange(30) for _ in range(rng.randrange(1, 14))] for _ in range(5)]
    next_id, grew = 0, 0
    for _ in range(steps):
        live = one.batch_ids()
        op = rng.random()
        if op < 0.2 or not live:
            base = rng.choice(prompts)
            prompt = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(30) for _ in range(rng.randrange(2))]
            results = []
            for table in (one, two):
                try:
                    results.append(table.add(next_id, prompt))
                except KvCacheExhausted:
                    results.append("exhausted")
            assert results[0] == results[1]
            next_id += 1
        elif op < 0.3:
            src = rng.choice(live)
            for table in (one, two):
                table.fork(src, next_id)
            next_id += 1
        elif op < 0.42:
            victim = rng.choice(live)
            for table in (one, two):
                table.free(victim)
        else:
            while len(live) > 8 or len(one.block_references()) > 30:  # room for the step: no exhaustion
                victim = live.pop(rng.randrange(len(live)))
                for table in (one, two):
                    table.free(victim)
            batch = rng.sample(live, rng.randrange(len(live) + 1))
            tokens = [rng.randrange(30) for _ in batch]
            before = one._cache.num_free_blocks()
            for seq_id, token in zip(batch, tokens):
                one.append(seq_id, 1, [token])
            two.append_decode(batch, tokens)
            grew += one._cache.num_free_blocks() < before
        assert state(one) == state(two)
        assert one_events == two_events
        if rng.random() < 0.1:
            one.check_invariants()
            two.check_invariants()
    one.check_invariants()
    two.check_invariants()
    removed = sum(len(e.block_ids) for e in two_events if e.kind == "removed")
    return grew, removed, len(two._pending_copies)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_run_matches_the_per_call_appends(seed):
    grew, removed, copies = random_twins(seed, gpu=False)
    assert grew > 5 and removed > 0 and copies > 0  # block boundaries, evictions and copies were all reached


def test_random_run_with_a_backend_matches_and_copies_alike():
    grew, _, _ = random_twins(7, gpu=True)
    assert grew > 5


def test_fork_then_decode_copies_the_shared_block_once():
    table, _ = world(16, prefix=False)
    table.add("a", [1, 2, 3, 4, 5, 6])  # a partly filled second block
    table.fork("a", "b")
    shared = table.blocks("a")[1]
    table.append_decode(["a", "b"], [7, 8])
    # "a" copied the shared block; "b" was then its only holder and keeps it
    assert table.blocks("b") == [table.blocks("a")[0], shared]
    assert table.blocks("a")[1] != shared
    assert table.take_pending_copies() == [(shared, table.blocks("a")[1])]
    assert table.slot_mapping(["a", "b"]).host.tolist() == [table.blocks("a")[1] * BS + 2, shared * BS + 2]
    assert table._cache.allocator().ref_count(shared) == 1
    table.check_invariants()


def test_window_table_keeps_its_window():
    rng = random.Random(5)
    (one, _), (two, _) = world(64, window=2, prefix=False), world(64, window=2, prefix=False)
    for table in (one, two):
        for s in range(6):
            table.add(s, [s] * (s + 1))
    for _ in range(30):
        batch = rng.sample(range(6), rng.randrange(1, 7))
        tokens = [rng.randrange(30) for _ in batch]
        for seq_id, token in zip(batch, tokens):
            one.append(seq_id, 1, [token])
        two.append_decode(batch, tokens)
        for s in range(6):
            a, b = one._seqs[s], two._seqs[s]
            assert (a.num_tokens, len(a.blocks), a.dropped, a.tokens, a.step_start) == \
                (b.num_tokens, len(b.blocks), b.dropped, b.tokens, b.step_start)
        assert one.seq_lens().host.tolist() == two.seq_lens().host.tolist()
        assert one._cache.num_free_blocks() == two._cache.num_free_blocks()
        two.check_invariants()
    assert two._seqs[0].dropped > 0


def refused(table, seq_ids, tokens, error, match):
    before = state(table)
    with pytest.raises(error, match=match):
        table.append_decode(seq_ids, tokens)
    assert state(table) == before


def test_bad_input_is_refused_and_changes_nothing():
    table, _ = world(32)
    table.add("a", [1, 2, 3])
    table.add("b", [4, 5, 6, 7])  # full: its next token needs a block
    table.add("c", [8])
    refused(table, ["a", "b"], [1], ValueError, "2 seq_ids but 1 token_ids")
    refused(table, ["a", "b", "zz"], [1, 2, 3], KeyError, "unknown sequence 'zz'")
    refused(table, ["a", "b", "a"], [1, 2, 3], ValueError, "sequence 'a' appears twice")
    refused(table, ["b", "c", "b"], [1, 2, 3], ValueError, "sequence 'b' appears twice")
    refused(table, ["a", "b"], [1, -1], ValueError, r"token_ids\[1\] is -1")
    refused(table, ["a", "b"], [1, 2.0], TypeError, r"token_ids\[1\] must be an int")
    refused(table, ["a", "b"], [True, 2], TypeError, r"token_ids\[0\] must be an int")
    refused(table, "ab", [1, 2], TypeError, "seq_ids must be a list")
    refused(table, ["a", ["x"]], [1, 2], TypeError, r"sequence id \['x'\] is unhashable")  # after "a" was counted
    refused(table, {"a", "b"}, [1, 2], TypeError, "seq_ids must be ordered")
    refused(table, frozenset(["a"]), [1], TypeError, "seq_ids must be ordered")
    table.append("c", 1, [9], lookahead=2)
    refused(table, ["a", "c"], [1, 2], ValueError, "sequence 'c' holds 2 draft position")
    table.append_decode(("a", "b"), np.array([10, 11]))  # a tuple and an integer array are taken
    assert (table.num_tokens("a"), table.num_tokens("b")) == (4, 5)
    table.check_invariants()


def test_exhaustion_takes_back_the_whole_step():
    table, _ = world(4, prefix=False)
    table.add("a", [1, 2, 3, 4])
    table.add("b", [5, 6, 7, 8])
    table.add("c", [9, 10])
    table.add("d", [11, 12, 13, 14])  # every block held; a and b each need one more
    refused(table, ["c", "a", "b"], [1, 2, 3], KvCacheExhausted, "asked for 1 block")
    table.free("d")  # one block free: still not enough for two
    refused(table, ["a", "c", "b"], [1, 2, 3], KvCacheExhausted, "asked for 1 block")
    table.append_decode(["a", "c"], [1, 2])
    assert table.blocks("a")[-1] not in table.blocks("b") + table.blocks("c")
    assert table.slot_mapping(["a", "c"]).host.tolist() == [table.blocks("a")[1] * BS, table.blocks("c")[0] * BS + 2]
    table.check_invariants()


class FailingFill(HostBackend):
    """A HostBackend whose block fills fail while `fail` is set."""

    fail = False

    def fill_blocks(self, regions, blocks, value, stream):
        if self.fail:
            raise RuntimeError("fill failed")
        super().fill_blocks(regions, blocks, value, stream)


def test_a_backend_error_frees_the_new_blocks():
    gpu = FailingFill(capacity_bytes=1 << 24)
    config = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=8, num_layers=1, dtype="bf16")
    cache = PagedKvCache(config, 8, gpu)
    table = SequenceTable(cache, None, gpu)
    table.add("a", [1, 2, 3, 4])
    table.add("b", [5, 6])
    gpu.fail = True
    refused(table, ["b", "a"], [1, 2], RuntimeError, "fill failed")
    gpu.fail = False
    table.append_decode(["b", "a"], [1, 2])
    assert [len(table.blocks(s)) for s in "ab"] == [2, 1]
    table.check_invariants()


def test_readme_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```py\n(.*?)```", readme, flags=re.S) if "append_decode" in b]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["table"].num_tokens("a") == 5
