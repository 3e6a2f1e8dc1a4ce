"""State pools sized for the checkpoints a sequence holds, and a step short of checkpoint
slots: it skips the shallowest ones (counted), never fails, and leaves the counts exact."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.cli import main
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.groups.layout import GroupLayout, split_budget

STATE = (((4,), "float32"),)  # 16 bytes a layer


def config(every=8, block_size=4):
    return KvCacheConfig(block_size, 1, 16, 3, "bf16", layer_groups=(
        LayerGroup("full", (0,)),
        LayerGroup("sliding", (1,), window=8),
        LayerGroup("state", (2,), state=STATE, checkpoint_every=every),
    ))


@pytest.mark.parametrize("every, context, expected", [
    (8, 100, 12 + 2),   # 8, 16, ..., 96, the prompt end 100 and a branch point (20, say)
    (8, 96, 12 + 2),    # 8..96 and two unit ends between them (a shorter prompt's end, a branch point)
    (8, 8, 1 + 1),      # 8, and the unit end 4
    (8, 4, 0 + 1),      # only the unit end 4
    (8, 3, 0),          # no whole unit
    (None, 100, 2),     # the prompt end and the branch point
    (None, 4, 1),
    (4, 100, 25),       # every unit end is a multiple of 4
])
def test_checkpoints_per_sequence_counts_what_a_sequence_can_hold(every, context, expected):
    layout = GroupLayout(config(every))
    assert layout.checkpoints_per_sequence(2, context) == expected
    assert layout.checkpoints_per_sequence(0, context) == 0
    assert layout.held_bytes_per_sequence(2, context) == (1 + expected) * 16
    assert layout.held_bytes_per_sequence(0, context) == layout.bytes_per_sequence(0, context)


def test_the_bound_is_reached_by_a_prompt_that_branches():
    """100 tokens, checkpoint_every 8: a first prompt reaches 8..96 and its end 100 (13); a
    second that leaves the first's chain at 20 (no multiple of 8) reaches the branch point
    too: 14, the bound."""
    gpu = HostBackend()
    cache = PagedKvCache(config(), [64, 64, None], gpu, num_state_slots=64)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    layout = GroupLayout(config())
    table.add("a", list(range(1, 101)))
    assert [pos for pos, _ in table.step_checkpoints("a")] == list(range(8, 97, 8)) + [100]
    table.free("a")
    assert table.add("b", list(range(1, 21)) + [500 + i for i in range(80)]) == 0
    positions = [pos for pos, _ in table.step_checkpoints("b")]
    assert positions == sorted(list(range(8, 97, 8)) + [20, 100])
    assert len(positions) == layout.checkpoints_per_sequence(2, 100) == 14
    table.free("b")
    prefix.close()
    cache.release(gpu)


def test_split_budget_reserves_the_checkpoints_of_the_context():
    cfg = config(every=8)
    layout = GroupLayout(cfg)
    per_seq = 25 * layout.bytes_per_block(0) + 3 * layout.bytes_per_block(1) + (1 + 14) * 16
    rows = split_budget(cfg, 4 * per_seq, context=100, concurrency=4)
    assert [(r.kind, r.count, r.checkpoints_per_sequence) for r in rows] == [
        ("full", 100, 0), ("sliding", 12, 0), ("state", 60, 14)]
    assert sum(r.bytes for r in rows) == 4 * per_seq
    assert rows[2].bytes_per_sequence == 16  # the live slot; the checkpoints beside it
    assert PagedKvCache.compute_num_blocks(cfg, 4 * per_seq, context=100, concurrency=4) == [100, 12, 60]
    # an explicit count still wins
    old = split_budget(cfg, 4 * per_seq, context=100, concurrency=4, checkpoints_per_seq=1)
    assert old[2].checkpoints_per_sequence == 1 and old[2].count < 60
    # no prefix cache, no checkpoints: one live slot per sequence, the rest to the attention groups
    bare = 25 * layout.bytes_per_block(0) + 3 * layout.bytes_per_block(1) + 16
    counts = PagedKvCache.compute_num_blocks(cfg, 4 * bare, context=100, concurrency=4, checkpoints_per_seq=0)
    assert counts == [100, 12, 4]
    with pytest.raises(ValueError, match="does not hold one sequence"):
        split_budget(cfg, per_seq - 1, context=100, concurrency=1)


def test_a_cache_sized_by_compute_num_blocks_holds_every_checkpoint_of_its_sequences():
    cfg = config(every=8)
    layout = GroupLayout(cfg)
    per_seq = layout.total_held_bytes_per_sequence(100)
    counts = PagedKvCache.compute_num_blocks(cfg, 3 * per_seq, context=100, concurrency=3)
    gpu = HostBackend()
    cache = PagedKvCache(cfg, counts[:2] + [None], gpu, num_state_slots=counts[2])
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    for i in range(3):  # three sequences of 100 tokens at once, every checkpoint held
        table.add(i, [1000 * i + t for t in range(1, 97)])
        table.append(i, 4, list(range(4)))
    assert table.skipped_checkpoints() == 0
    assert cache.num_free_blocks(group=2) == counts[2] - 3 * (1 + 12)
    table.check_invariants()
    for i in range(3):
        table.free(i)
    prefix.close()
    cache.release(gpu)


def test_a_step_short_of_checkpoint_slots_skips_the_shallowest_and_succeeds():
    gpu = HostBackend()
    cache = PagedKvCache(config(), [64, 64, None], gpu, num_state_slots=3)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(1, 42)))  # live slot + 2 of the 5 positions 8, 16, 24, 32, 40
    assert [pos for pos, _ in table.step_checkpoints("a")] == [32, 40]
    assert table.skipped_checkpoints() == table.skipped_checkpoints(2) == 3
    assert cache.num_free_blocks(group=2) == 0
    table.append("a", 7, list(range(7)))  # reaches 48: no slot left, skipped; the step still happens
    assert table.num_tokens("a") == 48 and table.step_checkpoints("a") == []
    assert np.asarray(table.checkpoint_slots(["a"])).tolist() == [-1]
    assert table.skipped_checkpoints() == 4
    table.check_invariants()
    table.free("a")  # 32 and 40 cached: evictable now
    assert prefix.num_cached(2) == 2
    table.add("b", list(range(1, 41)) + [7, 7, 7, 7, 7, 7, 7, 7, 9])  # hits at 40; 48 gets the evictable slot 32
    assert table.num_tokens("b") == 49
    assert [pos for pos, _ in table.step_checkpoints("b")] == [48]
    assert table.skipped_checkpoints() == 4
    table.check_invariants()
    table.free("b")
    prefix.close()
    cache.release(gpu)


def test_live_slots_are_still_all_or_nothing():
    gpu = HostBackend()
    cache = PagedKvCache(config(), [64, 64, None], gpu, num_state_slots=1)
    table = SequenceTable(cache, PrefixCache(cache), gpu)
    table.add("a", list(range(1, 20)))  # the live slot; both checkpoints (8, 16) skipped
    assert table.skipped_checkpoints() == 2
    free = [cache.num_free_blocks(group=g) for g in range(3)]
    from pagedkv import KvCacheExhausted
    with pytest.raises(KvCacheExhausted):
        table.add("b", [5, 6, 7])
    assert [cache.num_free_blocks(group=g) for g in range(3)] == free
    table.check_invariants()


def test_plan_groups_prints_the_checkpoints_per_sequence(capsys):
    assert main(["plan", "--layers", "8", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GiB",
                 "--groups", "state:7,full:1", "--state", "4x8192:bfloat16", "--checkpoint-every", "4096",
                 "--context", "32768", "--concurrency", "2"]) in (0, None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "ckpts/seq"
    state, full = lines[2].split(), lines[3].split()
    assert (state[1], state[-1]) == ("state", "10") and (full[1], full[-1]) == ("full", "-")
    cfg = KvCacheConfig(16, 8, 128, 8, "bf16", layer_groups=(
        LayerGroup("state", tuple(range(7)), state=(((4, 8192), "bfloat16"),), checkpoint_every=4096),
        LayerGroup("full", (7,))))
    counts = PagedKvCache.compute_num_blocks(cfg, 2**30, context=32768, concurrency=2)
    assert [int(state[6].replace(",", "")), int(full[6].replace(",", ""))] == counts
    held = GroupLayout(cfg).total_held_bytes_per_sequence(32768)
    assert lines[4].endswith(f", {held:,} with its checkpoints; {2**30 // held:,} sequences fit")
    assert main(["plan", "--layers", "2", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GiB",
              "--groups", "full:1", "--checkpoint-every", "64", "--context", "100"]) == 2
    assert "--checkpoint-every is for state layers" in capsys.readouterr().err
