"""Which cached blocks the prefix cache gives up first: the eviction policy.

`LruEviction` evicts least-recently-used leaves whose block only the prefix cache holds
(count 1), from a heap of candidates with lazy deletion: a leaf is pushed when it becomes
evictable (its count falls to 1, or its last device child is evicted) and checked again
when popped, so each eviction costs O(log n) amortised. A block's "use" is a match, an
insert, or the moment its last other holder released it; uses are stamped from one clock.

The prefix cache talks to its policy only through the methods below, so a policy with
other rules (priorities, pins, time to live) replaces this one object.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable

from .tree import Node, RadixTree

Chosen = list[tuple[int, Node]]
"""Victims in eviction order, each with the stamp it was chosen under (for `unselect`)."""


class LruEviction:
    """Least-recently-used leaves first, children before parents."""

    def __init__(self, tree: RadixTree, ref_count: Callable[[int], int]):
        self._tree = tree
        self._by_block = tree.by_block
        self._ref_count = ref_count
        self._heap: list[tuple[int, int, Node]] = []
        self.clock = 0
        self._serial = 0

    def touch(self, nodes: Iterable[Node]) -> None:
        """Record a use of each of `nodes`, in order (a parent before its children)."""
        clock = self.clock
        for node in nodes:
            clock += 1
            node.last_used = clock
        self.clock = clock

    def touch_chain(self, path: list[Node]) -> None:
        """Record a use of each node of `path` (a chain from the root, in order); only its
        last node can be a leaf, which becomes evictable if the cache alone holds it."""
        self.touch(path)
        last = path[-1]
        if not last.n_dev and self._ref_count(last.block) == 1:
            self._push(last)

    def released(self, node: Node, refresh: bool) -> None:
        """`node`, a device leaf, is now held by the prefix cache alone, so evictable; with
        `refresh` this release counts as its latest use."""
        if refresh:
            self.clock += 1
            node.last_used = self.clock
        self._push(node)

    def _push(self, node: Node) -> None:
        if len(self._heap) > 2 * len(self._by_block) + 64:
            self._rebuild()
        self._serial += 1
        heapq.heappush(self._heap, (node.last_used, self._serial, node))

    def _rebuild(self) -> None:
        """Drop stale entries: keep one per currently evictable leaf."""
        ref_count = self._ref_count
        entries = []
        for node in self._by_block.values():
            if not node.n_dev and ref_count(node.block) == 1:
                self._serial += 1
                entries.append((node.last_used, self._serial, node))
        heapq.heapify(entries)
        self._heap = entries

    def select(self, limit: int) -> Chosen:
        """Pop up to `limit` victims in eviction order, children before parents, without
        changing the tree."""
        heap, ref_count = self._heap, self._ref_count
        chosen: Chosen = []
        chosen_ids: set[int] = set()
        gone_children: dict[int, int] = {}
        while heap and len(chosen) < limit:
            stamp, _, node = heapq.heappop(heap)
            if (
                node.block is None
                or stamp != node.last_used
                or id(node) in chosen_ids
                or node.n_dev != gone_children.get(id(node), 0)
                or ref_count(node.block) != 1
            ):
                continue  # stale: used, grown, re-held or evicted since it was pushed
            chosen.append((stamp, node))
            chosen_ids.add(id(node))
            parent = node.parent
            if parent.block != -1:
                gone = gone_children[id(parent)] = gone_children.get(id(parent), 0) + 1
                if gone == parent.n_dev and ref_count(parent.block) == 1:
                    self._serial += 1
                    heapq.heappush(heap, (parent.last_used, self._serial, parent))
        return chosen

    def unselect(self, chosen: Chosen) -> None:
        """Put victims `select` returned back as candidates (an eviction that did not happen)."""
        for stamp, node in chosen:
            self._serial += 1
            heapq.heappush(self._heap, (stamp, self._serial, node))

    def count_evictable(self) -> int:
        """How many device blocks successive evictions could take now: cached blocks only
        the cache holds whose device descendants are all such blocks too (O(cached blocks))."""
        ref_count, kept = self._ref_count, set()
        for node in self._by_block.values():
            if ref_count(node.block) != 1 or self.kept(node):
                while node.block != -1 and id(node) not in kept:  # it and its ancestors stay
                    kept.add(id(node))
                    node = node.parent
        return len(self._by_block) - len(kept)

    def kept(self, node: Node) -> bool:
        """True when a retention rule keeps `node` from eviction (never, for plain LRU)."""
        return False

    def clear(self) -> None:
        """Forget every candidate (the tree was cleared)."""
        self._heap = []
