"""Speculative decoding on SequenceTable: `append(..., lookahead=k)` gives draft positions
slots without committing them, `truncate` takes back any suffix. Unit cases, then the
property test: seeded random add/append/lookahead/truncate/fork/cache/free against a
reference (`spec_world`), the KV of every position audited."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable

from spec_world import SpecWorld

BS = 4


def make(prefix=True, window=None, blocks=16):
    gpu = HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16",
                        cache_blocks_per_seq=window)
    cache = PagedKvCache(cfg, blocks, gpu)
    pc = PrefixCache(cache) if prefix else None
    return gpu, cache, pc, SequenceTable(cache, pc, gpu)


def slots_of(table, seq, positions):
    b, first = table.blocks(seq), table.first_block_position(seq)
    return [b[(p - first) // BS] * BS + p % BS for p in positions]


def test_lookahead_gives_the_drafts_slots_after_the_step_tokens_without_committing_them():
    gpu, cache, _, table = make(prefix=False)
    table.add("a", list(range(5)))
    table.append("a", 1, [5], lookahead=3)  # position 5 committed, 6..8 drafts
    assert (table.num_tokens("a"), table.num_lookahead("a")) == (6, 3)
    assert len(table.blocks("a")) == 3  # positions 0..8
    assert np.asarray(table.slot_mapping(["a"])).tolist() == slots_of(table, "a", range(5, 9))
    assert table.seq_lens(["a"]).host.tolist() == [9]
    assert table.page_table(["a"]).host.last_page_len.tolist() == [1]
    table.check_invariants()
    table.release()
    cache.release(gpu)


def test_the_next_append_reuses_the_draft_positions_and_releases_what_it_no_longer_needs():
    gpu, cache, _, table = make(prefix=False)
    table.add("a", list(range(6)))
    table.append("a", 1, [6], lookahead=4)  # positions 6..10: three blocks
    before = table.blocks("a")
    draft_slots = slots_of(table, "a", range(7, 11))
    free_before = cache.num_free_blocks()
    table.append("a", 2, [7, 8])  # two drafts accepted (their slots, their blocks), no new lookahead
    assert table.blocks("a") == before[:3] and (table.num_tokens("a"), table.num_lookahead("a")) == (9, 0)
    assert np.asarray(table.slot_mapping(["a"])).tolist() == draft_slots[:2]
    table.append("a", 1, [9], lookahead=0)
    assert cache.num_free_blocks() == free_before and table.blocks("a") == before
    table.truncate("a", 9)  # drop back across the block boundary
    assert table.blocks("a") == before[:3] and cache.num_free_blocks() == free_before
    table.append("a", 1, [9], lookahead=4)  # 9..14: one more block
    assert len(table.blocks("a")) == 4 and cache.num_free_blocks() == free_before - 1
    table.append("a", 1, [10])  # the drafts go: the fourth block with them
    assert len(table.blocks("a")) == 3 and cache.num_free_blocks() == free_before
    table.check_invariants()
    table.release()
    cache.release(gpu)


def test_drafts_never_reach_the_prefix_cache():
    gpu, cache, pc, table = make()
    table.add("a", list(range(6)))
    table.append("a", 1, [6], lookahead=5)  # block 1 is full only with drafts
    assert table.cache_prefix("a") == 1  # block 0 only
    table.free("a")
    assert pc.num_cached_blocks() == 1
    found = pc.match(list(range(12)))
    assert found.num_tokens == 4
    cache.free_blocks(found.blocks)
    table.check_invariants()
    pc.close()
    table.release()
    cache.release(gpu)


def test_truncate_into_a_cached_block_copies_it_before_the_next_write_and_never_writes_it():
    gpu, cache, pc, table = make()
    table.add("a", list(range(9)))
    k = np.ones((9, 1, 16), np.float32)
    cache.write_tokens(0, table.token_slots("a").host, k, k, gpu, 0)
    assert table.cache_prefix("a") == 2
    cached = table.blocks("a")[1]
    kept = cache.read_block(0, cached, gpu)
    table.truncate("a", 6)  # block 1 partly filled again, and the prefix cache holds it
    assert table.blocks("a")[1] == cached and len(table.blocks("a")) == 2
    assert table.cache_prefix("a") == 0  # a partly filled block is not offered
    table.append("a", 1, [99])
    assert table.blocks("a")[1] != cached  # copied first
    two = 2 * np.ones((1, 1, 16), np.float32)
    cache.write_tokens(0, table.slot_mapping(["a"]), two, two, gpu, 0)  # refused if it named the cached block
    assert all(np.array_equal(a, b) for a, b in zip(kept, cache.read_block(0, cached, gpu)))
    back = cache.read_tokens(0, table.token_slots("a").host, gpu)[0][:, 0, 0].tolist()
    assert back == [1, 1, 1, 1, 1, 1, 2]  # the copy kept positions 4 and 5
    table.append("a", 1, [98])  # block 1 full again with committed ids: offered, under its new tokens
    assert table.cache_prefix("a") == 1 and pc.is_cached(table.blocks("a")[1]) and pc.is_cached(cached)
    table.check_invariants()
    pc.close()
    table.release()
    cache.release(gpu)


def test_truncate_forgets_ids_past_the_end_so_a_count_only_suffix_can_be_taken_back():
    gpu, cache, pc, table = make()
    table.add("a", list(range(3)))
    table.append("a", 3)  # three ids given only as a count: nothing past position 2 is cacheable
    assert table.cache_prefix("a") == 0
    table.truncate("a", 3)
    table.append("a", 5, [3, 4, 5, 6, 7])
    assert table.cache_prefix("a") == 2  # every id known again
    table.check_invariants()
    pc.close()
    table.release()
    cache.release(gpu)


def test_fork_copies_the_committed_tokens_only():
    gpu, cache, _, table = make(prefix=False)
    table.add("a", list(range(6)))
    table.append("a", 1, [6], lookahead=4)
    table.fork("a", "b")
    assert (table.num_tokens("b"), table.num_lookahead("b")) == (7, 0)
    assert table.blocks("b") == table.blocks("a")[:2]
    assert [cache.ref_count(x) for x in table.blocks("a")] == [2, 2, 1]
    table.append("b", 1, [7])  # shared, partly filled: copied
    assert table.blocks("b")[1] != table.blocks("a")[1]
    table.check_invariants()
    table.release()
    cache.release(gpu)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda t: t.truncate("a", 8), ValueError, "num_tokens is 8, past the 7 tokens"),
        (lambda t: t.truncate("a", -1), ValueError, "num_tokens"),
        (lambda t: t.truncate("z", 0), KeyError, "'z'"),
        (lambda t: t.append("a", 1, [1], lookahead=-2), ValueError, "lookahead"),
        (lambda t: t.append("a", 1, [1], lookahead=1.5), ValueError, "lookahead must be a non-negative int, got 1.5"),
    ],
)
def test_bad_calls_raise_naming_the_value_and_change_nothing(call, error, words):
    gpu, cache, _, table = make(prefix=False)
    table.add("a", list(range(6)))
    table.append("a", 1, [6], lookahead=2)
    state = (table.blocks("a"), table.num_tokens("a"), table.num_lookahead("a"), cache.num_free_blocks())
    with pytest.raises(error, match=words):
        call(table)
    assert state == (table.blocks("a"), table.num_tokens("a"), table.num_lookahead("a"), cache.num_free_blocks())
    table.release()
    cache.release(gpu)


def test_truncate_refuses_positions_the_window_released():
    gpu, cache, _, table = make(prefix=False, window=2)
    table.add("a", list(range(6)))
    table.append("a", 2)
    table.append("a", 3)  # 11 tokens, blocks from position 4 on
    with pytest.raises(ValueError, match="released the blocks before position 4"):
        table.truncate("a", 3)
    table.truncate("a", 4)
    assert table.blocks("a") == [] and table.seq_lens(["a"]).host.tolist() == [0]
    table.append("a", 1)
    table.check_invariants()
    table.release()
    cache.release(gpu)


@pytest.mark.parametrize("seed, steps, window", [(0, 2500, None), (1, 2500, None), (2, 2500, None),
                                                 (3, 1500, None), (4, 600, 3), (5, 600, 2)])
def test_random_speculative_steps_against_the_reference(seed, steps, window):
    """>= 10,000 seeded steps over the parameters, zero violations."""
    world = SpecWorld(seed, num_blocks=40 if window is None else 14, window=window)
    for i in range(steps):
        world.step()
        if i % 100 == 99:
            world.check_all()
    world.check_all()
    assert world.violations == []
    stats = world.prefix.stats()
    assert stats.hit_tokens > 0 and stats.evictions > 0 and world.steps == steps  # it matched and evicted
    world.close()


def test_the_readme_drafting_step_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Serving: drafting"):readme.index("## Host tier")]
    (example,) = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["cache"].num_blocks() == 0 and namespace["gpu"].live_allocations() == 0
