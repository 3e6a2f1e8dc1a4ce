"""HybridDiskTier.bind is all or nothing: a group whose capacity holds no slot is refused
naming the group before anything is written, an error from a later group's tier names the
group and leaves the directory as it was (what the call created removed, nothing that was
there before), and `groups.json` is written only once every group is bound."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest
from shared_helpers import HYBRID_STATE, counting_host

from pagedkv import HybridDiskTier, HybridHostTier, KvCacheConfig, PagedKvCache, PrefixCache
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.errors import KvCacheError
from pagedkv.tiers.disk_tier import DiskTier

# two groups: a full group of blocks of 4 (256-byte blocks) and a state group; one 4096-byte slot each
TWO = KvCacheConfig(4, 1, 16, 2, "bf16", layer_groups=(
    LayerGroup("full", (0,)), LayerGroup("state", (1,), state=HYBRID_STATE, checkpoint_every=8)))


def tiers():
    gpu = counting_host()
    cache = PagedKvCache(TWO, [8, None], gpu, num_state_slots=4)
    return cache, HybridHostTier(cache, [4, None], gpu, num_state_slots=2)


def listing(directory) -> list[str]:
    """Every path under `directory`, relative, sorted."""
    out = []
    for root, dirs, files in os.walk(directory):
        rel = os.path.relpath(root, directory)
        out.extend(os.path.normpath(os.path.join(rel, x)) for x in dirs + files)
    return sorted(out)


def bind_and_close(directory, capacity) -> list[int]:
    cache, host = tiers()
    disk = HybridDiskTier(directory, capacity)
    prefix = PrefixCache(cache, host_tier=host, disk_tier=disk)
    slots = [disk.group(g).num_slots() for g in range(2)]
    prefix.close()
    disk.close()
    return slots


def test_a_group_capacity_below_one_slot_is_refused_naming_the_group_with_nothing_written(tmp_path):
    directory = tmp_path / "t"
    directory.mkdir()
    (directory / "notes.txt").write_text("kept")  # data that was there before
    cache, host = tiers()
    with pytest.raises(ValueError, match=r"group 1: disk tier capacity_bytes 4095 is less than one slot of that "
                                         r"group \(4096 bytes\)"):
        PrefixCache(cache, host_tier=host, disk_tier=HybridDiskTier(directory, [1 << 16, 4095]))
    assert listing(directory) == ["notes.txt"]  # no groups.json, no group0 files
    prefix = PrefixCache(cache, host_tier=host)  # nothing was left attached by the refusal
    prefix.close()
    assert bind_and_close(directory, [1 << 16, 4096]) == [16, 1]  # a retry with a good capacity works
    assert {"groups.json", "group0", "group1", "notes.txt"} <= set(os.listdir(directory))
    assert (directory / "notes.txt").read_text() == "kept"


def test_a_later_group_failing_its_bind_names_the_group_and_removes_what_the_call_created(tmp_path):
    directory = tmp_path / "t"
    (directory / "group1").mkdir(parents=True)
    lock = os.open(directory / "group1" / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another writer holds group 1
        before = listing(directory)
        cache, host = tiers()
        with pytest.raises(KvCacheError, match=r"group 1: .*group1 is in use by another writer"):
            PrefixCache(cache, host_tier=host, disk_tier=HybridDiskTier(directory, 1 << 16))
        assert listing(directory) == before == ["group1", "group1/writer.lock"]  # group0 removed, no groups.json
    finally:
        os.close(lock)
    assert bind_and_close(directory, 1 << 16) == [16, 16]  # the lock gone: the retry binds


def test_a_failure_in_a_fresh_directory_leaves_no_directory_and_a_note_names_the_group(tmp_path, monkeypatch):
    directory = tmp_path / "fresh"
    bind = DiskTier.bind

    def failing(self, host_tier, block_size=None):
        if self.directory().endswith("group1"):
            os.makedirs(self.directory())
            raise OSError(errno.EIO, "planted failure")
        return bind(self, host_tier, block_size)

    monkeypatch.setattr(DiskTier, "bind", failing)
    cache, host = tiers()
    with pytest.raises(OSError, match="planted failure") as caught:
        PrefixCache(cache, host_tier=host, disk_tier=HybridDiskTier(directory, 1 << 16))
    assert caught.value.errno == errno.EIO and caught.value.__notes__ == ["in the disk tier of group 1"]
    assert not directory.exists()  # the call made it: gone, group0's files with it
    monkeypatch.setattr(DiskTier, "bind", bind)
    assert bind_and_close(directory, 1 << 16) == [16, 16]
