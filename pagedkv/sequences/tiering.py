"""The prefix cache over a host tier: demotion of evicted blocks and promotion back.

The victims of one eviction are copied to host blocks in ONE `swap_out` on the swap
stream, and the device blocks go back to the free list only after that swap has completed
(the cache waits for its event: correct first, at the price of a host wait per eviction
batch). A node is then host-resident: same key, same hash, its KV in a host block (the
node's `lower`). Host blocks are dropped only when the host tier is full, least recently
used first (the tier's LRU). Tree invariants with a tier: every ancestor of a device node
is on the device (so a match is device blocks, then host blocks); a host node's children
are host-resident; in the tier's LRU a host node is more recent than its host children (so
the oldest is always a leaf). `SequenceTable.add` promotes the host part of its match
(device blocks allocated, ONE `swap_in` on the table's stream). Events carry `medium`:
"GPU" for the device tier, "CPU" for the host.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.log import get_logger
from ..errors import KvCacheError
from .events import BlockRemoved, EventQueue, stored
from .eviction import Chosen
from .retention import priority_of
from .stats import PrefixCounters
from .tree import Node, RadixTree

if TYPE_CHECKING:
    from ..cache import PagedKvCache
    from ..tiers.host_tier import HostTier

_log = get_logger("prefix_cache")


class HostTiering:
    """The host-tier part of one prefix cache: which node each host block holds
    (`by_host`), which host nodes a promotion in progress needs (pinned), and the moves
    between the tiers."""

    def __init__(self, tier: "HostTier", swap_stream: object, tree: RadixTree, policy: Any,
                 cache: "PagedKvCache", events: EventQueue, counts: PrefixCounters):
        self.tier = tier
        self.swap_stream = swap_stream
        self.by_host: dict[int, Node] = {}
        self._pinned: set[int] = set()  # ids of host nodes a promotion in progress needs
        self._tree = tree
        self._policy = policy
        self._cache = cache
        self._events = events
        self._counts = counts
        self._block_size = tree.block_size
        self.disk = None  # the DiskTiering below, when the prefix cache has a disk tier

    def split(self, path: list[Node]) -> tuple[list[Node], list[Node], list[Node]]:
        """(device nodes, host nodes, disk-only nodes) of a path: by the tier invariant
        they come in that order."""
        i = 0
        n = len(path)
        while i < n and path[i].block is not None:
            i += 1
        j = i
        while j < n and path[j].lower is not None:
            j += 1
        return path[:i], path[i:j], path[j:]

    def demote(self, chosen: Chosen) -> list[int]:
        """Evict the chosen device leaves into the host tier: room is made by dropping the
        tier's least recently used leaves, then ONE swap_out copies the victims, and the
        device blocks return to the free list once it has completed. Victims the tier has
        no room for (every host block pinned) are dropped, deepest first, with their host
        subtrees. A swap error unselects the victims and propagates: no device block
        changed. Returns the device blocks freed."""
        tier, nodes = self.tier, [node for _, node in chosen]  # children before parents
        short = len(nodes) - tier.num_free_blocks()
        if short > 0:
            self.drop(short)
        room = min(len(nodes), tier.num_free_blocks())
        dropped, demoted = nodes[: len(nodes) - room], nodes[len(nodes) - room :]
        hosts = tier.alloc(len(demoted))
        handle = None
        try:
            handle = tier.swap_out([n.block for n in demoted], hosts, self.swap_stream)
            handle.wait()
        except ValueError as err:  # a tier format refused the values (NaN/inf on the host codecs): drop them
            self._give_back(handle, hosts)
            _log.warning("prefix_cache_demotion_refused", blocks=len(demoted), error=str(err))
            dropped, demoted, hosts = nodes, [], []
        except BaseException:
            self._give_back(handle, hosts)
            self._policy.unselect(chosen)
            raise
        blocks = [n.block for n in nodes]
        for block in blocks:
            self._cache.return_evicted_block(block)  # while still cached: the cache's own reference
        tree = self._tree
        for node in dropped:
            self.drop_subtree(node)
            tree.remove_leaf(node)
        if dropped and self.disk is not None:
            self.disk.forget(dropped)
        for node, host in zip(demoted, hosts):
            tree.leave_device(node, host)
            self.by_host[host] = node
        tier.touch(hosts)  # children were chosen before parents: a parent is the more recent
        self._counts.demotions += len(demoted)
        _log.debug("prefix_cache_demoted", blocks=len(demoted), dropped=len(dropped))
        events = self._events
        if events.consumer is not None:
            events.emit(BlockRemoved(block_hashes=events.hashes(nodes), block_ids=tuple(blocks)))
            for node, host in zip(demoted, hosts):
                events.emit(stored([node], np.frombuffer(node.key[: 8 * self._block_size], "<i8").tolist(), (host,),
                                   self._block_size, "CPU", events.digest))
        return blocks

    def drop(self, n: int) -> None:
        """Free up to `n` host blocks of host-resident leaves (no child in the host tier),
        least recently used first (pinned ones kept). With a disk tier each becomes
        disk-only (a copy queued for writing unless it has one); the others leave the tree."""
        gone: list[Node] = []
        picked: set[int] = set()
        by_host, pinned = self.by_host, self._pinned
        if getattr(self._policy, "hints", 0):
            gone = self._by_priority(n, picked)
        for host in self.tier.oldest() if not gone else ():  # the LRU is left alone until the loop is done
            if len(gone) == n:
                break
            node = by_host[host]
            if (id(node) in pinned or (node.retain is not None and node.retain.pins)
                    or any(c.lower is not None and id(c) not in picked for c in node.children.values())):
                continue  # its parent, more recent, comes later in the LRU
            gone.append(node)
            picked.add(id(node))
        if not gone:
            return
        disk = self.disk
        kept = disk.store(gone, lambda node: self.tier.block_rows(node.lower)) if disk is not None else set()
        lost = [node for node in gone if id(node) not in kept]
        for node in lost:
            del node.parent.children[node.key]
        hosts = [node.lower for node in gone]
        for node in gone:
            del by_host[node.lower]
            node.lower = None
        self.tier.free(hosts)
        self._counts.host_drops += len(gone)
        if self._events.consumer is not None:
            self._events.emit(BlockRemoved(block_hashes=self._events.hashes(gone), block_ids=tuple(hosts), medium="CPU"))
        if disk is not None:
            for node in lost:  # its disk-only descendants went with it
                stack, below = list(node.children.values()), []
                while stack:
                    child = stack.pop()
                    stack.extend(child.children.values())
                    below.append(child)
                disk.forget(below)

    def _by_priority(self, n: int, picked: set[int]) -> list[Node]:
        """`drop`'s victims once retention hints exist: host leaves lowest priority first,
        least recently used first within a priority, children before parents, pinned ones
        kept (O(host blocks) per call)."""
        by_host, pinned = self.by_host, self._pinned
        rank = {host: i for i, host in enumerate(self.tier.oldest())}

        def free_to_go(node: Node) -> bool:
            return not (id(node) in pinned or (node.retain is not None and node.retain.pins)
                        or any(c.lower is not None and id(c) not in picked for c in node.children.values()))

        heap = [(priority_of(node), rank[host], id(node), node) for host, node in by_host.items() if free_to_go(node)]
        heapq.heapify(heap)
        gone: list[Node] = []
        while heap and len(gone) < n:
            node = heapq.heappop(heap)[3]
            if id(node) in picked:
                continue
            gone.append(node)
            picked.add(id(node))
            parent = node.parent
            if parent.lower is not None and parent.lower in by_host and free_to_go(parent):
                heapq.heappush(heap, (priority_of(parent), rank[parent.lower], id(parent), parent))
        return gone

    def drop_subtree(self, node: Node) -> None:
        """Drop every host-resident descendant of `node` (whose device children are gone)."""
        gone, stack = [], list(node.children.values())
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            gone.append(child)
        node.children.clear()
        self._forget(gone)

    def _forget(self, nodes: list[Node]) -> None:
        """`nodes` leave the tree: free their host blocks and disk copies."""
        if not nodes:
            return
        on_host = [n for n in nodes if n.lower is not None]
        hosts = [n.lower for n in on_host]
        for node in on_host:
            del self.by_host[node.lower]
            node.lower = None
        self.tier.free(hosts)
        self._counts.host_drops += len(on_host)
        if on_host and self._events.consumer is not None:
            self._events.emit(BlockRemoved(block_hashes=self._events.hashes(on_host), block_ids=tuple(hosts), medium="CPU"))
        if self.disk is not None:
            self.disk.forget(nodes)

    def to_device(self, nodes: list[Node], blocks: list[int], after=None) -> None:
        """Make host-resident `nodes` (a chain, parent first) device-resident in `blocks`
        (held by the caller, who adds the cache's reference); their host blocks are freed
        once `after` (the swap reading them, if any) is done. An error polling `after`
        propagates with nothing changed."""
        on_host = [n for n in nodes if n.lower is not None]  # the others are disk-only (an insert adopting them)
        hosts = [n.lower for n in on_host]
        self.tier.free(hosts, after=after)  # first: if polling `after` fails, nothing has changed
        tree, by_host = self._tree, self.by_host
        for node, block in zip(nodes, blocks):
            if node.lower is not None:
                del by_host[node.lower]
            tree.enter_device(node, block)
        if on_host and self._events.consumer is not None:
            self._events.emit(BlockRemoved(block_hashes=self._events.hashes(on_host), block_ids=tuple(hosts), medium="CPU"))

    def forget_all(self) -> None:
        """The host tier was released: forget every host-resident node (one BlockRemoved
        on the CPU); the cache goes on device-only."""
        if self.disk is not None:
            self.disk.forget_all()
        nodes = list(self.by_host.values())
        for node in nodes:
            node.parent.children.pop(node.key, None)
        hosts = list(self.by_host)
        for node in nodes:
            node.lower = None
        self.by_host.clear()
        self._pinned.clear()
        self._counts.host_drops += len(nodes)
        if nodes and self._events.consumer is not None:
            self._events.emit(BlockRemoved(block_hashes=self._events.hashes(nodes), block_ids=tuple(hosts), medium="CPU"))

    def clear(self, wipe_disk: bool = True) -> int:
        """Free every host block (while the tier is live) and forget the host nodes and disk
        copies (with `wipe_disk`, the directory forgets them too); returns how many host
        blocks there were. No event: the caller reports the clear."""
        if self.disk is not None:
            self.disk.clear() if wipe_disk else self.disk.forget_all()
        hosts = list(self.by_host)
        if hosts and self.tier.is_live():
            self.tier.free(hosts)
        for node in self.by_host.values():
            node.lower = None
        self.by_host.clear()
        self._pinned.clear()
        return len(hosts)

    def _give_back(self, handle: Any, hosts: list[int]) -> None:
        """Free the host blocks of a failed demotion: at once when no copy is in flight,
        else once the tier knows the copy is done (the tier keeps its handle)."""
        if handle is None or handle.event() is None:
            self.tier.free(hosts)
        else:
            self.tier.abandon(handle, hosts)

    def pin(self, found: Any) -> None:
        """Keep a reservation's host part from being dropped until `unpin`."""
        self._pinned.update(id(n) for n in getattr(found, "host_path", ()))

    def unpin(self, found: Any) -> None:
        """Let a reservation's host part be dropped again."""
        self._pinned.difference_update(id(n) for n in getattr(found, "host_path", ()))

    def promote(self, found: Any, blocks: list[int], gpu: object, stream: object, wait: bool) -> None:
        """Bring a reservation's host part into `blocks` (fresh device blocks the caller
        holds, one per host node): ONE swap_in on `stream`, then the nodes are device-resident
        with the cache's reference on `blocks`, and the reservation covers them. A swap error
        propagates with nothing changed. With `wait`, the host waits for the copy."""
        nodes = found.host_path
        tier = self.tier
        if gpu is not None and gpu is not tier.gpu():
            raise ValueError("the sequence table's backend is not the host tier's")
        handle = tier.swap_in([n.lower for n in nodes], blocks, stream)
        try:
            if wait:
                handle.wait()
            self.to_device(nodes, blocks, after=handle)
        except BaseException:
            tier.keep(handle)  # its event is destroyed by the tier's release at the latest
            raise
        self._cache.inc_refs(blocks)  # after the step that can fail: the caller frees `blocks` once
        self.unpin(found)
        found.path = found.path + nodes
        found.promoted = len(nodes)
        self._counts.promotions += len(nodes)
        if self._events.consumer is not None:
            tokens = np.frombuffer(b"".join(n.key[: 8 * self._block_size] for n in nodes), "<i8").tolist()
            self._events.emit(stored(nodes, tokens, blocks, self._block_size, digest=self._events.digest))

    def checker(self):
        """A `check_lower(node)` for `RadixTree.check`: KvCacheError where a host node
        breaks the tier's invariants (indexed, in the tier's LRU, older than its parent)."""
        rank = {host: i for i, host in enumerate(self.tier.lru_blocks())}
        tier, by_host = self.tier, self.by_host

        disk = self.disk

        def check_lower(node: Node) -> None:
            if node.lower is None and disk is not None:
                disk.check_lower(node)
                return
            if node.lower is None or by_host.get(node.lower) is not node:
                raise KvCacheError(f"a node with neither a device nor an indexed host block (host {node.lower})")
            if not tier.is_cached(node.lower):
                raise KvCacheError(f"host block {node.lower} is in the tree but not in the host tier's LRU")
            parent = node.parent
            if parent.block is None and parent.lower is None:
                raise KvCacheError(f"host block {node.lower} sits under a disk-only node")
            if parent.block is None and rank[parent.lower] < rank[node.lower]:
                raise KvCacheError(f"host block {parent.lower} is older than its child {node.lower} in the LRU")

        return check_lower

    def check_counts(self) -> None:
        """KvCacheError when the tier's LRU and the index disagree on how many blocks are cached."""
        if self.tier.num_cached_blocks() != len(self.by_host):
            raise KvCacheError(f"the host tier's LRU holds {self.tier.num_cached_blocks()} blocks, the tree {len(self.by_host)}")
