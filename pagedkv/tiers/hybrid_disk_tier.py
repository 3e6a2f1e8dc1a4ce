"""HybridDiskTier: the disk tier of a `HybridKvCache`, one `DiskTier` per group.

The shape (chosen like `HybridHostTier`'s): group g's entries (an attention group's blocks,
a state group's checkpoint slots) live in their own `DiskTier` in `directory/group<g>/`,
with that tier's files, layout check, writer lock, I/O thread, LRU and counters; ids (disk
slots) are per group. A slot holds one entry as group g's host tier keeps it (`HostTier.rows()`:
every layer's K/V rows of an attention block, every layer's state tensors of a state slot).
Each record carries the tokens the entry ends: an attention block's `block_size` tokens, a
state checkpoint's last match unit (`unit`).

`directory/groups.json` records the grouping (the match unit and, per group, its kind,
layers, window, block size and state tensors); a directory written with another grouping is
refused at bind (`DiskLayoutMismatch` naming each field that differs, e.g. `group 1 window:
here 8, directory 16`) before any group's index is read, and so is a group directory of
another row layout (formats, dims: `DiskTier`'s own check). A directory of the same grouping
comes up warm: every group's records are handed to the prefix cache, which rebuilds its trie.

Bound by `PrefixCache(hybrid_cache, host_tier=HybridHostTier(...), disk_tier=HybridDiskTier(...))`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Sequence

from ..core.log import get_logger
from ..core.validate import positive_int
from ..errors import KvCacheError
from . import disk_layout
from .disk_index import IndexRecord
from .disk_layout import DiskLayoutMismatch, read_description
from .disk_tier import DiskTier, DiskTierStats

_log = get_logger("disk_tier")

GROUPS_FILE = "groups.json"
GROUPS_VERSION = 1
"""Bumped when the meaning of `groups.json` changes."""


def describe_groups(layout: Any) -> dict:
    """The grouping a hybrid directory records: the match unit (`layout.unit`, tokens per
    trie node) and per group its kind, layers, window, block size (attention) and state
    tensors (`[shape, dtype]` pairs)."""
    groups = []
    for g, group in enumerate(layout.groups):
        entry = {"kind": group.kind, "layers": [int(x) for x in group.layers]}
        if group.is_attention():
            entry["block_size"] = int(layout.block_size(g))
            entry["window"] = None if group.window is None else int(group.window)
        else:
            import numpy as np

            entry["state"] = [[[int(d) for d in shape], str(np.dtype(dtype))] for shape, dtype in group.state]
        groups.append(entry)
    return {"groups_version": GROUPS_VERSION, "unit": int(min(layout.block_size(g) for g in layout.attention_groups())),
            "groups": groups}


def group_differences(mine: dict, theirs: dict) -> list[str]:
    """Every difference between two grouping descriptions, as `what: here X, directory Y`."""
    out = []
    for key in ("groups_version", "unit"):
        if mine.get(key) != theirs.get(key):
            out.append(f"{key}: here {mine.get(key)!r}, directory {theirs.get(key)!r}")
    a, b = mine.get("groups", []), theirs.get("groups", [])
    if len(a) != len(b):
        out.append(f"groups: here {len(a)}, directory {len(b)}")
    for g, (x, y) in enumerate(zip(a, b)):
        for key in ("kind", "layers", "block_size", "window", "state"):
            if x.get(key) != y.get(key):
                out.append(f"group {g} {key}: here {x.get(key)!r}, directory {y.get(key)!r}")
    return out


def _naming_group(err: Exception, g: int) -> Exception:
    """`err` (from group g's `DiskTier.bind`) with its message naming the group: a new one of
    its type for a one-message error, else `err` with a note naming the group."""
    if f"group {g}" in str(err):
        return err
    if len(err.args) == 1 and isinstance(err.args[0], str):
        try:
            named = type(err)(f"group {g}: {err.args[0]}")
        except Exception:  # noqa: BLE001 - a type that does not take one message: a note instead
            named = None
        if named is not None:
            named.__cause__ = err
            return named
    err.add_note(f"in the disk tier of group {g}")
    return err


class HybridDiskTier:
    """A disk tier for every group of a hybrid cache in `directory` (see the module
    docstring). `capacity_bytes`: an int for every group, or one entry per group (None: the
    size that group's directory was created with; None alone: every group's). `compression`,
    `read_only`, `queue_blocks` and `durable` as `DiskTier`'s, for every group's tier."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes=None, *, compression: str | None = None,
                 read_only: bool = False, queue_blocks: int = 64, durable: bool = False):
        self._directory = os.fspath(directory)
        if not isinstance(self._directory, str) or not self._directory:
            raise TypeError(f"directory must be a path, got {directory!r}")
        if capacity_bytes is not None and not isinstance(capacity_bytes, int) and not isinstance(capacity_bytes, Sequence):
            raise TypeError(f"capacity_bytes must be an int, a sequence of one per group or None, got {capacity_bytes!r}")
        if isinstance(capacity_bytes, bool) or isinstance(capacity_bytes, (str, bytes)):
            raise TypeError(f"capacity_bytes must be an int, a sequence of one per group or None, got {capacity_bytes!r}")
        if isinstance(capacity_bytes, int):
            positive_int(capacity_bytes, "disk tier capacity_bytes")
        elif capacity_bytes is not None:
            capacity_bytes = tuple(capacity_bytes)
            for c in capacity_bytes:
                if c is not None:
                    positive_int(c, "disk tier capacity_bytes")
        self._capacity = capacity_bytes
        # checked now (a bad option is refused before any directory is touched); the tiers are made at bind
        DiskTier(self._directory, None, compression=compression, read_only=read_only, queue_blocks=queue_blocks,
                 durable=durable)
        self._options = dict(compression=compression, read_only=read_only, queue_blocks=queue_blocks, durable=durable)
        self._tiers: list[DiskTier] = []
        self._bound = self._closed = False

    # -- binding --------------------------------------------------------------------------

    def _capacities(self, n: int) -> list[int | None]:
        cap = self._capacity
        if cap is None or isinstance(cap, int):
            return [cap] * n
        cap = list(cap)
        if len(cap) != n:
            raise ValueError(f"capacity_bytes lists {len(cap)} groups, the cache has {n}")
        return cap

    def group_directory(self, g: int) -> str:
        """The directory of group `g`'s `DiskTier`."""
        return os.path.join(self._directory, f"group{int(g)}")

    def bind(self, host_tier: Any, block_sizes: Sequence[int]) -> list[list[IndexRecord]]:
        """Open every group's tier for `host_tier` (a `HybridHostTier`; once: PrefixCache does
        it); `block_sizes[g]`: tokens per record of group g. Refuses another grouping or a
        group of another layout (DiskLayoutMismatch naming the fields, nothing read but the
        layout files), a group's capacity_bytes below one slot of that group (ValueError
        naming the group, the capacity and the slot size, nothing written) and a second
        writer; every error from a group's tier names the group. All or nothing: a failure
        closes the tiers it opened and removes the group directories it created (never one
        that was there before); `groups.json` is written only once every group is bound.
        Returns each group's stored records, oldest first."""
        if self._bound:
            raise KvCacheError(f"{self.label()} is already bound to a prefix cache")
        if self._closed:
            raise KvCacheError(f"{self.label()} is closed")
        layout = host_tier.cache().layout()
        n = layout.num_groups()
        capacities = self._capacities(n)
        mine = describe_groups(layout)
        path = os.path.join(self._directory, GROUPS_FILE)
        theirs = self._read_groups(path)
        if theirs is not None:
            diffs = group_differences(mine, theirs)
            if diffs:
                raise DiskLayoutMismatch(f"{self._directory} holds another grouping: " + "; ".join(diffs))
        tiers = [DiskTier(self.group_directory(g), capacities[g], **self._options) for g in range(n)]
        for g, tier in enumerate(tiers):  # every group's layout before any index is read
            described, _ = tier.describe_for(host_tier.group(g), block_sizes[g])
            try:
                tier.check_layout(described)
            except DiskLayoutMismatch as err:
                raise DiskLayoutMismatch(f"group {g}: {err}") from None
            # before anything is written: a group's capacity must hold one of its slots
            if capacities[g] is not None and capacities[g] < described["slot_bytes"]:
                raise ValueError(f"group {g}: disk tier capacity_bytes {capacities[g]} is less than one slot of "
                                 f"that group ({described['slot_bytes']} bytes)")
        for g in range(n):  # before anything is written: a new group directory needs a size
            if capacities[g] is None and disk_layout.read_layout(self.group_directory(g)) is None:
                raise ValueError(f"{self.group_directory(g)} holds no disk tier yet: give capacity_bytes "
                                 f"for group {g}")
        existed = [os.path.exists(self.group_directory(g)) for g in range(n)]
        top_existed = os.path.exists(self._directory)
        records: list[list[IndexRecord]] = []
        try:
            for g, tier in enumerate(tiers):
                try:
                    records.append(tier.bind(host_tier.group(g), block_sizes[g]))
                except Exception as err:
                    raise _naming_group(err, g)
        except BaseException:
            for tier in tiers:
                tier.close()
            self._remove_created(existed, top_existed)
            raise
        if theirs is None and not self._options["read_only"]:  # only once every group is bound
            try:
                os.makedirs(self._directory, exist_ok=True)
                self._write_groups(path, mine)
            except OSError as err:  # degraded: each group's tier found it cannot write
                _log.warning("disk_tier_not_writable", directory=self._directory, reason=f"{type(err).__name__}: {err}")
        self._tiers = tiers
        self._bound = True
        _log.info("hybrid_disk_tier_opened", directory=self._directory, groups=n,
                  restored=[len(r) for r in records])
        return records

    def _remove_created(self, existed: list[bool], top_existed: bool) -> None:
        """A failed bind: remove the group directories it created (`existed[g]` False) and the
        tier directory when it created that and left it empty; nothing that was there before."""
        for g, was in enumerate(existed):
            if not was:
                shutil.rmtree(self.group_directory(g), ignore_errors=True)
        if not top_existed:
            try:
                os.rmdir(self._directory)
            except OSError:
                pass  # not empty (something else put a file there meanwhile) or already gone

    @staticmethod
    def _read_groups(path: str) -> dict | None:
        return read_description(path, "a hybrid disk tier's grouping", "groups")

    def _write_groups(self, path: str, description: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(json.dumps(description, sort_keys=True, indent=1).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        disk_layout.fsync_directory(self._directory)

    # -- facts ----------------------------------------------------------------------------

    def label(self) -> str:
        """A short name for messages."""
        return f"HybridDiskTier({self._directory!r})"

    def directory(self) -> str:
        """The tier's directory."""
        return self._directory

    def num_groups(self) -> int:
        """How many groups (0 before `bind`)."""
        return len(self._tiers)

    def group(self, g: int) -> DiskTier:
        """Group `g`'s `DiskTier` (after `bind`)."""
        if not self._bound:
            raise KvCacheError(f"{self.label()} is not bound to a prefix cache yet")
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < len(self._tiers):
            raise IndexError(f"group {g!r} out of range for a disk tier of {len(self._tiers)} group(s)")
        return self._tiers[g]

    def is_bound(self) -> bool:
        """True once a prefix cache opened it (and until `close`)."""
        return self._bound and not self._closed

    def stats(self) -> list[DiskTierStats]:
        """Every group's `DiskTierStats` ([] before `bind`)."""
        return [tier.stats() for tier in self._tiers]

    def flush(self) -> None:
        """Wait until every group's queued writes are done."""
        for tier in self._tiers:
            tier.flush()

    def close(self) -> None:
        """Close every group's tier (queued writes finished, locks released); the directory
        keeps what was written. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        first = None
        for tier in self._tiers:
            try:
                tier.close()
            except Exception as err:  # noqa: BLE001 - every tier closed
                first = first or err
        if first is not None:
            raise first

    def __enter__(self) -> "HybridDiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HybridDiskTier({self._directory!r}, groups={len(self._tiers)})"
