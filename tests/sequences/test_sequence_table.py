"""SequenceTable: add/append/fork/free, copy-on-write, sliding window, exports, all-or-nothing."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest

from pagedkv import (
    ConcurrentUseError,
    DeviceMemoryError,
    HostBackend,
    KvCacheConfig,
    KvCacheError,
    KvCacheExhausted,
    PagedKvCache,
    PageTable,
    PrefixCache,
    SequenceTable,
)

BS = 4


def make_cache(gpu, num_blocks=8, window=None):
    config = KvCacheConfig(
        block_size=BS, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16", cache_blocks_per_seq=window
    )
    return PagedKvCache(config, num_blocks, gpu)


def counts(cache):
    return [cache.ref_count(b) for b in range(cache.num_blocks())]


def fill_block(cache, gpu, block, value):
    cache.fill_blocks([block], value, gpu, gpu.default_stream())  # a free block: write_block refuses it
    gpu.synchronize(gpu.default_stream())


def block_bytes(cache, gpu, block, layer=0):
    k, v = cache.read_block(layer, block, gpu)
    return set(k.tolist()) | set(v.tolist())


def test_add_and_append_allocate_at_block_boundaries(gpu):
    cache = make_cache(gpu)
    table = SequenceTable(cache, gpu=gpu)
    assert table.add("a", list(range(6))) == 0
    assert table.blocks("a") == [0, 1] and table.num_tokens("a") == 6
    assert table.slot_mapping(["a"]).host.tolist() == [0, 1, 2, 3, 4, 5]
    table.append("a")
    table.append("a", 1)
    assert table.blocks("a") == [0, 1] and cache.num_free_blocks() == 6
    table.append("a", 3)
    assert table.blocks("a") == [0, 1, 2] and table.num_tokens("a") == 11
    assert table.slot_mapping(["a"]).host.tolist() == [8, 9, 10]
    table.append("a", 0)
    assert table.slot_mapping(["a"]).host.tolist() == []
    table.check_invariants()
    table.free("a")
    assert cache.num_free_blocks() == 8
    table.check_invariants()


def test_new_blocks_are_zeroed(gpu):
    cache = make_cache(gpu)
    fill_block(cache, gpu, 0, 0xAB)
    fill_block(cache, gpu, 1, 0xAB)
    table = SequenceTable(cache, gpu=gpu)
    table.add("a", [1, 2, 3])
    table.append("a", 2)
    assert table.blocks("a") == [0, 1]
    assert block_bytes(cache, gpu, 0) == {0} and block_bytes(cache, gpu, 1, layer=1) == {0}


def test_new_blocks_are_poisoned_under_the_flag(gpu, env_flags):
    env_flags(METRALE_KV_POISON="1")
    cache = make_cache(gpu)
    table = SequenceTable(cache, gpu=gpu)
    table.add("a", [1, 2, 3, 4, 5])
    assert block_bytes(cache, gpu, 1) == {0xFF}


def test_add_reuses_the_prefix_cache_but_computes_the_last_token(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    prompt = list(range(8))
    assert table.add("a", prompt) == 0
    table.free("a")
    assert prefix.num_cached_blocks() == 2
    assert table.add("b", prompt) == 4  # the second block holds the last token: recomputed
    assert table.blocks("b") == [0, 2]
    assert table.slot_mapping(["b"]).host.tolist() == [8, 9, 10, 11]
    assert table.add("c", prompt + [8, 9]) == 8
    assert table.blocks("c")[:2] == [0, 1] and cache.ref_count(0) == 3
    table.check_invariants()
    assert prefix.stats().hit_tokens == 12


def test_free_offers_only_blocks_whose_tokens_are_known(gpu):
    cache = make_cache(gpu, num_blocks=12)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", [1, 2, 3, 4, 5, 6])
    table.append("a", token_ids=[7, 8, 9])
    table.append("a", 3)  # ids unknown from position 9 on
    table.append("a", token_ids=[0, 0, 0, 0])
    assert table.num_tokens("a") == 16
    table.free("a")
    assert prefix.num_cached_blocks() == 2
    assert prefix.match([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 8


def test_cache_prefix_publishes_a_live_sequence(gpu):
    cache = make_cache(gpu)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(9)))
    assert table.cache_prefix("a") == 2
    assert table.cache_prefix("a") == 0
    assert table.add("b", list(range(9))) == 8
    table.check_invariants()


def test_fork_shares_blocks_and_copies_the_partial_block_on_write(gpu):
    cache = make_cache(gpu)
    table = SequenceTable(cache, gpu=gpu)
    table.add("p", list(range(6)))
    fill_block(cache, gpu, 1, 0x5A)  # the engine wrote the prompt's KV
    table.fork("p", "c")
    assert table.blocks("c") == [0, 1] and counts(cache)[:2] == [2, 2]
    table.append("c", 1)
    assert table.blocks("c") == [0, 2] and counts(cache)[:3] == [2, 1, 1]
    assert block_bytes(cache, gpu, 2) == {0x5A}  # copied, not zeroed
    table.append("p", 1)
    assert table.blocks("p") == [0, 1]  # the parent's block is private again: no copy
    table.check_invariants()
    table.free("p")
    table.free("c")
    assert cache.num_free_blocks() == 8


def test_fork_at_a_block_boundary_copies_nothing(gpu):
    cache = make_cache(gpu)
    table = SequenceTable(cache, gpu=gpu)
    table.add("p", list(range(8)))
    table.fork("p", "c")
    table.append("c", 1)
    table.append("p", 1)
    assert table.blocks("c") == [0, 1, 2] and table.blocks("p") == [0, 1, 3]
    table.check_invariants()


def test_without_a_backend_copies_are_handed_to_the_engine(gpu):
    cache = make_cache(gpu)
    table = SequenceTable(cache)
    table.add("p", [1, 2])
    table.fork("p", "c")
    table.append("p", 1)
    assert table.take_pending_copies() == [(0, 1)]
    assert table.take_pending_copies() == []
    assert table.block_table(["p"]).device is None


def test_sliding_window_releases_the_oldest_block(gpu):
    cache = make_cache(gpu, window=2)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(7)))
    table.append("a", 2)
    assert table.blocks("a") == [1, 2] and cache.ref_count(0) == 0
    assert table.first_block_position("a") == 4 and table.num_tokens("a") == 9
    assert table.slot_mapping(["a"]).host.tolist() == [7, 8]
    page = table.page_table(["a"]).host
    assert page.indices.tolist() == [1, 2] and page.last_page_len.tolist() == [1]
    with pytest.raises(ValueError, match="prompt of 9 tokens needs 3 blocks but the window holds 2"):
        table.add("b", list(range(9)))
    with pytest.raises(ValueError, match="appending 8 tokens at position 9 spans 3 blocks"):
        table.append("a", 8)
    table.free("a")
    assert prefix.num_cached_blocks() == 0  # its chain no longer starts at the prompt
    table.check_invariants()


def test_exports_and_their_single_upload(gpu):
    cache = make_cache(gpu, num_blocks=16)
    table = SequenceTable(cache, gpu=gpu)
    table.add(7, list(range(9)))
    table.add(3, [5])
    table.add(9, [])
    exported = table.block_table([3, 7, 9])
    assert exported.host.dtype == np.int32
    assert exported.host.tolist() == [[3, -1, -1], [0, 1, 2], [-1, -1, -1]]
    back = np.empty_like(exported.host)
    gpu.copy_d2h(exported.device, back)
    assert back.tolist() == exported.host.tolist()
    page = table.page_table([7, 3, 9])
    assert [a.tolist() for a in page.host] == [[0, 3, 4, 4], [0, 1, 2, 3], [1, 1, 0]]
    assert all(a.dtype == np.int32 for a in page.host)
    for host_array, ptr in zip(page.host, page.device):
        back = np.empty_like(host_array)
        gpu.copy_d2h(ptr, back)
        assert back.tolist() == host_array.tolist()
    slots = table.slot_mapping([3, 7], pad_to=12)
    assert slots.host.dtype == np.int64
    assert slots.host.tolist() == [12, 0, 1, 2, 3, 4, 5, 6, 7, 8, -1, -1]
    back = np.empty_like(slots.host)
    gpu.copy_d2h(slots.device, back)
    assert back.tolist() == slots.host.tolist()
    with pytest.raises(ValueError, match="pad_to must be an int >= the 10 slots, got 4"):
        table.slot_mapping([3, 7], pad_to=4)
    assert isinstance(page.host, PageTable)
    table.release()
    table.release()


def test_errors_name_the_bad_value(gpu):
    cache = make_cache(gpu)
    table = SequenceTable(cache, gpu=gpu)
    table.add("a", [1])
    with pytest.raises(ValueError, match="sequence 'a' already exists"):
        table.add("a", [1])
    for call in (lambda: table.append("x"), lambda: table.free("x"), lambda: table.fork("x", "y")):
        with pytest.raises(KeyError, match="unknown sequence 'x'"):
            call()
    with pytest.raises(ValueError, match="sequence 'a' already exists"):
        table.fork("a", "a")
    with pytest.raises(ValueError, match="n_tokens must be a non-negative int, got -1"):
        table.append("a", -1)
    with pytest.raises(ValueError, match="n_tokens is 2 but 1 token ids were given"):
        table.append("a", 2, token_ids=[5])
    with pytest.raises(KeyError, match="unknown sequence 'q'"):
        table.block_table(["a", "q"])
    with pytest.raises(ValueError, match="prefix_cache is attached to a different PagedKvCache"):
        SequenceTable(cache, PrefixCache(make_cache(gpu)))


def test_running_out_of_blocks_changes_nothing(gpu):
    cache = make_cache(gpu, num_blocks=4)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(9)))
    table.cache_prefix("a")
    before = (counts(cache), cache.num_free_blocks(), prefix.num_cached_blocks())
    with pytest.raises(KvCacheExhausted):
        table.add("b", list(range(8)) + [50] * 8)  # matches one block, needs three more
    assert (counts(cache), cache.num_free_blocks(), prefix.num_cached_blocks()) == before
    assert "b" not in table
    table.append("a", 3)
    with pytest.raises(KvCacheExhausted):
        table.append("a", 8)
    assert table.num_tokens("a") == 12 and table.blocks("a") == [0, 1, 2]
    assert (counts(cache), prefix.num_cached_blocks()) == (before[0], before[2])
    table.check_invariants()


def test_a_refused_add_leaves_prefix_stats_and_eviction_order_alone(gpu):
    cache = make_cache(gpu, num_blocks=6)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    old, new = list(range(100, 104)), list(range(200, 208))
    table.add("old", old + [1])
    table.free("old")  # block 0 cached first: the least recently used
    table.add("new", new + [1])
    table.free("new")  # blocks 2, 3 cached after it
    table.add("hold", [7] * 8)  # holds 2 blocks: 1 free, 3 cached
    stats = prefix.stats()
    with pytest.raises(KvCacheExhausted):
        table.add("b", old + [9] * 16)  # matches block 0, needs 4 more: 1 free + 2 evictable
    assert prefix.stats() == stats
    assert prefix.evict(1) == [0]  # still the least recently used: the refusal was no use
    table.check_invariants()


def test_add_evicts_cached_blocks_when_short(gpu):
    cache = make_cache(gpu, num_blocks=4)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu)
    table.add("a", list(range(12)))
    table.free("a")
    assert prefix.num_cached_blocks() == 3 and cache.num_free_blocks() == 1
    assert table.add("b", [9] * 13) == 0
    assert prefix.num_cached_blocks() == 0 and table.blocks("b") == [0, 1, 2, 3]
    table.check_invariants()


# -- exports are arrays to numpy and to write_tokens ------------------------------------------


def test_exports_are_their_host_arrays_to_numpy_and_write_tokens(gpu):
    cache = make_cache(gpu, num_blocks=16)
    table = SequenceTable(cache, gpu=gpu)
    table.add("a", list(range(6)))
    table.add("b", list(range(3)))
    blocks = table.block_table(["a", "b"])
    assert np.asarray(blocks).tolist() == [[0, 1], [2, -1]] and np.asarray(blocks, dtype=np.int64).dtype == np.int64
    page = table.page_table(["a", "b"])
    assert [np.asarray(part).tolist() for part in (page.indptr, page.indices, page.last_page_len)] == [
        [0, 2, 3],
        [0, 1, 2],
        [2, 3],
    ]
    assert page.indices.device == page.device.indices
    with pytest.raises(TypeError, match="page-table export holds three arrays"):
        np.asarray(page)
    with pytest.raises(AttributeError, match="only a page-table export has parts"):
        blocks.indptr
    slots = table.slot_mapping(["a", "b"], pad_to=10)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((10, 1, 16)).astype(np.float32)
    v = rng.standard_normal((10, 1, 16)).astype(np.float32)
    cache.write_tokens(0, slots, k, v, gpu, gpu.default_stream())
    k_back, v_back = cache.read_tokens(0, slots, gpu)
    written = np.asarray(slots) != -1
    assert written.sum() == 9
    bf16 = k.astype(np.float32)  # bf16 rounding: compare through the same rounding
    np.testing.assert_allclose(k_back[written], bf16[written], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(v_back[written], v[written], rtol=1e-2, atol=1e-2)
    table.release()


def test_export_arguments_are_checked(gpu):
    cache = make_cache(gpu, num_blocks=16)
    table = SequenceTable(cache)
    table.add("a", [1, 2])
    table.add("b", [3])
    for export in (table.block_table, table.page_table, table.slot_mapping):
        with pytest.raises(TypeError, match="seq_ids must be an iterable of sequence ids, got 'ab'"):
            export("ab")
        with pytest.raises(ValueError, match="sequence 'a' is listed more than once in seq_ids"):
            export(["a", "b", "a"])
    with pytest.raises(ValueError, match=f"pad_to is {2**40}, more than the cache's 64 slots"):
        table.slot_mapping(["a"], pad_to=2**40)
    with pytest.raises(ValueError, match="pad_to must be a non-negative int, got -1"):
        table.slot_mapping(["a"], pad_to=-1)
    assert table.slot_mapping(["a"], pad_to=64).host.size == 64


class FlakyFree(HostBackend):
    """A real HostBackend whose next `fail` frees raise (and free nothing)."""

    def __init__(self):
        super().__init__(capacity_bytes=1 << 30)
        self.fail = 0

    def free(self, ptr):
        if self.fail:
            self.fail -= 1
            raise DeviceMemoryError(f"injected free failure of {int(ptr):#x}")
        super().free(ptr)


def test_a_failed_free_of_an_export_buffer_loses_nothing():
    gpu = FlakyFree()
    cache = make_cache(gpu, num_blocks=4096)
    base = gpu.live_allocations()
    table = SequenceTable(cache, gpu=gpu)
    table.add("a", [1])
    table.slot_mapping(["a"])  # a 4 KiB buffer
    assert gpu.live_allocations() == base + 1
    table.add("big", list(range(600)))
    gpu.fail = 1
    grown = table.slot_mapping(["big"])  # grows; the old buffer's failed free is logged and kept for release
    assert gpu.live_allocations() == base + 2
    back = np.empty_like(grown.host)
    gpu.copy_d2h(grown.device, back)
    assert back.tolist() == grown.host.tolist()
    again = table.slot_mapping(["big"])  # the new buffer is reused: nothing new allocated
    assert gpu.live_allocations() == base + 2 and int(again.device) == int(grown.device)
    table.block_table(["a"])
    gpu.fail = 1
    with pytest.raises(DeviceMemoryError, match="injected free failure"):
        table.release()
    assert gpu.live_allocations() == base + 1  # two of three freed, the failed one still recorded
    table.release()  # retries it
    assert gpu.live_allocations() == base
    table.release()
    assert gpu.live_allocations() == base


def test_release_with_another_backend_is_refused_and_forgets_nothing():
    gpu, other = HostBackend(capacity_bytes=1 << 30), HostBackend(capacity_bytes=1 << 20)
    cache = make_cache(gpu)
    table = SequenceTable(cache, gpu=gpu)
    table.add("a", [1])
    table.block_table(["a"])
    live = gpu.live_allocations()
    with pytest.raises(KvCacheError, match="release with HostBackend .* but the table's export buffers are on HostBackend"):
        table.release(other)
    assert gpu.live_allocations() == live
    table.release(gpu)
    assert gpu.live_allocations() == live - 1


def test_release_without_a_backend_forgets_nothing(gpu):
    cache = make_cache(gpu)
    table = SequenceTable(cache, gpu=gpu)
    table.add("a", [1])
    table.block_table(["a"])
    table._exports._gpu = None  # buffers whose backend the engine passes at release time
    with pytest.raises(ValueError, match="release needs the backend that holds the table's 1 export buffer"):
        table.release()
    table.release(gpu)
    table.release()


# -- one thread at a time -----------------------------------------------------------------------


class GatedFill(HostBackend):
    """A real HostBackend whose fills wait for `gate` once `entered` is set, so a test can
    hold one thread inside a SequenceTable call."""

    def __init__(self):
        super().__init__(capacity_bytes=1 << 30)
        self.entered, self.gate, self.hold = threading.Event(), threading.Event(), False

    def fill_blocks(self, regions, blocks, value, stream):
        if self.hold:
            self.entered.set()
            assert self.gate.wait(30)
        super().fill_blocks(regions, blocks, value, stream)


def test_a_second_thread_inside_is_refused_and_changes_nothing():
    gpu = GatedFill()
    cache = make_cache(gpu, num_blocks=32)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix, gpu=gpu)
    table.add("a", list(range(9)))
    table.free("a")
    before = (counts(cache), prefix.stats(), table.seq_ids())
    gpu.hold = True
    inside = threading.Thread(target=table.add, args=("b", list(range(9))))
    inside.start()
    assert gpu.entered.wait(30)
    calls = [
        lambda: table.add("c", [1, 2]),
        lambda: table.append("b"),
        lambda: table.append("b", 1, [7]),  # a decode step's one id: the inline claim is refused too
        lambda: table.free("b"),
        lambda: table.block_table(["b"]),
        lambda: prefix.match(list(range(9))),
        lambda: prefix.insert([1] * 4, [0]),
        lambda: prefix.evict(1),
        lambda: prefix.clear(),
    ]
    errors = []

    def call_all():
        for call in calls:
            try:
                call()
            except ConcurrentUseError as err:
                errors.append(str(err))

    others = [threading.Thread(target=call_all) for _ in range(3)]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join(30)
    gpu.gate.set()
    inside.join(30)
    assert len(errors) == 3 * len(calls)
    assert "in use by another thread" in errors[0]
    assert table.seq_ids() == ["b"] and before[2] == []
    table.check_invariants()
    assert prefix.stats().queries == before[1].queries + 1  # only "b"'s own lookup


def test_a_refused_decode_append_at_a_block_boundary_changes_nothing():
    cache = make_cache(HostBackend(capacity_bytes=1 << 30), num_blocks=3)
    table = SequenceTable(cache)
    table.add("a", [5] * BS)  # exactly one full block
    others = cache.alloc_blocks(2)
    before = counts(cache)
    with pytest.raises(KvCacheExhausted):
        table.append("a", 1, [6])
    assert (counts(cache), table.num_tokens("a"), table.blocks("a")) == (before, BS, [0])
    cache.free_block(others[0])
    done = []
    helper = threading.Thread(target=lambda: done.append(table.append("a", 1, [6])))  # the guard was let go
    helper.start()
    helper.join(30)
    assert done == [None]
    assert (table.num_tokens("a"), table.blocks("a")) == (BS + 1, [0, others[0]])
    table.free("a")
    cache.free_block(others[1])
    table.check_invariants()


def test_four_threads_on_one_table_either_run_or_are_refused():
    cache = make_cache(HostBackend(capacity_bytes=1 << 30), num_blocks=256)
    prefix = PrefixCache(cache)
    table = SequenceTable(cache, prefix)
    done, refused = [], []
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible

    def worker(w):
        rng = random.Random(w)
        live = []
        for i in range(300):
            try:
                if len(live) < 4:
                    seq = (w, i)
                    table.add(seq, [rng.randrange(3)] * rng.randrange(1, 14))
                    live.append(seq)
                elif rng.random() < 0.5:
                    table.append(rng.choice(live), 1, [rng.randrange(3)])
                else:
                    table.free(live.pop(rng.randrange(len(live))))
                done.append(w)
            except ConcurrentUseError:
                refused.append(w)

    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(previous)
    assert len(done) + len(refused) == 4 * 300
    table.check_invariants()  # the refused calls changed nothing; the tree is whole


def test_append_uses_the_one_token_id_rule(gpu):
    cache = make_cache(gpu)
    table = SequenceTable(cache)
    table.add("a", [1, 2, 3])
    for bad, error, shown in (
        ([-1], ValueError, r"token_ids\[0\] is -1"),
        ([2**63], ValueError, r"token_ids\[0\] is 9223372036854775808"),
        ([True], TypeError, r"token_ids\[0\] must be an int token id, got True"),
        ("ab", TypeError, "token_ids must be a sequence of int token ids, got str 'ab'"),
    ):
        with pytest.raises(error, match=shown):
            table.append("a", token_ids=bad)
    assert table.num_tokens("a") == 3 and counts(cache)[0] == 1
    table.append("a", token_ids=[np.int64(4)])
    table.append("a", token_ids=[2**63 - 1])
    assert table.num_tokens("a") == 5


def test_serving_bench_section_runs_both_ways(capsys):
    """tools/bench_serving.py at its quick size: both ways do the same work (same evictions,
    invariants checked inside) and every line prints; no timing is asserted."""
    import argparse
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tools"))
    try:
        import bench_serving
    finally:
        sys.path.pop(0)
    import structlog

    was_configured = structlog.is_configured()
    bench_serving.run(argparse.Namespace(quick=True))
    assert structlog.is_configured() == was_configured  # the bench put the logging configuration back
    out = capsys.readouterr().out
    assert "serving mix, 256 seqs x 32 steps: SequenceTable" in out
    assert "prefix-cache evictions each way" in out
    assert "match + free_blocks, cached 4096-token prompt:" in out and "first-time insert" in out


def test_serving_bench_measures_a_reference_checkout_in_the_same_process(capsys, monkeypatch):
    """PAGEDKV_BENCH_REFERENCE names a checkout whose pagedkv is imported under another name
    and measured beside ours (here this checkout itself); no timing is asserted."""
    import argparse
    import os

    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
    monkeypatch.syspath_prepend(os.path.join(root, "tools"))
    import bench_serving

    monkeypatch.setenv("PAGEDKV_BENCH_REFERENCE", root)
    monkeypatch.setitem(sys.modules, "pagedkv_reference", None)  # removed again after the test
    reference = bench_serving._reference_package()
    assert reference.__name__ == "pagedkv_reference" and reference.PrefixCache is not PrefixCache
    bench_serving._prefix_floor("match + free_blocks:", bench_serving._match_free_call, 2, 1.0, reference)
    assert "us/call (measured now, alternating call for call)" in capsys.readouterr().out
    monkeypatch.setenv("PAGEDKV_BENCH_REFERENCE", os.path.join(root, "no-such-checkout"))
    with pytest.raises(SystemExit, match="holds no pagedkv package"):
        bench_serving._reference_package()


def test_engine_bench_section_runs_beside_a_reference_checkout(capsys, monkeypatch):
    """tools/bench_engine.py at its quick size beside PAGEDKV_STEP_REFERENCE (here this
    checkout itself, imported under another name): every phase and bound prints, and the
    bench put the logging configuration back; no timing is asserted."""
    import argparse
    import os

    import structlog

    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
    monkeypatch.syspath_prepend(os.path.join(root, "tools"))
    import bench_engine

    monkeypatch.setenv("PAGEDKV_STEP_REFERENCE", root)
    monkeypatch.setitem(sys.modules, "pagedkv_step_reference", None)  # removed again after the test
    was_configured = structlog.is_configured()
    bench_engine.run(argparse.Namespace(quick=True))
    assert structlog.is_configured() == was_configured
    out = capsys.readouterr().out
    for phase in bench_engine.PHASES:
        assert f"  {phase:<28} " in out
    assert "step: bookkeeping + exports (ours) / bookkeeping alone (main)" in out
    assert "bookkeeping speedup over main" in out
    assert "first-time caching, insert of a 4096-token prompt:" in out and "main" in out
    assert sys.modules["pagedkv_step_reference"].SequenceTable is not SequenceTable
