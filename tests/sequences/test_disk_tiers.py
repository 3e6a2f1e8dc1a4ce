"""Prefix reuse over three tiers: host drops are demoted to a DiskTier, `match` reports hits
in all three tiers, `SequenceTable.add` promotes disk -> host -> device with identical KV,
a directory comes up warm in a new prefix cache, torn or corrupt slots are never served,
and disk trouble only makes blocks "not cached"."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disk_world import BS, CONFIG, DiskWorld, content, prompt
from pagedkv import KvCacheConfig, KvCacheDtype
from pagedkv.sequences.events import BlockStored
from pagedkv.tiers.disk_layout import SLOTS_FILE, DiskLayoutMismatch


def _to_disk(world: DiskWorld, chains=range(1, 4), blocks: int = 3) -> list[list[int]]:
    """Fill chains 1..3 (3 blocks each) through a 4-block device and a 3-block host tier:
    the first two end up on disk, the third in the host tier. Returns the prompts."""
    prompts = [prompt(c, blocks) for c in chains]
    for i, p in enumerate(prompts):
        world.fill(f"p{i}", p)
        world.pressure()
    world.disk.flush()
    return prompts


def test_host_drops_go_to_disk_and_a_match_reports_all_three_tiers(tmp_path):
    events: list = []
    world = DiskWorld(tmp_path, events=events)
    try:
        first, second, third = _to_disk(world)
        assert world.prefix.num_cached_blocks() == 0 and world.prefix.num_host_blocks() == 3
        assert world.prefix.num_disk_blocks() == 6
        found = world.prefix.match(first)
        assert (found.num_tokens, found.host_num_tokens, found.disk_num_tokens) == (0, 0, 12)
        assert len(found.disk_blocks) == 3 and len(set(found.disk_blocks)) == 3
        found = world.prefix.match(third)
        assert (found.num_tokens, found.host_num_tokens, found.disk_num_tokens) == (0, 12, 0)
        world.fill("d", second[:4] + [5])  # its first block read back (the host drops one of chain 3 to disk)
        found = world.prefix.match(second)
        assert (found.num_tokens, found.host_num_tokens, found.disk_num_tokens) == (4, 0, 8)
        world.cache.free_blocks(found.blocks)
        disk_events = [e for e in events if getattr(e, "medium", None) == "DISK"]
        assert {type(e) for e in disk_events} == {BlockStored}
        assert sum(len(e.block_ids) for e in disk_events) == 7
        stats = world.prefix.stats()
        assert (stats.disk_demotions, stats.disk_cached_blocks, stats.disk_promotions) == (7, 7, 1)
        assert (stats.device_hit_tokens, stats.host_hit_tokens, stats.disk_hit_tokens) == (4, 12, 24)
        world.prefix.check_invariants()
    finally:
        world.close()


def test_add_promotes_disk_blocks_through_the_host_with_identical_kv(tmp_path):
    world = DiskWorld(tmp_path)
    try:
        first, *_ = _to_disk(world)
        assert world.served("again", first) == 12
        stats = world.prefix.stats()
        assert (stats.disk_promotions, stats.promotions, stats.disk_hit_tokens) == (3, 3, 12)
        assert world.disk.stats().reads == 3
        world.prefix.check_invariants()
        world.table.free("again")
        assert world.prefix.num_disk_blocks() == 9  # the read made room in the host: chain 3 went to disk
        written = world.prefix.stats().disk_demotions
        world.pressure()
        world.fill("other", prompt(9, 3))
        world.pressure()
        assert world.prefix.match(first).disk_num_tokens == 12  # back on disk only
        assert world.prefix.stats().disk_demotions == written  # inclusive: its slots were kept, nothing rewritten
        assert world.served("third time", first) == 12
    finally:
        world.close()


def test_a_new_prefix_cache_on_the_directory_comes_up_warm(tmp_path):
    world = DiskWorld(tmp_path)
    prompts = _to_disk(world)
    world.close()
    events: list = []
    warm = DiskWorld(tmp_path, events=events)
    try:
        assert warm.disk.stats().restored_blocks == 6
        assert warm.prefix.num_disk_blocks() == 6
        warm.prefix.deliver_events()
        assert [e.medium for e in events] == ["DISK"] * 6
        assert warm.prefix.match(prompts[0]).disk_num_tokens == 12
        assert warm.served("a", prompts[0]) == 12
        warm.table.free("a")
        assert warm.served("b", prompts[1]) == 12
        warm.prefix.check_invariants()
    finally:
        warm.close()


def test_another_layout_is_refused_with_every_difference_named_and_nothing_read(tmp_path):
    DiskWorld(tmp_path).close()
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    other = KvCacheConfig(block_size=8, num_kv_heads=2, head_dim=32, num_layers=2, dtype="bf16",
                          layer_dtypes=("fp8", "turbo4k_turbo3v"), layer_dims=((2, 32), (1, 64)))
    with pytest.raises(DiskLayoutMismatch) as err:
        DiskWorld(tmp_path, config=other)
    message = str(err.value)
    assert "block_size: here 8, directory 4" in message
    assert "row 0 (layer 0 K) dtype: here 'fp8', directory 'bf16'" in message
    assert "row 0 (layer 0 K) stride: here 512, directory 512" not in message  # fp8 at block 8 = bf16 at 4
    assert "row 2 (layer 1 K) stride: here 288, directory 144" in message
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_a_corrupt_slot_is_dropped_never_served(tmp_path):
    world = DiskWorld(tmp_path)
    prompts = _to_disk(world)
    slots = world.prefix.match(prompts[0]).disk_blocks
    world.close()
    with open(tmp_path / SLOTS_FILE, "r+b") as f:  # one flipped byte in the middle block's slot
        f.seek(slots[1] * 4096 + 100)
        byte = f.read(1)
        f.seek(slots[1] * 4096 + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    warm = DiskWorld(tmp_path)
    try:
        assert warm.prefix.match(prompts[0]).disk_num_tokens == 12  # not read yet
        assert warm.served("a", prompts[0]) == 4  # the first block; the corrupt one and its child dropped
        stats = warm.prefix.stats()
        assert stats.disk_failed_reads == 1 and warm.prefix.match(prompts[0]).disk_num_tokens == 0
        warm.prefix.check_invariants()
    finally:
        warm.close()


def test_a_full_disk_or_an_io_error_degrades_to_not_cached_with_a_warning(tmp_path):
    from structlog.testing import capture_logs

    world = DiskWorld(tmp_path)
    try:
        def full(*args):
            raise OSError(28, "No space left on device")

        world.disk._io.ops.pwritev = full
        with capture_logs() as logs:
            prompts = _to_disk(world)
            world.prefix.match(prompts[0])  # a call polls the completions
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["disk_tier_write_failed"]
        stats = world.prefix.stats()
        assert stats.disk_failed_writes == 6 and stats.disk_cached_blocks == 0
        assert world.prefix.match(prompts[0]).num_tokens == 0 and world.served("x", prompts[0]) == 0
        world.prefix.check_invariants()
        world.table.free("x")
        del world.disk._io.ops.pwritev
        world.disk._io.ops.pwritev = os.pwritev
        world.disk._io.ops.preadv = lambda *a: (_ for _ in ()).throw(OSError(5, "Input/output error"))
        for i in range(4, 7):
            world.fill(f"q{i}", prompt(i, 3))
            world.pressure()
        world.disk.flush()
        with capture_logs() as logs:
            assert world.served("y", prompt(4, 3)) == 0
        assert "disk_tier_read_dropped" in [e["event"] for e in logs]
        assert world.prefix.stats().disk_failed_reads == 3  # the 3 blocks read: each failed
        world.prefix.check_invariants()
    finally:
        world.close()


def test_a_directory_that_cannot_be_written_is_read_for_hits_only(tmp_path, monkeypatch):
    from structlog.testing import capture_logs

    world = DiskWorld(tmp_path)
    prompts = _to_disk(world)
    world.close()
    real_open = os.open

    def read_only_fs(path, flags, *args):
        if str(path).startswith(str(tmp_path)) and flags & (os.O_RDWR | os.O_WRONLY):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only_fs)
    with capture_logs() as logs:
        warm = DiskWorld(tmp_path)
    try:
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["disk_tier_not_writable"]
        assert warm.disk.stats().degraded.startswith("OSError: [Errno 30]") and not warm.disk.is_writable()
        assert warm.served("a", prompts[0]) == 12
        warm.table.free("a")
        for i in range(5, 8):  # demotions go on, nothing is written
            warm.fill(f"q{i}", prompt(i, 3))
            warm.pressure()
        assert warm.prefix.stats().disk_demotions == 0
        warm.prefix.check_invariants()
    finally:
        warm.close()


def test_two_processes_share_a_directory_one_writer_and_readers(tmp_path):
    from pagedkv.errors import KvCacheError

    writer = DiskWorld(tmp_path, disk_bytes=8 * 4096)
    try:
        prompts = _to_disk(writer)
        with pytest.raises(KvCacheError, match="in use by another writer: open it with read_only=True"):
            DiskWorld(tmp_path)
        reader = DiskWorld(tmp_path, disk_bytes=None, read_only=True)
        try:
            assert reader.served("r", prompts[0]) == 12
            reader.table.free("r")
            for i in range(10, 16):  # the writer reuses every slot meanwhile
                writer.fill(f"w{i}", prompt(i, 3))
                writer.pressure()
            writer.disk.flush()
            assert reader.served("r2", prompts[1]) == 0  # overwritten: checksum mismatch, dropped
            assert reader.prefix.stats().disk_failed_reads == 3 and reader.disk.stats().writes == 0
        finally:
            reader.close()
    finally:
        writer.close()


def test_clear_empties_the_directory_and_close_keeps_it(tmp_path):
    world = DiskWorld(tmp_path)
    prompts = _to_disk(world)
    world.prefix.clear()
    assert world.prefix.num_disk_blocks() == 0 and world.disk.num_free_slots() == world.disk.num_slots()
    world.fill("again", prompts[0])
    for i in range(20, 22):
        world.fill(f"p{i}", prompt(i, 3))
        world.pressure()
    world.close()
    warm = DiskWorld(tmp_path)
    try:
        assert warm.disk.stats().restored_blocks == warm.prefix.num_disk_blocks() > 0
        assert warm.prefix.match(prompts[1]).disk_num_tokens == 0  # cleared before it was written again
        assert warm.served("a", prompts[0]) == 12
    finally:
        warm.close()


def test_a_lossless_zstd_tier_round_trips_and_reports_its_ratio(tmp_path):
    pytest.importorskip("zstandard", reason="the zstd extra is not installed")
    world = DiskWorld(tmp_path, compression="zstd")
    try:
        zeros = prompt(7, 2)
        world.table.add("z", zeros)  # zero-initialised blocks: they compress
        world.table.free("z")
        world.pressure()
        prompts = _to_disk(world)
        stats = world.disk.stats()
        assert stats.writes == 8 and stats.bytes_raw == 8 * 1280  # zeros (2 blocks), chains 1 and 2; 1280 bytes a block
        assert stats.compression_ratio > 1.2 and stats.bytes_written < stats.bytes_raw
        assert world.served("a", prompts[0]) == 12
    finally:
        world.close()
    with pytest.raises(DiskLayoutMismatch, match="compression: here None, directory 'zstd'"):
        DiskWorld(tmp_path)


FORMATS = [str(f) for f in KvCacheDtype]


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=2, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(0, 2)), min_size=4, max_size=12))
def test_every_format_round_trips_byte_exact_with_eviction_in_all_tiers(tmp_path_factory, fmt, ops):
    """Random prompts (shared prefixes) filled, pushed down by pressure, and served again:
    every byte served equals what was written, in every format, with the device, the host
    and the disk tier all evicting (4, 3 and 6 blocks)."""
    config = KvCacheConfig(block_size=BS, num_kv_heads=1, head_dim=32, num_layers=2, dtype=fmt,
                           layer_dims=((1, 32), (2, 16)) if not KvCacheDtype.parse(fmt).is_grouped() else ())
    world = DiskWorld(tmp_path_factory.mktemp("t"), device=4, host=3, disk_bytes=6 * 4096, config=config)
    try:
        for i, (chain, blocks, shared) in enumerate(ops):
            p = prompt(chain, blocks, min(shared, blocks))
            if i % 2:
                world.fill(f"f{i}", p)
            else:
                world.served(f"s{i}", p)
                world.table.free(f"s{i}")
            world.pressure()
            world.disk.flush()  # which writes are done decides which slots can be reused: make it so
            world.prefix.check_invariants()
        through = prompt(50, 3)  # and one chain surely down to the disk and back
        world.fill("down", through)
        world.fill("push", prompt(51, 3))  # chain 50 to the host tier
        world.pressure()  # chain 51 to the host tier, chain 50 to disk: its 3 slots the newest
        assert world.prefix.match(through).disk_num_tokens == 12
        promoted = world.prefix.stats().disk_promotions
        assert world.served("up", through) == 12
        stats = world.prefix.stats()
        assert stats.disk_promotions == promoted + 3
        assert world.disk.stats().failed_reads == 0 and stats.disk_failed_writes == 0
        world.prefix.check_invariants()
    finally:
        world.close()


def test_the_content_helper_is_what_a_block_holds(tmp_path):
    world = DiskWorld(tmp_path)
    try:
        p = prompt(1, 2)
        world.table.add("a", p)
        block = world.table.blocks("a")[0]
        world.cache.write_block(0, block, *content(world.cache, 0, p[0]), world.gpu)
        k, _ = world.cache.read_block(0, block, world.gpu)
        assert np.array_equal(k, content(world.cache, 0, p[0])[0]) and not np.array_equal(k, content(world.cache, 0, p[4])[0])
        assert CONFIG.block_size == BS
    finally:
        world.close()



def test_bytes_written_without_their_record_are_never_served(tmp_path):
    """A crash between a reused slot's new bytes and its record, made certain: the index
    append fails, so the directory's newest records for those slots still describe the old
    blocks, whose bytes were overwritten."""
    world = DiskWorld(tmp_path, disk_bytes=6 * 4096)
    first, second, third = _to_disk(world)
    assert world.prefix.num_disk_blocks() == 6
    real_pwrite = world.disk._io.ops.pwrite

    def no_index(fd, data, offset):
        raise OSError(5, "Input/output error")

    world.disk._io.ops.pwrite = no_index  # pwritev (the slots) still works
    world.fill("c4", prompt(4, 3))
    world.pressure()  # chain 3 to disk, into chain 1's slots (the least recently used)
    world.disk.flush()
    world.prefix.match(first)
    assert world.prefix.stats().disk_failed_writes == 3
    world.disk._io.ops.pwrite = real_pwrite
    world.close()
    warm = DiskWorld(tmp_path, disk_bytes=6 * 4096)
    try:
        assert warm.disk.stats().restored_blocks == 6  # chain 1's stale records and chain 2's
        assert warm.served("a", first) == 0  # its first slot holds chain 3's bytes: dropped, with its children
        assert warm.prefix.stats().disk_failed_reads == 3
        warm.table.free("a")
        assert warm.served("b", second) == 12
        warm.prefix.check_invariants()
    finally:
        warm.close()


def test_a_torn_index_tail_is_cut_and_appends_go_after_the_last_good_record(tmp_path):
    from pagedkv.tiers.disk_layout import INDEX_FILE

    world = DiskWorld(tmp_path)
    first, second, _ = _to_disk(world)
    world.close()
    index = tmp_path / INDEX_FILE
    data = index.read_bytes()
    index.write_bytes(data[:-10])  # the last record torn
    warm = DiskWorld(tmp_path)
    try:
        assert warm.disk.stats().restored_blocks == 5
        assert index.stat().st_size < len(data) - 10  # cut back to the last whole record
        assert warm.served("a", first) == 12
        warm.table.free("a")
        for chain in (30, 31):
            warm.fill(f"n{chain}", prompt(chain, 3))
            warm.pressure()
    finally:
        warm.close()
    again = DiskWorld(tmp_path)
    try:
        assert again.disk.stats().restored_blocks > 5
        assert again.served("b", prompt(30, 3)) == 12
    finally:
        again.close()


def test_the_readme_disk_tier_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Disk tier"):readme.index("## CUDA backend")]
    (example,) = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    gpu = namespace["gpu"]
    assert gpu.live_allocations() == 0 and gpu.live_swap_memory() == 0
    assert namespace["prefix"].stats().disk_promotions == 3


def test_closing_the_disk_tier_first_leaves_a_two_tier_cache(tmp_path):
    world = DiskWorld(tmp_path)
    try:
        prompts = _to_disk(world)
        world.disk.close()
        assert world.served("a", prompts[0]) == 0  # its blocks were on disk only
        world.table.free("a")
        assert world.prefix.disk_tier() is None and world.prefix.num_disk_blocks() == 0
        assert world.served("b", prompts[2]) == 12  # from the host tier
        world.prefix.check_invariants()
    finally:
        world.close()


def test_a_slot_for_one_block_of_a_drop_never_comes_from_another_ones_copy(tmp_path):
    world = DiskWorld(tmp_path, disk_bytes=3 * 4096)
    try:
        first, second = prompt(1, 3), prompt(2, 3)
        for seq, p in (("a", first), ("b", second)):
            world.fill(seq, p)
            world.pressure()
        world.disk.flush()
        disk = world.prefix._disk
        chain = world.prefix._tree.walk(first, 12, 0)
        host_node = world.prefix._tree.walk(second, 12, 0)[0]
        assert [n in disk.slot_of for n in chain] == [True] * 3 and host_node.lower is not None
        disk.disk.touch([disk.slot_of[n] for n in reversed(chain[1:])])  # the first one's slot: the oldest
        kept = disk.store([chain[0], host_node], lambda node: world.tier.block_rows(node.lower))
        assert kept == {id(chain[0]), id(host_node)}
        assert chain[0] in disk.slot_of and host_node in disk.slot_of  # the slot came from a child of chain[0]
        world.disk.flush()
    finally:
        world.close()
