"""Retention hints for the prefix cache: a priority per cached block (0-100, 35 by default;
lower evicts first, least recently used first within a priority), a time to live after
which the hint is dropped (read from an injectable clock), and pins (a pinned block is never
evicted from the device nor dropped from the host tier: allocation raises
`KvCacheExhausted` rather than take it).

`RetentionEviction` is the prefix cache's eviction policy (`eviction.LruEviction`'s methods,
ordered by priority first); with no hint it orders exactly as plain LRU. A node's hint lives
on the node (`Node.retain`: a `Retention`, or None), so it goes where the node goes (host
tier included) and leaves with it. `RetentionApi` is the prefix cache's public side:
`set_retention`, `pin`, `unpin`.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence

from ..core.guard import guarded
from ..core.validate import int64_bytes_of_ids, non_negative_int, token_ids
from ..errors import KvCacheError
from .block_keys import block_keys
from .eviction import Chosen, LruEviction
from .tree import Node, RadixTree, adapter_id_checked

DEFAULT_PRIORITY = 35
"""The priority of a block with no hint."""

MAX_PRIORITY = 100


class Retention:
    """A node's hint: `priority` (None: the default) until `expires` (a clock reading, or
    None for no limit), and how many pins hold it."""

    __slots__ = ("priority", "expires", "pins")

    def __init__(self) -> None:
        self.priority: int | None = None
        self.expires: float | None = None
        self.pins = 0


def priority_of(node: Node) -> int:
    """The node's priority now (expired hints are dropped by `RetentionEviction.expire`)."""
    r = node.retain
    return DEFAULT_PRIORITY if r is None or r.priority is None else r.priority


def is_pinned(node: Node) -> bool:
    """True while a pin holds `node`."""
    r = node.retain
    return r is not None and r.pins > 0


class RetentionEviction(LruEviction):
    """`LruEviction` ordered by (priority, recency): candidates are heap entries
    `(priority, last_used, serial, node)`, stale when the node's use or priority changed
    since (a change pushes a fresh entry); pinned nodes are skipped and pushed again when
    unpinned. `clock()` (seconds, monotonic) times the hints' TTLs."""

    def __init__(self, tree: RadixTree, ref_count: Callable[[int], int], clock: Callable[[], float]):
        super().__init__(tree, ref_count)
        self.now = clock
        self._expiry: list[tuple[float, int, Node]] = []
        self.hints = 0  # nodes that ever got a hint (0: the plain LRU order, no expiry to check)

    # -- hints ------------------------------------------------------------------------

    def set_priority(self, node: Node, priority: int, expires: float | None) -> None:
        """Give `node` `priority` until `expires` (None: no limit)."""
        r = node.retain
        if r is None:
            r = node.retain = Retention()
            self.hints += 1
        r.priority, r.expires = priority, expires
        if expires is not None:
            self._serial += 1
            heapq.heappush(self._expiry, (expires, self._serial, node))
        self.repush(node)

    def pin(self, node: Node) -> None:
        """One more pin on `node`."""
        r = node.retain
        if r is None:
            r = node.retain = Retention()
            self.hints += 1
        r.pins += 1

    def unpin(self, node: Node) -> None:
        """One pin fewer on `node` (the caller checked it has one); evictable again at 0."""
        node.retain.pins -= 1
        if not node.retain.pins:
            self.repush(node)

    def repush(self, node: Node) -> None:
        """A fresh candidate entry for `node` when it is an evictable device leaf now."""
        if node.block is not None and node.block != -1 and not node.n_dev and self._ref_count(node.block) == 1:
            self._push(node)

    def expire(self) -> None:
        """Drop the hints whose time ran out (their nodes back at the default priority)."""
        expiry = self._expiry
        if not expiry:
            return
        now = self.now()
        while expiry and expiry[0][0] <= now:
            expires, _, node = heapq.heappop(expiry)
            r = node.retain
            if r is not None and r.expires == expires:
                r.priority = r.expires = None
                self.repush(node)

    def kept(self, node: Node) -> bool:
        """True when a pin keeps `node` (and so its ancestors) from eviction."""
        return node.retain is not None and node.retain.pins > 0

    def count_evictable(self) -> int:
        self.expire()
        return super().count_evictable()

    # -- the heap, with priorities --------------------------------------------------------

    def _push(self, node: Node) -> None:
        if len(self._heap) > 2 * len(self._by_block) + 64:
            self._rebuild()
        self._serial += 1
        r = node.retain  # priority_of, inline: every release of a cached block pushes
        priority = DEFAULT_PRIORITY if r is None or r.priority is None else r.priority
        heapq.heappush(self._heap, (priority, node.last_used, self._serial, node))

    def _rebuild(self) -> None:
        ref_count = self._ref_count
        entries = []
        for node in self._by_block.values():
            if not node.n_dev and ref_count(node.block) == 1:
                self._serial += 1
                entries.append((priority_of(node), node.last_used, self._serial, node))
        heapq.heapify(entries)
        self._heap = entries

    def select(self, limit: int) -> Chosen:
        """Pop up to `limit` victims, lowest priority then least recently used first,
        children before parents, pinned nodes skipped; the tree is not changed."""
        if self.hints:
            self.expire()
        heap, ref_count = self._heap, self._ref_count
        chosen: Chosen = []
        chosen_ids: set[int] = set()
        gone_children: dict[int, int] = {}
        while heap and len(chosen) < limit:
            priority, stamp, _, node = heapq.heappop(heap)
            if (
                node.block is None
                or stamp != node.last_used
                or id(node) in chosen_ids
                or node.n_dev != gone_children.get(id(node), 0)
                or ref_count(node.block) != 1
            ):
                continue  # stale: used, grown, re-held or evicted since it was pushed
            r = node.retain
            if r is not None and (r.pins or priority != priority_of(node)):
                continue  # pinned (pushed again when unpinned) or re-prioritised (a fresh entry exists)
            chosen.append((stamp, node))
            chosen_ids.add(id(node))
            parent = node.parent
            if parent.block != -1:
                gone = gone_children[id(parent)] = gone_children.get(id(parent), 0) + 1
                if gone == parent.n_dev and ref_count(parent.block) == 1:
                    self._serial += 1
                    heapq.heappush(heap, (priority_of(parent), parent.last_used, self._serial, parent))
        return chosen

    def unselect(self, chosen: Chosen) -> None:
        for stamp, node in chosen:
            self._serial += 1
            heapq.heappush(self._heap, (priority_of(node), stamp, self._serial, node))

    def clear(self) -> None:
        super().clear()
        self._expiry = []


class RetentionApi:
    """The retention side of `PrefixCache` (it sets `_tree`, `_policy`, `_block_size`,
    `_guard`, `_counters`), guarded like its other calls."""

    def _chain(self, tokens: Sequence[int], start: object, adapter_id: object, cache_salt: object,
               extra_keys: object) -> list[Node]:
        """The cached nodes (any tier) of the whole blocks of `tokens` that overlap
        positions `[start, len(tokens))`, checked."""
        tokens = token_ids(tokens, "tokens")
        start = non_negative_int(start, "start")
        adapter_id = adapter_id_checked(adapter_id)
        keys = block_keys(adapter_id, cache_salt, extra_keys, self._block_size)
        data = int64_bytes_of_ids(tokens)
        path = self._tree.walk_bytes(data, adapter_id if keys is None else keys.root_key, keys)
        return path[start // self._block_size :]

    @guarded
    def set_retention(self, tokens: Sequence[int], priority: int = DEFAULT_PRIORITY, ttl_s: float | None = None,
                      start: int = 0, adapter_id: int = 0, cache_salt: str | bytes | None = None,
                      extra_keys=None) -> int:
        """Give the cached blocks of `tokens` (whole blocks overlapping positions `[start,
        len(tokens))`, on the device or in the host tier) `priority` (an int 0-100; lower
        evicts first; 35 is the default) for `ttl_s` seconds of the cache's clock (None:
        until changed; when it runs out the blocks are back at 35). Keys as for `match`.
        Returns how many blocks took the hint (blocks not cached yet take none: call it
        after `cache_prefix`). ValueError naming a bad priority or TTL, nothing changed."""
        if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be an int in [0, {MAX_PRIORITY}], got {priority!r}")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                                  or not math.isfinite(ttl_s) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a finite number of seconds > 0 or None, got {ttl_s!r}")
        nodes = self._chain(tokens, start, adapter_id, cache_salt, extra_keys)
        policy = self._policy
        expires = None if ttl_s is None else policy.now() + ttl_s
        for node in nodes:
            policy.set_priority(node, priority, expires)
        return len(nodes)

    @guarded
    def pin(self, tokens: Sequence[int], start: int = 0, adapter_id: int = 0, cache_salt: str | bytes | None = None,
            extra_keys=None) -> int:
        """Pin the cached blocks of `tokens` (as `set_retention` picks them): never evicted
        from the device or dropped from the host tier until unpinned; allocation raises
        `KvCacheExhausted` rather than evict them. Pins count: each `pin` needs its
        `unpin`. Returns how many blocks were pinned."""
        nodes = self._chain(tokens, start, adapter_id, cache_salt, extra_keys)
        for node in nodes:
            self._policy.pin(node)
        return len(nodes)

    @guarded
    def unpin(self, tokens: Sequence[int], start: int = 0, adapter_id: int = 0, cache_salt: str | bytes | None = None,
              extra_keys=None) -> int:
        """Take back one pin from each block `pin` took with the same arguments; returns
        how many. KvCacheError naming the block when one of them holds no pin (nothing
        changed)."""
        nodes = self._chain(tokens, start, adapter_id, cache_salt, extra_keys)
        for i, node in enumerate(nodes):
            if not is_pinned(node):
                raise KvCacheError(f"unpin of block {start // self._block_size + i} of the prompt, which no pin holds")
        for node in nodes:
            self._policy.unpin(node)
        return len(nodes)
