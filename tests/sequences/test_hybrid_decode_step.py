"""HybridSequenceTable.append_decode (the batched decode step over a hybrid cache) against the
per-call appends it stands for: seeded random runs of adds, forks, frees, cache_prefix and
decode steps through both ways over a full, a sliding and a state group, with and without a
prefix cache, compared after every step (the full and state groups exactly; the sliding
group up to a renaming of its block ids, the one difference the docstring admits); every
refusal, exhaustion mid-step and backend error leaving the table as it was."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheExhausted, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.sequences.hybrid_table import HybridSequenceTable

BS, WINDOW, EVERY = 2, 5, 4
FULL, SLIDING, STATE = 0, 1, 2


def config() -> KvCacheConfig:
    return KvCacheConfig(BS, 1, 8, 3, "bf16", layer_groups=(
        LayerGroup("full", (0,)),
        LayerGroup("sliding", (1,), window=WINDOW),
        LayerGroup("state", (2,), state=(((4,), "float32"),), checkpoint_every=EVERY),
    ))


def world(blocks=(160, 512), slots=64, prefix=True, gpu=None):
    """A hybrid table (with a backend when `gpu` is given) and the events of its prefix cache."""
    backend = gpu if gpu is not None else HostBackend()
    cache = PagedKvCache(config(), [blocks[0], blocks[1], None], backend, num_state_slots=slots)
    events: list = []
    cached = PrefixCache(cache, on_event=events.append) if prefix else None
    table = SequenceTable(cache, cached, gpu)
    assert isinstance(table, HybridSequenceTable)
    return table, events


def sliding_map(one: HybridSequenceTable, two: HybridSequenceTable) -> dict[int, int]:
    """The renaming of sliding block ids from `one` to `two`: every block a live sequence
    holds (position by position) and every cached sliding entry (by its tokens). Asserted a
    bijection, so both tables share their sliding blocks alike."""
    pairs = []
    assert list(one._seqs) == list(two._seqs)
    for a, b in zip(one._seqs.values(), two._seqs.values()):
        ha, hb = a.held[SLIDING], b.held[SLIDING]
        assert (len(ha.blocks), sorted(ha.extra)) == (len(hb.blocks), sorted(hb.extra))
        pairs += zip(ha.blocks, hb.blocks)
        pairs += [(ha.extra[i], hb.extra[i]) for i in ha.extra]
    if one._prefix is not None:
        ea = {(ad, t): e for ad, t, g, e in one._prefix.entries() if g == SLIDING}
        eb = {(ad, t): e for ad, t, g, e in two._prefix.entries() if g == SLIDING}
        assert ea.keys() == eb.keys()
        pairs += [(ea[k], eb[k]) for k in ea]
    out: dict[int, int] = {}
    for x, y in pairs:
        assert out.setdefault(x, y) == y
    assert len(set(out.values())) == len(out)
    return out


def snapshot(table: HybridSequenceTable, rename: dict[int, int] | None = None) -> dict:
    """Everything observable, with the sliding block ids renamed through `rename`."""
    m = (lambda b: b) if rename is None else (lambda b: rename[b] if b >= 0 else b)
    ids = list(table._seqs)
    out: dict = {"skipped": [table.skipped_checkpoints(g) for g in (STATE,)]}
    for seq_id, s in table._seqs.items():
        rec = [s.num_tokens, s.step_start, list(s.tokens), s.tokens_known, s.room]
        for g in (FULL, SLIDING):
            h, f = s.held[g], (m if g == SLIDING else (lambda b: b))
            rec.append(([f(b) for b in h.blocks], h.dropped, h.maybe_shared, h.num_tokens, h.step_start,
                        {i: f(b) for i, b in h.extra.items()}))
        rec.append((s.slots[STATE], list(s.checkpoints[STATE]), s.step_checkpoints[STATE],
                    table.step_checkpoints(seq_id), table.checkpoint_position(seq_id)))
        out[("seq", seq_id)] = rec
    for g in (FULL, SLIDING):
        f = np.vectorize(m, otypes=[np.int64]) if g == SLIDING and rename is not None else (lambda a: a)
        bt = table.block_table(ids, group=g).host
        pt = table.page_table(ids, group=g).host
        slots = table.slot_mapping(ids, group=g).host
        if g == SLIDING and rename is not None:  # a slot is block * BS + offset
            slots = np.array([m(int(x) // BS) * BS + int(x) % BS if x >= 0 else -1 for x in slots], np.int64)
        out[("exports", g)] = (f(bt).tolist() if bt.size else bt.shape, f(pt.indices).tolist() if pt.indices.size else [],
                               pt.indptr.tolist(), pt.last_page_len.tolist(), slots.tolist())
        alloc = table._cache.group(g).allocator()
        refs = {m(b) if g == SLIDING else b: alloc.ref_count(b) for b in range(alloc.num_blocks()) if alloc.ref_count(b)}
        out[("alloc", g)] = (alloc.num_free_blocks(), refs)
    alloc = table._cache.group(STATE).allocator()
    out[("alloc", STATE)] = (alloc.num_free_blocks(), [alloc.ref_count(b) for b in range(alloc.num_blocks())])
    out["state"] = (table.state_slots(ids).host.tolist(), table.checkpoint_slots(ids).host.tolist())
    if table._prefix is not None:
        out["cached"] = sorted((ad, t, g, m(e) if g == SLIDING else e) for ad, t, g, e in table._prefix.entries())
    out["pending"] = [(g, m(a), m(b)) if g == SLIDING else (g, a, b) for g, a, b in table._pending]
    return out


def renamed_events(events: list, rename: dict[int, int] | None = None) -> list:
    """The events with sliding block ids renamed, grouped by group (in order within each)."""
    out = [dataclasses.replace(e, block_id=rename[e.block_id]) if e.group == SLIDING and rename is not None else e
           for e in events]
    return sorted(out, key=lambda e: e.group)


def random_twins(seed: int, prefix: bool, gpu: bool = False, steps: int = 90, slots: int = 64,
                 blocks=(80, 512)) -> dict:
    """Drive a per-call table (`one`) and an append_decode table (`two`) through the same
    seeded work, comparing them after every step; returns counts of the paths reached."""
    rng = random.Random(seed)
    (one, one_ev), (two, two_ev) = [world(blocks, prefix=prefix, slots=slots, gpu=HostBackend() if gpu else None)
                                    for _ in range(2)]
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(3, 16))] for _ in range(4)]
    reached = dict(decode_steps=0, renamed=0, copies=0, stored_in_step=0, evicted_in_step=0, skipped=0, extra=0)
    rename: dict[int, int] = {}
    next_id = 0
    seen_one = seen_two = 0
    for _ in range(steps):
        live = list(one._seqs)
        op = rng.random()
        if op < 0.18 or not live:
            base = rng.choice(prompts)
            prompt = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(3))]
            results = []
            for table in (one, two):
                try:
                    results.append(table.add(next_id, prompt))
                except KvCacheExhausted:
                    results.append("exhausted")
            assert results[0] == results[1]
            next_id += 1
        elif op < 0.26:
            src = rng.choice(live)
            for table in (one, two):
                table.fork(src, next_id)
            next_id += 1
        elif op < 0.34:
            victim = rng.choice(live)
            for table in (one, two):
                table.free(victim)
        elif op < 0.38 and prefix:
            seq_id = rng.choice(live)
            assert one.cache_prefix(seq_id) == two.cache_prefix(seq_id)
        else:
            while len(live) > 8 or any(one._seqs[s].num_tokens > 24 for s in live):  # room: no exhaustion
                victim = max(live, key=lambda s: one._seqs[s].num_tokens) if len(live) <= 8 else rng.choice(live)
                live.remove(victim)
                for table in (one, two):
                    table.free(victim)
            batch = rng.sample(live, rng.randrange(len(live) + 1))
            tokens = [rng.randrange(6) for _ in batch]
            reached["extra"] += sum(bool(one._seqs[s].held[SLIDING].extra) for s in batch)
            before = len(one_ev)
            for seq_id, token in zip(batch, tokens):
                one.append(seq_id, 1, [token])
            two.append_decode(batch, tokens)
            reached["decode_steps"] += 1
            reached["stored_in_step"] += any(e.kind == "stored" for e in one_ev[before:])
            reached["evicted_in_step"] += any(e.kind == "removed" for e in one_ev[before:])
        reached["copies"] += len(one._pending)
        fresh = sliding_map(one, two)
        reached["renamed"] += any(x != y for x, y in fresh.items())
        rename.update(fresh)  # (a removed event names a block cached before this step)
        assert snapshot(one, fresh) == snapshot(two)
        assert renamed_events(one_ev[seen_one:], rename) == renamed_events(two_ev[seen_two:])
        seen_one, seen_two = len(one_ev), len(two_ev)
        pend_one, pend_two = one.take_pending_copies(), two.take_pending_copies()
        assert [(g, fresh[a], fresh[b]) if g == SLIDING else (g, a, b) for g, a, b in pend_one] == pend_two
        one.check_invariants()
        two.check_invariants()
    reached["skipped"] = two.skipped_checkpoints()
    reached["evicted"] = [sum(e.kind == "removed" and e.group == g for e in two_ev) for g in range(3)]
    assert reached["skipped"] == one.skipped_checkpoints()
    return reached


@pytest.mark.parametrize("seed", [1, 2])
def test_random_run_with_a_prefix_cache_matches_the_per_call_appends(seed):
    reached = random_twins(seed, prefix=True)
    # block boundaries with sliding ids renamed, copy-on-write copies, offers within a step,
    # the add step's extra blocks given up at the first decode: every path was reached
    assert reached["renamed"] > 0 and reached["copies"] > 0 and reached["stored_in_step"] > 0
    assert reached["extra"] > 0 and reached["evicted_in_step"] > 0


def test_random_run_without_a_prefix_cache_matches():
    reached = random_twins(3, prefix=False)
    assert reached["renamed"] > 0 and reached["copies"] > 0


def test_random_run_with_a_backend_and_a_short_state_pool_matches():
    reached = random_twins(4, prefix=True, gpu=True, slots=14)
    assert reached["skipped"] > 0 and reached["evicted"][STATE] > 0  # checkpoints skipped, slots evicted alike


def refused(table, seq_ids, tokens, error, match):
    before = snapshot(table)
    free = [list(table._cache.group(g).allocator()._free) for g in range(3)]
    with pytest.raises(error, match=match):
        table.append_decode(seq_ids, tokens)
    assert snapshot(table) == before
    assert [list(table._cache.group(g).allocator()._free) for g in range(3)] == free  # the same next ids
    table.check_invariants()


def test_bad_input_is_refused_and_changes_nothing():
    table, _ = world()
    table.add("a", [1, 2, 3])
    table.add("b", [4, 5, 6, 7])  # at a block boundary: the full path
    table.add("c", [8])
    refused(table, ["a", "b"], [1], ValueError, "2 seq_ids but 1 token_ids")
    refused(table, ["a", "b", "zz"], [1, 2, 3], KeyError, "unknown sequence 'zz'")
    refused(table, ["a", "b", "a"], [1, 2, 3], ValueError, "sequence 'a' appears twice")
    refused(table, ["b", "c", "b"], [1, 2, 3], ValueError, "sequence 'b' appears twice")
    refused(table, ["a", "b"], [1, -1], ValueError, r"token_ids\[1\] is -1")
    refused(table, ["a", "b"], [1, 2.0], TypeError, r"token_ids\[1\] must be an int")
    refused(table, ["a", "b"], [True, 2], TypeError, r"token_ids\[0\] must be an int")
    refused(table, "ab", [1, 2], TypeError, "seq_ids must be a list")
    refused(table, ["a", ["x"]], [1, 2], TypeError, r"sequence id \['x'\] is unhashable")
    refused(table, {"a", "b"}, [1, 2], TypeError, "seq_ids must be ordered")
    table.append_decode(("a", "b"), np.array([10, 11]))  # a tuple and an integer array are taken
    assert (table.num_tokens("a"), table.num_tokens("b")) == (4, 5)
    assert table._seqs["a"].tokens == [1, 2, 3, 10]
    table.append_decode([], [])
    table.check_invariants()


def test_exhaustion_mid_step_takes_back_the_earlier_sequences():
    table, events = world(blocks=(7, 64))
    table.add("a", [1, 2])  # full blocks: each needs a full-group block at its next token
    table.add("b", [3, 4])
    table.add("c", [5, 6])
    table.add("d", [7, 8, 9, 10])
    table.add("e", [9])  # the fast path (room in its block); 6 of 7 full blocks held
    assert table._cache.num_free_blocks(group=FULL) == 1
    # "a" gets the last free block (and "e" counts its token), then "b" runs out: all taken back
    refused(table, ["e", "a", "b", "c"], [1, 2, 3, 4], KvCacheExhausted, "asked for 1 block")
    assert not [e for e in events if e.kind == "removed"]
    table.free("d")  # two more free: now the step fits
    table.append_decode(["e", "a", "b", "c"], [1, 2, 3, 4])
    assert [table.num_tokens(s) for s in "eabc"] == [2, 3, 3, 3]
    assert table.slot_mapping(["e", "a"], group=FULL).host.tolist() == [
        table.blocks("e")[0] * BS + 1, table.blocks("a")[1] * BS]
    table.check_invariants()


def test_exhaustion_takes_back_the_checkpoint_slots_and_the_pending_copies():
    table, _ = world(blocks=(6, 64), slots=8)
    table.add("a", [1, 2, 3])  # its next token reaches checkpoint position 4: a slot
    table.fork("a", "f")  # a partly filled last block shared in both attention groups
    table.add("b", [5, 6])  # at a block boundary
    table.add("d", [7, 8, 9, 10])
    table.take_pending_copies()
    assert table._cache.num_free_blocks(group=FULL) == 1
    # "a" copies its shared blocks (pending copies) and takes a checkpoint slot, then "b" finds no full block
    refused(table, ["a", "b"], [7, 8], KvCacheExhausted, "asked for 1 block")
    assert table.take_pending_copies() == []
    table.free("d")  # its blocks go to the prefix cache: evictable
    table.append_decode(["a", "b"], [7, 8])
    ((position, slot),) = table.step_checkpoints("a")
    assert position == 4 and table.checkpoint_slots(["a", "b"]).host.tolist() == [slot, -1]
    assert table.take_pending_copies() == [(g, table.blocks("f", g)[-1], table.blocks("a", g)[-1]) for g in (FULL, SLIDING)]
    table.check_invariants()


def test_a_refused_step_takes_back_its_skipped_checkpoint_counts():
    table, _ = world(blocks=(4, 64), slots=5)
    table.add("a", [1, 2, 3])  # live slot + checkpoint at 2; its next token reaches position 4
    table.add("b", [5, 6])  # live slot + checkpoint at 2; at a block boundary
    table.add("d", [7])  # the last live slot and the last full block
    assert table._cache.group(STATE).num_free_blocks() == table._cache.num_free_blocks(group=FULL) == 0
    # "a" finds no slot for its checkpoint (skipped: no failure), then "b" no full block
    refused(table, ["a", "b"], [7, 8], KvCacheExhausted, "asked for 1 block")
    assert table.skipped_checkpoints() == 0
    table.append_decode(["a"], [7])
    assert table.skipped_checkpoints() == 1 and table.step_checkpoints("a") == []
    table.check_invariants()


class FailingFill(HostBackend):
    """A HostBackend whose block fills fail once `fills_left` reaches 0 (None: never)."""

    fills_left: int | None = None

    def fill_blocks(self, regions, blocks, value, stream):
        if self.fills_left is not None:
            if self.fills_left == 0:
                raise RuntimeError("fill failed")
            self.fills_left -= 1
        super().fill_blocks(regions, blocks, value, stream)


def test_a_backend_error_on_a_later_sequence_frees_the_earlier_ones_blocks():
    gpu = FailingFill(capacity_bytes=1 << 24)
    table, _ = world(gpu=gpu)
    table.add("a", [1, 2])
    table.add("b", [3, 4])
    table.add("c", [5])
    gpu.fills_left = 2  # "a"'s new blocks (full, sliding) are initialised, then "b"'s first fill fails
    refused(table, ["c", "a", "b"], [1, 2, 3], RuntimeError, "fill failed")
    gpu.fills_left = None
    table.append_decode(["c", "a", "b"], [1, 2, 3])
    assert [len(table.blocks(s, FULL)) for s in "cab"] == [1, 2, 2]
    table.check_invariants()


def test_fork_then_decode_copies_the_shared_block_once_per_group():
    table, _ = world(prefix=False)
    table.add("a", [1, 2, 3])  # a partly filled last block in both attention groups
    table.fork("a", "b")
    assert table.take_pending_copies() == [(STATE, table.state_slots(["a"]).host[0], table.state_slots(["b"]).host[0])]
    shared = {g: table.blocks("a", g)[-1] for g in (FULL, SLIDING)}
    table.append_decode(["a", "b"], [7, 8])
    # "a" copied each shared block; "b" was then their only holder and keeps them
    for g in (FULL, SLIDING):
        assert table.blocks("b", g)[-1] == shared[g] != table.blocks("a", g)[-1]
        assert table._cache.group(g).ref_count(shared[g]) == 1
    assert table.take_pending_copies() == [(g, shared[g], table.blocks("a", g)[-1]) for g in (FULL, SLIDING)]
    table.check_invariants()


def test_a_window_release_before_a_later_allocation_gives_other_ids_but_the_same_counts():
    """The documented difference: "a" releases a sliding block that the per-call appends
    hand to "b" at once; the batched step frees it after "b" took a block."""
    tables = [world(prefix=False)[0] for _ in range(2)]
    for table in tables:
        table.add("a", [1, 2, 3, 4, 5, 6])  # the window (5) holds sliding blocks 0..2; the next token releases 0
        table.add("b", [7, 8])
    one, two = tables
    old = one.blocks("a", SLIDING)[0]
    for seq_id, token in (("a", 9), ("b", 9)):
        one.append(seq_id, 1, [token])
    two.append_decode(["a", "b"], [9, 9])
    assert one.blocks("b", SLIDING)[-1] == old  # the per-call appends: "b" reuses "a"'s released block
    assert old not in two.blocks("b", SLIDING)  # the batched step: "b" took another free block
    assert one.blocks("b", FULL) == two.blocks("b", FULL)  # no release in the full group: the same ids
    assert snapshot(one, sliding_map(one, two)) == snapshot(two)


def test_a_window_release_is_not_yet_free_for_a_later_sequence_of_the_step():
    """The documented cost of that order: with the sliding pool one block short, the per-call
    appends get by on "a"'s released block; the batched step needs its new blocks first."""
    tables = [world(blocks=(8, 5), prefix=False)[0] for _ in range(2)]
    for table in tables:
        table.add("a", [1, 2, 3, 4, 5, 6])  # sliding blocks 0..2; the next token takes one, releases one
        table.add("b", [7, 8])  # the next token takes one
        assert table._cache.num_free_blocks(group=SLIDING) == 1
    one, two = tables
    for seq_id, token in (("a", 9), ("b", 9)):
        one.append(seq_id, 1, [token])
    assert one._cache.num_free_blocks(group=SLIDING) == 0
    refused(two, ["a", "b"], [9, 9], KvCacheExhausted, "asked for 1 block")
    two.append_decode(["a"], [9])  # one at a time it fits: "b" then takes the block "a" released
    two.append_decode(["b"], [9])
    assert snapshot(one, sliding_map(one, two)) == snapshot(two)


def test_the_step_reports_its_evictions_before_the_offers_of_its_releases():
    runs = []
    for batched in (False, True):
        table, events = world(blocks=(7, 64))
        table.add("x", [1, 2, 3, 4])
        table.free("x")  # its two full blocks cached: evictable
        table.add("a", [5, 6, 7, 8, 9, 10])  # the next token releases sliding block 0, written: offered
        table.add("b", [11, 12])  # the next token needs the full pool's last block: an eviction
        assert table._cache.num_free_blocks(group=FULL) == 1
        del events[:]
        if batched:
            table.append_decode(["a", "b"], [1, 2])
        else:
            table.append("a", 1, [1])
            table.append("b", 1, [2])
        runs.append([(e.kind, e.group) for e in events])
        table.check_invariants()
    assert runs == [[("stored", SLIDING), ("removed", FULL)], [("removed", FULL), ("stored", SLIDING)]]


class FailingCopy(HostBackend):
    """A HostBackend whose block copies fail while `fail` is set."""

    fail = False

    def copy_blocks(self, *args, **kwargs):
        if self.fail:
            raise RuntimeError("copy failed")
        return super().copy_blocks(*args, **kwargs)


@pytest.mark.parametrize("way", ["append", "append_decode"])
def test_a_step_whose_copy_fails_after_skipping_a_checkpoint_leaves_the_count(way):
    gpu = FailingCopy(capacity_bytes=1 << 24)
    table, _ = world(gpu=gpu, slots=3)
    table.add("a", [1, 2, 3])  # live slot + checkpoint at 2
    table.fork("a", "b")  # the third slot; the partly filled last blocks shared
    gpu.fail = True
    with pytest.raises(RuntimeError, match="copy failed"):  # checkpoint 4: no slot (skipped), then the copy fails
        table.append("a", 1, [7]) if way == "append" else table.append_decode(["a"], [7])
    assert table.skipped_checkpoints() == 0 and table.num_tokens("a") == 3 and table.take_pending_copies() == []
    gpu.fail = False
    table.append("a", 1, [7]) if way == "append" else table.append_decode(["a"], [7])
    assert table.skipped_checkpoints() == 1 and table.num_tokens("a") == 4
    table.check_invariants()


def test_a_sequence_moved_to_another_table_is_not_taken_for_a_repeat():
    from pagedkv.tiers.hybrid_host_tier import HybridHostTier

    gpu = HostBackend(capacity_bytes=1 << 24)
    cache = PagedKvCache(config(), [64, 64, None], gpu, num_state_slots=8)
    tier = HybridHostTier(cache, [16, 16, None], gpu, num_state_slots=4)
    first, second = SequenceTable(cache, None, gpu), SequenceTable(cache, None, gpu)
    first.add("s", [1, 2, 3])
    first.append_decode(["s"], [4])  # the record carries this call's mark
    second.swap_in(first.swap_out("s", tier))
    second.append_decode(["s"], [5])  # the other table's first call: never the same mark
    assert second.num_tokens("s") == 5
    second.check_invariants()
