"""The kept exports (persistent batch) against exports rebuilt from scratch, byte for byte,
over a seeded random run of every operation; the device copies (incremental block-table
uploads included) against the host arrays."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheExhausted, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.sequences.exports import block_table_of, page_table_of, slot_mapping_of

BS = 4


def same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (a, b)


def device_bytes(gpu, ptr, like: np.ndarray) -> bytes:
    back = np.empty_like(like)
    if back.nbytes:
        gpu.copy_d2h(ptr, back)
    return back.tobytes()


def check_exports(table: SequenceTable, gpu, rng: random.Random) -> None:
    ids = table.batch_ids()
    assert sorted(map(repr, ids)) == sorted(map(repr, table.seq_ids()))
    orders = [None, rng.sample(ids, rng.randrange(len(ids) + 1))]
    for order in orders:
        seqs = [table._seqs[s] for s in (ids if order is None else order)]
        blocks = table.block_table(order)
        same(blocks.host, block_table_of(seqs))
        page = table.page_table(order)
        for kept, ref in zip(page.host, page_table_of(seqs, BS)):
            same(kept, ref)
        pad = None if rng.random() < 0.5 else sum(s.num_tokens - s.step_start for s in seqs) + rng.randrange(4)
        slots = table.slot_mapping(order, pad_to=pad)
        same(slots.host, slot_mapping_of(seqs, BS, pad))
        lens = table.seq_lens(order)
        same(lens.host, np.array([s.num_tokens - s.dropped * BS for s in seqs], dtype=np.int32))
        if gpu is not None:
            assert device_bytes(gpu, blocks.device, blocks.host) == blocks.host.tobytes()
            assert device_bytes(gpu, slots.device, slots.host) == slots.host.tobytes()
            assert device_bytes(gpu, lens.device, lens.host) == lens.host.tobytes()
            for host_part, ptr in zip(page.host, page.device):
                assert device_bytes(gpu, ptr, host_part) == host_part.tobytes()


def random_run(seed: int, window: int | None, with_gpu: bool, steps: int = 260) -> int:
    rng = random.Random(seed)
    gpu = HostBackend(capacity_bytes=1 << 26) if with_gpu else None
    config = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=8, num_layers=1, dtype="bf16",
                           cache_blocks_per_seq=window)
    cache = PagedKvCache(config, 96, gpu or HostBackend(capacity_bytes=1 << 26))
    prefix = PrefixCache(cache) if window is None else None
    table = SequenceTable(cache, prefix, gpu)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    next_id = 0
    checks = 0
    for _ in range(steps):
        live = table.batch_ids()
        op = rng.random()
        try:
            if op < 0.22 or not live:
                base = rng.choice(prompts)
                prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(3))]
                if window is not None:
                    prompt = prompt[: window * BS]
                table.add(next_id, prompt)
                next_id += 1
            elif op < 0.62:
                table.append(rng.choice(live), 1, [rng.randrange(50)])
            elif op < 0.72:
                n = rng.randrange(0, 7 if window is None else window * BS - BS + 1)
                if rng.random() < 0.5:
                    table.append(rng.choice(live), n)
                else:
                    table.append(rng.choice(live), token_ids=[rng.randrange(50) for _ in range(n)])
            elif op < 0.8:
                table.fork(rng.choice(live), next_id)
                next_id += 1
            elif op < 0.9:
                table.free(rng.choice(live))
            elif op < 0.95:  # a step with drafts, a truncate within the blocks, a batched decode step
                seq_id, kind = rng.choice(live), rng.randrange(3)
                if kind == 0:
                    table.append(seq_id, 1, [rng.randrange(50)], lookahead=rng.randrange(1, 3))
                elif kind == 1:
                    first, end = table.first_block_position(seq_id), table.num_tokens(seq_id)
                    table.truncate(seq_id, rng.randrange(max(first, end - 2), end + 1))
                else:
                    batch = [i for i in rng.sample(live, rng.randrange(1, len(live) + 1)) if not table.num_lookahead(i)]
                    table.append_decode(batch, [rng.randrange(50) for _ in batch])
            elif prefix is not None:
                table.cache_prefix(rng.choice(live))
        except KvCacheExhausted:
            for seq_id in live[: len(live) // 2]:
                table.free(seq_id)
        table.take_pending_copies()  # (no copies are performed: only the tables are compared)
        if rng.random() < 0.4:
            check_exports(table, gpu, rng)
            checks += 1
    check_exports(table, gpu, rng)
    table.check_invariants()
    if gpu is not None:
        table.release()
    return checks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_exports_equal_a_rebuild_from_scratch(seed):
    assert random_run(seed, None, with_gpu=False) > 50


def test_kept_exports_under_a_sliding_window():
    assert random_run(3, 3, with_gpu=False) > 50


def test_device_copies_of_kept_exports_equal_the_host_arrays():
    assert random_run(4, None, with_gpu=True) > 50


def test_the_batch_keeps_rows_and_moves_the_last_into_a_freed_row():
    cache = PagedKvCache(KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=8, num_layers=1, dtype="bf16"), 16,
                         HostBackend(capacity_bytes=1 << 24))
    table = SequenceTable(cache)
    for seq_id, n in (("a", 5), ("b", 1), ("c", 9), ("d", 2)):
        table.add(seq_id, list(range(n)))
    assert table.batch_ids() == ["a", "b", "c", "d"]
    table.free("b")
    assert table.batch_ids() == ["a", "d", "c"]  # d moved into b's row
    table.fork("a", "e")
    assert table.batch_ids() == ["a", "d", "c", "e"]
    assert table.block_table().host.tolist() == [[0, 1, -1], [6, -1, -1], [3, 4, 5], [0, 1, -1]]
    table.free("e")
    table.free("d")
    assert table.batch_ids() == ["a", "c"]
    assert table.block_table().host.tolist() == [[0, 1, -1], [3, 4, 5]]
    assert table.seq_lens().host.tolist() == [5, 9]
    table.append("a", 1, [7])
    assert table.slot_mapping().host.tolist() == [1 * BS + 1] + list(range(3 * BS, 3 * BS + 9))  # c's latest: its add
    table.free("a")
    table.free("c")
    assert table.block_table().host.shape == (0, 0) and table.slot_mapping(pad_to=2).host.tolist() == [-1, -1]


def test_an_incremental_upload_copies_only_the_changed_rows():
    class Counting(HostBackend):
        def __init__(self):
            super().__init__(capacity_bytes=1 << 24)
            self.copied = []

        def copy_h2d(self, src, dst):
            self.copied.append(np.asarray(src).nbytes)
            super().copy_h2d(src, dst)

    gpu = Counting()
    cache = PagedKvCache(KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=8, num_layers=1, dtype="bf16"), 64, gpu)
    table = SequenceTable(cache, gpu=gpu)
    for seq_id in range(8):
        table.add(seq_id, list(range(8)))  # two blocks each
    table.block_table()
    gpu.copied.clear()
    table.append(2, 1, [1])  # row 2 grows to three blocks: the width changes, a full upload
    full = table.block_table()
    assert gpu.copied == [8 * 3 * 4]
    gpu.copied.clear()
    for _ in range(3):
        table.append(5, 1, [1])  # row 5 stays in its block
    table.append(5, 1, [1])  # and crosses into a third one: one row changed, width unchanged
    again = table.block_table()
    assert gpu.copied == [1 * 3 * 4]
    assert device_bytes(gpu, again.device, again.host) == again.host.tobytes()
    gpu.copied.clear()
    assert table.block_table().host.tolist() == again.host.tolist() and gpu.copied == []  # nothing changed
    assert int(full.device) == int(again.device)
    table.release()


def test_the_kept_page_table_splices_few_grown_rows_rebuilds_the_rest_and_never_changes_an_export():
    from pagedkv.sequences.batch import SPLICE_ROWS

    rng = random.Random(9)
    cache = PagedKvCache(KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=8, num_layers=1, dtype="bf16"), 512,
                         HostBackend(capacity_bytes=1 << 26))
    table = SequenceTable(cache)
    for seq_id in range(24):
        table.add(seq_id, [1] * rng.randrange(1, 20))
    held = []  # every export so far, with a copy of what it was
    paths = set()
    for step in range(300):
        live = table.batch_ids()
        op = rng.random()
        if cache.num_free_blocks() < 64:
            for seq_id in live[: len(live) // 2]:
                table.free(seq_id)
            paths.add("moved")
        elif op < 0.55:  # a few rows cross into a new block (the splice), or many (the rebuild)
            grow = rng.sample(live, rng.choice([0, 1, 2, SPLICE_ROWS, SPLICE_ROWS + 1, len(live)]))
            for seq_id in grow:
                table.append(seq_id, BS)
            paths.add("splice" if len(grow) <= SPLICE_ROWS else "rebuild")
        elif op < 0.7:
            table.free(rng.choice(live))  # a row moves: the rows from it on are rebuilt
            paths.add("moved")
        elif op < 0.85:
            table.add(1000 + step, [2] * rng.randrange(1, 30))
        elif op < 0.92:
            table.truncate(rng.choice(live), 1)  # a row shrinks (rewritten)
        elif len(live) < 40:
            table.fork(rng.choice(live), 2000 + step)
        page = table.page_table()
        seqs = [table._seqs[s] for s in table.batch_ids()]
        for kept, ref in zip(page.host, page_table_of(seqs, BS)):
            same(kept, ref)
        if rng.random() < 0.3:
            again = table.page_table()  # nothing changed: the kept indices, as they are
            assert again.host.indices is page.host.indices
        held.append((page.host, [a.copy() for a in page.host]))
    for arrays, copies in held:
        for a, b in zip(arrays, copies):
            same(a, b)  # no export was changed in place by a later one
    assert paths == {"splice", "rebuild", "moved"}
    table.check_invariants()
