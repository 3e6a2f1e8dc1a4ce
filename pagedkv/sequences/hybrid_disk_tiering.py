"""The hybrid prefix cache over a `HybridDiskTier` below its `HybridHostTier`: host entries
of every group demoted to disk slots, disk entries promoted back, the trie a directory held
at start.

Residency is exclusive per group: a trie node holds group g's entry in exactly one tier,
`node.entries[g]` (device), `node.lower[g]` (host id) or `node.disk[g]` (disk slot of g's
`DiskTier`). Moves:
- the host tier of group g drops its least recently used entries (`HybridTiering.drop`):
  each is written to a disk slot of group g (`spill`: its bytes copied into the tier's write
  queue; the engine never waits for the write), except a sliding block no hit can use and
  one the queue has no room for, which are dropped as before;
- a disk slot is taken from the tier's free list, else from its least recently used slot
  (not being written, not pinned by a match): that entry is dropped (`GroupBlockRemoved`
  on DISK);
- `SequenceTable.add` promotes a match's disk entries with its host entries (`stage`): the
  disk slots are read into free host blocks of their groups (the engine waits for this
  read), then ONE swap brings host and staged entries of every group to fresh device ids;
  the disk slots are freed only after it. A failed swap frees the staged host blocks and
  leaves every entry where it was; an entry whose bytes fail their checksum (or whose write
  failed) is dropped and the table matches again;
- at construction each group's records become disk entries on trie nodes (`restore`): a
  record is used only when the node it starts at exists (the root, or a node another
  record made) and its tokens give its recorded hash. Entries of a salted or extra-keyed
  chain are demoted and promoted like any, but a later process does not restore them
  (their records do not rebuild a keyed chain). A chain is restored as far as its records
  link it to the root: with a full group (whose blocks of `[0, p)` every hit needs) every
  hit the directory can serve.
Events carry `medium="DISK"` and the group index. Counts per group (`stores`, `loads`,
`drops`) feed `HybridPrefixCache.stats()`.
"""

from __future__ import annotations

from typing import Any

from ..core.log import get_logger
from ..errors import KvCacheError, KvCacheExhausted
from ..tiers.disk_index import IndexRecord
from .hashing import chain_digest

_log = get_logger("prefix_cache")

class NoStagingRoom(KvCacheExhausted):
    """A disk hit could not be staged: a group's host tier has no block free and every one
    pinned. `SequenceTable.add` then matches again without the disk tier."""


NO_DISK: dict = {}
"""The `disk` of a trie node with no disk entry: one shared empty dict, never written to
(`set_disk` gives a node its own)."""

EVICTION_SCAN = 256
"""At most this many least-recently-used slots are looked at to find one to reuse."""


class HybridDiskTiering:
    """The disk-tier part of one `HybridPrefixCache` (`owner`) below its `HybridTiering`
    (`host`): per group, which node each slot holds (`by_slot[g]`), the slots pinned by
    outstanding matches, and the moves between host and disk with their counts."""

    def __init__(self, owner: Any, disk: Any, host: Any):
        self.owner, self.disk, self.host = owner, disk, host
        n = disk.num_groups()
        self.by_slot: list[dict[int, Any]] = [{} for _ in range(n)]
        self._pins: dict[tuple[int, int], int] = {}
        self.stores, self.loads, self.drops = [0] * n, [0] * n, [0] * n

    # -- pins -----------------------------------------------------------------------------

    def pin(self, g: int, slot: int) -> None:
        """Keep disk slot `slot` of group g from being reused (one count per match)."""
        self._pins[g, slot] = self._pins.get((g, slot), 0) + 1

    def unpin(self, g: int, slot: int) -> None:
        """Undo one `pin`."""
        left = self._pins.get((g, slot), 0) - 1
        if left > 0:
            self._pins[g, slot] = left
        else:
            self._pins.pop((g, slot), None)

    def pinned(self, g: int, slot: int) -> bool:
        """True while a match pins disk slot `slot` of group g."""
        return (g, slot) in self._pins

    def touch(self, g: int, slots: list[int]) -> None:
        """Record a use of group g's slots (the last the most recent)."""
        if slots:
            self.disk.group(g).touch(slots)

    # -- start: the directory's entries ----------------------------------------------------

    def restore(self, records: list[list[IndexRecord]], spans: list[int]) -> int:
        """Make disk entries of every group's `records` (`spans[g]`: tokens a record of group
        g ends). A record attaches where the node it starts at exists and its tokens give its
        hash; slots of the others (and a second record of one entry) are freed. Returns how
        many entries were restored."""
        owner, u = self.owner, owner_unit(self.owner)
        waiting: dict[int, list[tuple[int, IndexRecord]]] = {}  # (adapter << 64 | start hash) -> records
        for g, group_records in enumerate(records):
            for record in group_records:
                waiting.setdefault(record.adapter_id << 64 | record.parent_hash, []).append((g, record))
        restored: list[list[tuple[Any, int]]] = [[] for _ in records]
        stale: list[list[int]] = [[] for _ in records]
        stack = []
        for adapter in sorted({r.adapter_id for rs in records for r in rs}):
            root = owner._root(adapter)
            stack.append(root)
        while stack:
            node = stack.pop()
            for g, record in waiting.pop(node.adapter_id << 64 | node.hash, ()):
                units = spans[g] // u
                tokens = record.tokens
                if len(tokens) != 8 * spans[g]:
                    stale[g].append(record.slot)
                    continue
                keys = [tokens[i * 8 * u:(i + 1) * 8 * u] for i in range(units)]
                hashes, h = [], node.hash
                for key in keys:
                    h = int.from_bytes(chain_digest(h.to_bytes(8, "little"), key), "little")
                    hashes.append(h)
                if h != record.hash:  # tokens that do not give the recorded hash (a keyed chain)
                    stale[g].append(record.slot)
                    continue
                at = node
                for key, hash_ in zip(keys, hashes):
                    child = at.children.get(key)
                    if child is None:
                        child = at.children[key] = type(node)(at, key, at.depth + 1, hash_, node.adapter_id)
                        stack.append(child)  # records may start here
                    at = child
                if g in at.disk or g in at.entries or g in at.lower:
                    stale[g].append(record.slot)  # one entry stored twice: the first (oldest) found wins
                    continue
                set_disk(at, g, record.slot)
                self.by_slot[g][record.slot] = at
                restored[g].append((at, record.slot))
        for rest in waiting.values():  # their start is not in the directory
            for g, record in rest:
                stale[g].append(record.slot)
        total = 0
        for g, pairs in enumerate(restored):
            tier = self.disk.group(g)
            tier.free_slots(stale[g])
            pairs.sort(key=lambda p: p[0].depth, reverse=True)  # shallower entries the more recent
            tier.touch([slot for _, slot in pairs])
            total += len(pairs)
            if owner._events.consumer is not None:
                for node, slot in pairs:
                    owner._emit(owner._node_stored_event(g, slot, node, "DISK"))
        _log.info("prefix_cache_disk_restored", entries=[len(p) for p in restored],
                  records=[len(r) for r in records])
        return total

    # -- completions ------------------------------------------------------------------------

    def poll(self) -> None:
        """Take every group's finished writes: a failed one drops its entry."""
        for g in range(len(self.by_slot)):
            tier = self.disk.group(g)
            for slot, ok in tier.take_finished():
                if ok or tier.is_pending(slot) or tier.record(slot) is not None:
                    continue  # written, or the slot already holds a newer write
                node = self.by_slot[g].get(slot)
                if node is not None:
                    self._lose(g, slot, node, free=False)

    def _lose(self, g: int, slot: int, node: Any, free: bool = True, prune: bool = True) -> None:
        """Group g's entry in `slot` (on `node`) leaves the trie (its slot freed when `free`;
        `node` pruned when left empty and `prune`)."""
        del self.by_slot[g][slot]
        del node.disk[g]
        if free:
            self.disk.group(g).free_slots([slot])
        owner = self.owner
        if owner._events.consumer is not None:
            owner._emit(owner._removed_event(g, slot, node, "DISK"))
        if prune:
            owner._prune(node)

    # -- down: host -> disk ----------------------------------------------------------------

    def spill(self, g: int, pairs: list[tuple[int, Any]]) -> list[tuple[Any, int]]:
        """Write each `(host id, node)` of group g (host entries about to be dropped) to a
        disk slot, except sliding blocks no hit can use and those the queue has no room for:
        `(node, slot)` of those written (`node.disk[g]` set; the caller frees the host ids
        and emits their events, then `announce`s these)."""
        owner, tier = self.owner, self.disk.group(g)
        host_tier = self.host.tier.group(g)
        sliding = owner._groups[g].kind == "sliding"
        span = owner._span(g)
        out = []
        for host, node in pairs:
            if sliding and not owner._useful(g, node):
                continue
            slot = self._free_slot(g)
            if slot is None:
                continue
            start = node
            for _ in range(span // owner._unit):
                start = start.parent
            tokens = b"".join(n.key[: 8 * owner._unit] for n in _units(node, span // owner._unit))
            meta = IndexRecord(slot, 0, 0, node.adapter_id, node.hash, start.hash, 0, tokens)
            if tier.write(slot, host_tier.block_rows(host), meta):
                set_disk(node, g, slot)
                self.by_slot[g][slot] = node
                out.append((node, slot))
        self.stores[g] += len(out)
        return out

    def announce(self, g: int, written: list[tuple[Any, int]]) -> None:
        """The DISK stored events of `spill`'s entries."""
        owner = self.owner
        if owner._events.consumer is not None:
            for node, slot in written:
                owner._emit(owner._node_stored_event(g, slot, node, "DISK"))

    def _free_slot(self, g: int) -> int | None:
        tier = self.disk.group(g)
        slot = tier.alloc_slot()
        if slot is None and tier.is_writable():
            tier.poll()  # writes finished meanwhile: their slots may be reused
            slot = tier.alloc_slot()
            if slot is None and not tier.staging_free():  # the write queue is full: not written
                tier.count_skipped()
                return None
        if slot is None and tier.is_writable() and tier.staging_free():
            victim = None
            for i, candidate in enumerate(tier.oldest()):
                if i == EVICTION_SCAN:
                    break
                if tier.is_pending(candidate) or (g, candidate) in self._pins or candidate not in self.by_slot[g]:
                    continue
                victim = candidate
                break
            if victim is None:
                return None
            self.drops[g] += 1
            self._lose(g, victim, self.by_slot[g][victim])
            slot = tier.alloc_slot()
        if slot is not None and slot in self.by_slot[g]:  # a failed write not taken yet: that entry is gone
            node = self.by_slot[g][slot]
            del self.by_slot[g][slot]
            del node.disk[g]
            owner = self.owner
            if owner._events.consumer is not None:
                owner._emit(owner._removed_event(g, slot, node, "DISK"))
            owner._prune(node)
        return slot

    def forget(self, g: int, node: Any) -> None:
        """Group g's disk entry on `node` leaves the trie: a device copy takes its place (not
        an eviction: not counted in `drops`; `node` is not pruned, the caller gives it the
        entry)."""
        self._lose(g, node.disk[g], node, prune=False)

    # -- up: disk -> host (staged) -> device -------------------------------------------------

    def wanted(self, found: Any) -> dict[int, list[tuple[int, int, int, Any]]] | None:
        """A match's disk entries as `{g: [(index, None, slot, node)]}`; None when one is
        gone meanwhile (a failed write, `clear`): the caller matches again."""
        out = {}
        for g, pairs in enumerate(found.disk_entries):
            if pairs:
                nodes = found.disk_nodes[g]
                if any(self.by_slot[g].get(slot) is not node for (_, slot), node in zip(pairs, nodes)):
                    return None
                out[g] = [(i, None, slot, node) for (i, slot), node in zip(pairs, nodes)]
        return out

    def stage(self, wanted: dict) -> dict[int, list[tuple[int, int, int, Any]]] | None:
        """Read as many of `wanted`'s disk entries (`{g: [(index, _, slot, node)]}`, in order)
        as group g's host tier has room for (dropping unpinned host entries for it, which may
        spill to disk) into free host blocks: `{g: [(index, host id, slot, node)]}`, the host
        ids the caller's (`unstage`). None when an entry is gone or fails its read: what was
        staged is freed, the failed entries dropped (the caller matches again).
        `NoStagingRoom` (nothing staged) when a group with entries left has no room at all
        (every host entry pinned)."""
        host = self.host
        room = {}
        for g, items in wanted.items():
            if not items:
                continue
            short = len(items) - host.tier.group(g).num_free_blocks()
            if short > 0:
                host.drop(g, short)
            room[g] = min(len(items), host.tier.group(g).num_free_blocks())
            if room[g] == 0:
                raise NoStagingRoom(f"group {g}'s host tier: no free block to stage a disk hit "
                                       f"({host.tier.group(g).num_blocks()} blocks, every one pinned)")
        for g, n in room.items():  # gone meanwhile (a failed write taken while making room)
            if any(self.by_slot[g].get(slot) is not node for _, _, slot, node in wanted[g][:n]):
                return None
        staged: dict[int, list[tuple[int, int, int, Any]]] = {}
        bad: list[tuple[int, int, Any]] = []
        try:
            for g, n in room.items():
                tier = host.tier.group(g)
                items = wanted[g][:n]
                hosts = tier.alloc(n)
                staged[g] = [(i, h, slot, node) for (i, _, slot, node), h in zip(items, hosts)]
                ok = self.disk.group(g).read([slot for _, _, slot, _ in items], [tier.block_rows(h) for h in hosts])
                bad.extend((g, slot, node) for (_, _, slot, node), fine in zip(items, ok) if not fine)
        except BaseException:
            self.unstage(staged)
            raise
        if bad:
            self.unstage(staged)
            for g, slot, node in bad:
                if self.by_slot[g].get(slot) is node:
                    self._lose(g, slot, node)
            _log.warning("prefix_cache_disk_read_dropped", entries=len(bad))
            return None
        return staged

    def unstage(self, staged: dict, handle: Any = None, failed: bool = True) -> None:
        """Free staged host blocks (with `handle`: once that swap, which may still read them,
        is done; `failed`: a swap whose completion could not be established)."""
        for g, items in staged.items():
            tier = self.host.tier.group(g)
            hosts = [h for _, h, _, _ in items]
            if handle is None or handle.event() is None:
                tier.free(hosts)
            elif failed:
                tier.abandon(handle, hosts)
            else:
                tier.free(hosts, after=handle)

    def promoted(self, g: int, slot: int, node: Any) -> None:
        """Group g's disk entry in `slot` was promoted (the device id is on `node` now): its
        slot is free, one `GroupBlockRemoved` on DISK."""
        self.unpin(g, slot)
        del self.by_slot[g][slot]
        del node.disk[g]
        self.disk.group(g).free_slots([slot])
        self.loads[g] += 1
        owner = self.owner
        if owner._events.consumer is not None:
            owner._emit(owner._removed_event(g, slot, node, "DISK"))

    # -- whole-cache ------------------------------------------------------------------------

    def live(self) -> bool:
        """False once the disk tier was closed."""
        return self.disk.is_bound()

    def forget_all(self, wipe: bool = False) -> None:
        """Forget every disk entry (events on DISK); with `wipe` the directory forgets them
        too (`clear`), else it keeps them for a later process (`close`, a closed tier)."""
        owner = self.owner
        for g, by_slot in enumerate(self.by_slot):
            for slot, node in list(by_slot.items()):
                del node.disk[g]
                if owner._events.consumer is not None:
                    owner._emit(owner._removed_event(g, slot, node, "DISK"))
                owner._prune(node)
            if self.disk.is_bound():
                tier = self.disk.group(g)
                tier.free_slots(list(by_slot))
                if wipe:
                    tier.forget_all()
            by_slot.clear()
        self._pins.clear()

    def num_entries(self, g: int) -> int:
        """Group g's entries on disk."""
        return len(self.by_slot[g])

    def check(self) -> None:
        """KvCacheError where a disk entry is not on its node, sits beside another tier's, or
        the tier's LRU and the index disagree (or the shared `NO_DISK` was written to)."""
        if NO_DISK:
            raise KvCacheError(f"the shared empty disk map of trie nodes holds {NO_DISK!r}")
        for g, by_slot in enumerate(self.by_slot):
            tier = self.disk.group(g)
            for slot, node in by_slot.items():
                if node.disk.get(g) != slot:
                    raise KvCacheError(f"group {g} disk slot {slot} is not on its node")
                if g in node.entries or g in node.lower:
                    raise KvCacheError(f"group {g} disk slot {slot} sits beside a device or host entry")
            if tier.num_cached_blocks() != len(by_slot):
                raise KvCacheError(f"group {g}'s disk tier LRU holds {tier.num_cached_blocks()}, the trie {len(by_slot)}")


def set_disk(node: Any, g: int, slot: int) -> None:
    """Record group g's disk slot on `node` (whose `disk` is the shared empty `NO_DISK` until
    its first disk entry: most nodes never get one)."""
    if node.disk is NO_DISK:
        node.disk = {}
    node.disk[g] = slot


def owner_unit(owner: Any) -> int:
    """The owner's hash unit (tokens per trie node)."""
    return owner._unit


def _units(node: Any, n: int) -> list:
    """The `n` nodes ending at `node`, shallowest first."""
    out = []
    for _ in range(n):
        out.append(node)
        node = node.parent
    out.reverse()
    return out

