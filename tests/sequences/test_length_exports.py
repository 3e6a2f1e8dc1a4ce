"""`SequenceTable.seq_lens` and `token_slots`: the token counts beside the block table and
every slot of a sequence, host and device, window included."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, SequenceTable


def make(window=None, gpu=None):
    gpu = gpu or HostBackend(1 << 26)
    cfg = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16",
                        cache_blocks_per_seq=window)
    cache = PagedKvCache(cfg, 16, gpu)
    return gpu, cache, SequenceTable(cache, gpu=gpu)


def test_seq_lens_are_int32_token_counts_in_batch_order_and_uploaded():
    gpu, cache, table = make()
    table.add("a", list(range(9)))
    table.add("b", list(range(3)))
    table.add("c", [])
    table.append("b", 2)
    lens = table.seq_lens(["b", "c", "a"])
    assert lens.host.dtype == np.int32 and lens.host.tolist() == [5, 0, 9]
    back = np.empty(3, np.int32)
    gpu.copy_d2h(lens.device, back)
    assert back.tolist() == [5, 0, 9]
    with pytest.raises(ValueError, match="listed more than once"):
        table.seq_lens(["a", "a"])
    with pytest.raises(KeyError, match="'z'"):
        table.seq_lens(["z"])
    table.release()
    cache.release(gpu)


def test_with_a_window_seq_lens_count_the_held_blocks_only():
    gpu, cache, table = make(window=2)
    table.add("a", list(range(6)))
    table.append("a", 2)
    table.append("a", 5)  # 13 tokens: 4 blocks, the window keeps the last 2
    assert table.first_block_position("a") == 8
    assert table.seq_lens(["a"]).host.tolist() == [13 - 8]
    page = table.page_table(["a"]).host
    assert (len(page.indices) - 1) * 4 + page.last_page_len[0] == 5  # the same count, from the page table
    table.release()
    cache.release(gpu)


def test_token_slots_of_a_whole_prompt_and_of_a_range():
    gpu, cache, table = make()
    table.add("a", list(range(10)))
    b = table.blocks("a")
    every = [b[p // 4] * 4 + p % 4 for p in range(10)]
    assert table.token_slots("a").host.dtype == np.int64
    assert table.token_slots("a").host.tolist() == every
    assert table.token_slots("a", 3, 7).host.tolist() == every[3:7]
    assert table.token_slots("a", 10).host.tolist() == []
    assert table.token_slots("a").host.tolist() == np.asarray(table.slot_mapping(["a"])).tolist()  # add's own step
    back = np.empty(10, np.int64)
    gpu.copy_d2h(table.token_slots("a").device, back)
    assert back.tolist() == every
    for start, stop, words in ((0, 11, "stop is 11, past the 10 positions"), (5, 4, "start is 5, after stop 4"),
                               (-1, None, "start"), (0, 2.0, "stop")):
        with pytest.raises((ValueError, TypeError), match=words):
            table.token_slots("a", start, stop)
    table.release()
    cache.release(gpu)


def test_token_slots_refuse_positions_a_window_released():
    gpu, cache, table = make(window=2)
    table.add("a", list(range(6)))
    table.append("a", 2)
    table.append("a", 5)
    b = table.blocks("a")
    assert table.token_slots("a", 8).host.tolist() == [b[(p - 8) // 4] * 4 + p % 4 for p in range(8, 13)]
    with pytest.raises(ValueError, match="released positions before 8"):
        table.token_slots("a", 7)
    table.release()
    cache.release(gpu)
