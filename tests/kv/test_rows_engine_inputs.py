"""What an engine hands `write_tokens` / `read_tokens` (issue 24's findings): reads that name
a slot more than once (a decode batch whose sequences share a prefix-cached block), and
float64 rows (rounded to float32, a value with no float32 refused naming it)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import KvCacheConfig, PagedKvCache


@pytest.fixture
def cache(gpu):
    cfg = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=32, num_layers=1, dtype="turbo4k_turbo3v")
    c = PagedKvCache(cfg, 4, gpu)
    c.alloc_blocks(4)
    c.poison_blocks(range(4), gpu, gpu.default_stream())
    yield c
    c.release(gpu)


def rows(seed, n=6):
    return (np.random.default_rng(seed).standard_normal((n, 2, 32)) * 3).astype(np.float32)


def test_a_read_may_repeat_slots_and_gets_the_row_each_time(gpu, cache):
    slots = np.array([5, 0, 9, 1, 14, 6])
    k, v = rows(1), rows(2)
    cache.write_tokens(0, slots, k, v, gpu, 0)
    once_k, once_v = cache.read_tokens(0, slots, gpu)
    asked = np.array([9, 5, 9, -1, 5, 5, 14, -1, 0])
    k_back, v_back = cache.read_tokens(0, asked, gpu)
    where = {int(s): i for i, s in enumerate(slots)}
    for i, slot in enumerate(asked):
        if slot == -1:
            assert not k_back[i].any() and not v_back[i].any()
        else:
            assert np.array_equal(k_back[i], once_k[where[int(slot)]])  # bit-equal to the unrepeated read
            assert np.array_equal(v_back[i], once_v[where[int(slot)]])


def test_writes_still_refuse_a_repeated_slot(gpu, cache):
    with pytest.raises(ValueError, match="slot 5 appears more than once"):
        cache.write_tokens(0, [5, 1, 5], rows(1, 3), rows(2, 3), gpu, 0)


def test_float64_rows_are_written_as_their_float32_rounding(gpu, cache):
    exact = np.random.default_rng(3).standard_normal((6, 2, 32)) * 3  # float64, most with no float32
    slots = np.arange(6)
    cache.write_tokens(0, slots, exact, exact, gpu, 0)
    from_64 = cache.read_tokens(0, slots, gpu)
    raw_64 = [cache.read_block(0, b, gpu) for b in (0, 1)]
    cache.write_tokens(0, slots, exact.astype(np.float32), exact.astype(np.float32), gpu, 0)
    raw_32 = [cache.read_block(0, b, gpu) for b in (0, 1)]
    assert all(np.array_equal(a, b) for pair_64, pair_32 in zip(raw_64, raw_32) for a, b in zip(pair_64, pair_32))
    assert np.array_equal(from_64[0], cache.read_tokens(0, slots, gpu)[0])


def test_a_float64_beyond_float32_is_refused_naming_it_and_nothing_is_written(gpu, cache):
    big = rows(4).astype(np.float64)
    big[3, 1, 7] = -4e38  # finite in float64, -inf in float32
    before = [cache.read_block(0, b, gpu) for b in range(4)]
    with pytest.raises(ValueError, match=r"k\[3, 1, 7\] = -4e\+38 is beyond float32's range"):
        cache.write_tokens(0, np.arange(6), big, rows(5), gpu, 0)
    after = [cache.read_block(0, b, gpu) for b in range(4)]
    assert all(np.array_equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))
    skipped = np.array([0, 1, 2, -1, 4, 5])  # the row is skipped: not inspected, the others written
    cache.write_tokens(0, skipped, big, rows(5), gpu, 0)
    assert not np.array_equal(cache.read_block(0, 0, gpu)[0], before[0][0])
