"""The prefix cache over a disk tier below its host tier: host blocks demoted to disk
slots, disk blocks read back into host blocks, and the chains a directory held at start.

A node's disk copy is kept in this part's maps (`slot_of`, `by_slot`), not in the tree: a
copy may exist beside a device or host block (the disk tier is inclusive: a block read
back keeps its slot, so demoting it again writes nothing), and a node whose only copy is on
disk is "disk-only" (`block` None, `lower` None). Residency never rises down a chain:
device nodes, then host nodes, then disk-only nodes, so a match is device blocks, host
blocks, then disk slots.

Moves:
- the host tier drops its least recently used leaves (`HostTiering.drop`): each gets a
  disk copy unless it has one (the bytes copied into the tier's write queue, written by
  its I/O thread; the engine never waits) and becomes disk-only; one the queue has no room
  for is dropped as before, with its disk-only descendants;
- a slot needed for a new copy is taken from the disk tier's free list, else from its least
  recently used slot (one not being written, not pinned): a copy beside an upper block is
  simply forgotten, a disk-only node goes with its disk-only descendants;
- `SequenceTable.add` reads the disk part of its match into host blocks (`load`; the engine
  waits for this read, never for a write), then promotes the whole host part with one
  swap_in as before; a block whose bytes fail their checksum is dropped, with what follows it;
- at construction the directory's records become disk-only nodes (`restore`): a record is
  used only when its parent chain is there and its tokens give its recorded hash.
Events carry medium "DISK" for the disk tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.log import get_logger
from ..errors import KvCacheError
from ..tiers.disk_index import IndexRecord
from .events import BlockRemoved, BlockStored, EventQueue
from .hashing import root_hash
from .stats import PrefixCounters
from .tree import Node, RadixTree, is_keyed

if TYPE_CHECKING:
    from ..tiers.disk_tier import DiskTier
    from .tiering import HostTiering

_log = get_logger("prefix_cache")

EVICTION_SCAN = 256
"""At most this many least-recently-used slots are looked at to find one to reuse."""


def is_disk_only(node: Node) -> bool:
    """True for a node whose only copy is a disk slot."""
    return node.block is None and node.lower is None


class DiskTiering:
    """The disk-tier part of one prefix cache, beside its `HostTiering`."""

    def __init__(self, disk: "DiskTier", host: "HostTiering", tree: RadixTree, events: EventQueue,
                 counts: PrefixCounters):
        self.disk = disk
        self.slot_of: dict[Node, int] = {}
        self.by_slot: dict[int, Node] = {}
        self._pinned: set[int] = set()
        self._host = host
        self._tree = tree
        self._events = events
        self._counts = counts
        self._block_size = tree.block_size

    # -- start: the directory's chains ------------------------------------------------------

    def restore(self, records: list[IndexRecord]) -> int:
        """Make disk-only nodes of the directory's `records` (oldest first): a record whose
        parent chain is present and whose tokens give its hash. Slots of the others are
        freed. Returns how many blocks were restored."""
        newest: dict[int, IndexRecord] = {}  # (adapter << 64 | hash) -> record
        stale = []
        for record in records:
            key = record.adapter_id << 64 | record.hash
            old = newest.get(key)
            if old is not None:
                stale.append(old.slot)  # the same block stored twice: keep the newest
            newest[key] = record
        children: dict[int, list[IndexRecord]] = {}
        for record in newest.values():
            key = record.adapter_id << 64 | record.parent_hash
            group = children.get(key)
            if group is None:
                children[key] = [record]
            else:
                group.append(record)
        order: list[Node] = []
        tree, attach, slot_of, by_slot = self._tree, self._tree.attach, self.slot_of, self.by_slot
        token_bytes = 8 * self._block_size
        for adapter in sorted({r.adapter_id for r in newest.values()}):
            high = adapter << 64
            stack = [(tree.root(adapter), r) for r in children.pop(high | root_hash(adapter), ())]
            while stack:
                parent, record = stack.pop()
                tokens = record.tokens
                if tokens in parent.children or len(tokens) != token_bytes:
                    stale.append(record.slot)
                    continue
                node = attach(parent, tokens)
                if node.hash != record.hash:  # a record whose tokens do not give its hash
                    del parent.children[tokens]
                    stale.append(record.slot)
                    continue
                slot_of[node] = record.slot
                by_slot[record.slot] = node
                order.append(node)
                below = children.pop(high | node.hash, None)
                if below is not None:
                    stack.extend((node, r) for r in below)
        for rest in children.values():  # orphans: their parent chain is not in the directory
            stale.extend(r.slot for r in rest)
        self.disk.free_slots(stale)
        self.disk.touch([slot_of[n] for n in reversed(order)])  # parents more recent than children
        if order and self._events.consumer is not None:
            for node in order:
                self._emit_stored([node])
        _log.info("prefix_cache_disk_restored", blocks=len(order), records=len(records))
        return len(order)

    # -- completions ------------------------------------------------------------------------

    def poll(self) -> None:
        """Take the disk tier's finished writes: a failed one drops its copy (and a disk-only
        node with its disk-only descendants)."""
        for slot, ok in self.disk.take_finished():
            if ok:
                continue
            node = self.by_slot.pop(slot, None)
            if node is None:
                continue
            del self.slot_of[node]
            self._emit_removed([node], [slot])
            if is_disk_only(node) and node.parent is not None and node.parent.children.get(node.key) is node:
                self._remove_subtree(node)

    # -- down: host -> disk ----------------------------------------------------------------

    def store(self, nodes: list[Node], host_rows) -> set[int]:
        """Give each of `nodes` (host nodes about to leave the host tier; `host_rows(node)`:
        its host block's rows) a disk copy unless it has one: ids of the nodes that have
        one afterwards (the others could not be queued)."""
        kept: set[int] = set()
        stored: list[Node] = []
        self.pin(nodes)  # a slot for one must not come from another's copy
        try:
            self._store(nodes, host_rows, kept, stored)
        finally:
            self.unpin(nodes)
        if stored:
            self._counts.disk_stores += len(stored)
            if self._events.consumer is not None:
                for node in stored:
                    self._emit_stored([node])
        return kept

    def _store(self, nodes: list[Node], host_rows, kept: set[int], stored: list[Node]) -> None:
        for node in nodes:
            if node in self.slot_of:
                kept.add(id(node))
                continue
            if is_keyed(node, self._tree.block_size):
                continue  # the disk index keeps token-keyed chains only: a salted or extra-keyed block stays off disk
            slot = self._free_slot()
            if slot is None:
                continue
            meta = IndexRecord(slot, 0, 0, node.adapter_id, node.hash, node.parent.hash, 0, node.key)
            if self.disk.write(slot, host_rows(node), meta):
                self.slot_of[node] = slot
                self.by_slot[slot] = node
                kept.add(id(node))
                stored.append(node)

    def _free_slot(self) -> int | None:
        disk = self.disk
        slot = disk.alloc_slot()
        if slot is None and disk.is_writable() and not disk.staging_free():
            disk.count_skipped()  # the write queue is full: not written
        if slot is not None or not disk.is_writable() or not disk.staging_free():
            return slot
        victim = None
        for i, candidate in enumerate(disk.oldest()):
            if i == EVICTION_SCAN:
                break
            node = self.by_slot.get(candidate)
            if disk.is_pending(candidate) or node is None or id(node) in self._pinned:
                continue
            victim = node
            break
        if victim is None:
            return None
        self._counts.disk_drops += 1
        if is_disk_only(victim):
            self._remove_subtree(victim)
        else:
            self._forget_copy(victim)
        return disk.alloc_slot()

    def _forget_copy(self, node: Node) -> None:
        slot = self.slot_of.pop(node)
        del self.by_slot[slot]
        self.disk.free_slots([slot])
        self._emit_removed([node], [slot])

    def _remove_subtree(self, node: Node) -> None:
        """Take disk-only `node` and its descendants (disk-only too) out of the tree."""
        del node.parent.children[node.key]
        gone, stack = [], [node]
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            gone.append(child)
        self.forget(gone)

    def forget(self, nodes: list[Node]) -> None:
        """Free the disk copies of `nodes` (already out of the tree, or leaving it)."""
        had = [n for n in nodes if n in self.slot_of]
        slots = [self.slot_of.pop(n) for n in had]
        for slot in slots:
            del self.by_slot[slot]
        self.disk.free_slots(slots)
        self._emit_removed(had, slots)

    # -- matching ---------------------------------------------------------------------------

    def touch(self, nodes: list[Node]) -> None:
        """Record a use of the copies of `nodes` (a chain, parent first): parents become the
        more recent."""
        slot_of = self.slot_of
        self.disk.touch([slot_of[n] for n in reversed(nodes) if n in slot_of])

    def pin(self, nodes: list[Node]) -> None:
        """Keep the copies of `nodes` from being reused until `unpin`."""
        self._pinned.update(id(n) for n in nodes)

    def unpin(self, nodes: list[Node]) -> None:
        """Let the copies of `nodes` be reused again."""
        self._pinned.difference_update(id(n) for n in nodes)

    # -- up: disk -> host ------------------------------------------------------------------

    def load(self, found: Any) -> int:
        """Read the disk part of a reservation (`found.disk_path`, pinned) into host blocks:
        those nodes become host-resident (keeping their copies) and join `found.host_path` /
        `host_blocks`, pinned as host nodes. Stops at the first block the host tier has no
        room for; a block failing its checksum is dropped with what follows it. Returns how
        many blocks were loaded (the engine waits for the read)."""
        nodes = list(found.disk_path)
        self.unpin(nodes)
        found.disk_path, found.disk_blocks, found.disk_num_tokens = [], [], 0
        if not nodes:
            return 0
        host = self._host
        tier = host.tier
        short = len(nodes) - tier.num_free_blocks()
        if short > 0:
            self.pin(nodes)  # the drop writes to disk and may look for slots to reuse
            try:
                host.drop(short)
            finally:
                self.unpin(nodes)
        nodes = nodes[: min(len(nodes), tier.num_free_blocks())]
        if not nodes:
            return 0
        hosts = tier.alloc(len(nodes))
        ok = self.disk.read([self.slot_of[n] for n in nodes], [tier.block_rows(h) for h in hosts])
        good = next((i for i, fine in enumerate(ok) if not fine), len(nodes))
        tier.free(hosts[good:])
        if good < len(nodes):
            self._remove_subtree(nodes[good])  # what failed, and every block after it
            nodes = nodes[:good]
        hosts = hosts[:good]
        for node, block in zip(nodes, hosts):
            node.lower = block
            host.by_host[block] = node
        tier.touch(list(reversed(hosts)) + [n.lower for n in reversed(found.host_path)])  # parents most recent
        found.host_path = found.host_path + nodes
        found.host_blocks = found.host_blocks + hosts
        found.host_num_tokens = len(found.host_path) * self._block_size
        host.pin(found)
        found.loaded = len(nodes)
        self._counts.disk_loads += len(nodes)
        if nodes and self._events.consumer is not None:
            self._emit_stored(nodes, hosts, "CPU")
        return len(nodes)

    # -- whole-cache ------------------------------------------------------------------------

    def forget_all(self) -> None:
        """Forget every copy (the host tier went away, or the prefix cache closed): disk-only
        nodes leave the tree. The directory keeps its blocks for a later process."""
        for node in list(self.slot_of):
            if is_disk_only(node) and node.parent is not None:
                node.parent.children.pop(node.key, None)
        self.disk.free_slots(list(self.by_slot))
        self.slot_of.clear()
        self.by_slot.clear()
        self._pinned.clear()

    def clear(self) -> int:
        """`forget_all`, and the directory forgets its blocks too (a restart finds none);
        returns how many copies there were."""
        n = len(self.by_slot)
        self.forget_all()
        if self.disk.is_bound():
            self.disk.forget_all()
        return n

    def num_blocks(self) -> int:
        """How many blocks have a disk copy."""
        return len(self.by_slot)

    def num_disk_only(self) -> int:
        """How many nodes live on disk only."""
        return sum(1 for n in self.slot_of if is_disk_only(n))

    def check_lower(self, node: Node) -> None:
        """KvCacheError unless disk-only `node` has a copy and no child above the disk."""
        if node not in self.slot_of or self.by_slot.get(self.slot_of[node]) is not node:
            raise KvCacheError(f"a disk-only node without an indexed disk slot (hash {node.hash:#x})")
        for child in node.children.values():
            if not is_disk_only(child):
                raise KvCacheError(f"a node above the disk tier under disk-only slot {self.slot_of[node]}")

    # -- events ------------------------------------------------------------------------------

    def _emit_stored(self, nodes: list[Node], ids: list[int] | None = None, medium: str = "DISK") -> None:
        if self._events.consumer is None:
            return
        parent = nodes[0].parent
        tokens: list[int] = []
        for node in nodes:
            tokens.extend(int.from_bytes(node.key[i : i + 8], "little") for i in range(0, len(node.key), 8))
        self._events.emit(BlockStored(
            block_hashes=self._events.hashes(nodes),
            parent_block_hash=None if parent.block == -1 else self._events.hashes([parent])[0],
            token_ids=tuple(tokens),
            block_ids=tuple(ids if ids is not None else (self.slot_of[n] for n in nodes)),
            block_size=self._block_size,
            adapter_id=nodes[0].adapter_id,
            medium=medium,
        ))

    def _emit_removed(self, nodes: list[Node], slots: list[int]) -> None:
        if self._events.consumer is not None and slots:
            self._events.emit(BlockRemoved(block_hashes=self._events.hashes(nodes), block_ids=tuple(slots),
                                           medium="DISK"))
