"""Eviction in `HybridPrefixCache`: each group's `BlockReclaimer` (`_GroupReclaimer`), the
entries' recency, the choice of victims when a group's free list runs short (sliding blocks
no hit can use first, then least recently used, deepest first), their demotion or drop,
`evict` and `clear`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.guard import guarded
from .hybrid_events import GroupBlockRemoved

if TYPE_CHECKING:
    from .hybrid_store import _Node


class _GroupReclaimer:
    """The `BlockReclaimer` of one group's allocator: the prefix cache, for group `g`."""

    def __init__(self, owner: "HybridPrefixCache", g: int):
        self._owner, self._g = owner, g

    def reclaim(self, n: int) -> bool:
        return self._owner._reclaim(self._g, n)

    def on_sole_reference(self, block: int) -> None:
        self._owner._touch(self._g, block)

    def is_cached(self, block: int) -> bool:
        return block in self._owner._where[self._g]

    def deliver_events(self) -> None:
        self._owner.deliver_events()

    def close(self) -> None:
        self._owner.close()



class HybridEviction:
    """Mixed into `HybridPrefixCache` (it sets `_where`, `_last`, `_tick`, `_groups`, `_states`,
    `_unit`, `_evictions`, `_tiering`, `_disk`, `_events`, `_allocator`, `_prune`,
    `_hash_at`, `_emit`, `_check_open`, `_check_tier`, `deliver_events`)."""

    def _touch(self, g: int, entry: int) -> None:
        if entry in self._where[g]:
            self._tick += 1
            self._last[g][entry] = self._tick

    def _anchor(self, node: _Node) -> bool:
        """A position a hit may end at: with state groups, one with a checkpoint of each; without,
        a chain end (a leaf) or a branch point (where chains part, as after a shared system
        prompt); a chain another has since extended is no longer an end."""
        if self._states:
            return all(s in node.entries or s in node.lower or s in node.disk for s in self._states)
        return len(node.children) != 1

    def _useful(self, g: int, node: _Node) -> bool:
        """A sliding block some hit may still use: an anchor within a window after its end."""
        u = self._unit
        reach = node.depth * u + self._groups[g].window  # a hit at q needs the blocks of [q - window, q)
        stack = [node]
        while stack:
            n = stack.pop()
            if n.depth * u < reach:
                if self._anchor(n):
                    return True
                stack.extend(n.children.values())
        return False

    def _reclaim(self, g: int, n: int) -> bool:
        self._check_tier()
        alloc = self._allocator(g)
        where, last = self._where[g], self._last[g]
        candidates = [e for e in where if alloc.ref_count(e) == 1]
        if len(candidates) < n:
            return False
        sliding = self._groups[g].kind == "sliding"
        useful = {e: sliding and self._useful(g, where[e]) for e in candidates} if sliding else {}
        candidates.sort(key=lambda e: (useful.get(e, False), last[e], -where[e].depth))
        victims = candidates[:n]
        self._evictions[g] += len(victims)
        if self._tiering is not None:
            self._tiering.demote(g, victims, {e for e in victims if sliding and not useful[e]})
            return True
        for entry in victims:
            self._drop(g, entry)
        return True

    def _drop(self, g: int, entry: int) -> None:
        self._allocator(g).return_evicted_block(entry)  # while still listed: the allocator asks is_cached
        node = self._where[g].pop(entry)
        del self._last[g][entry]
        del node.entries[g]
        if self._events.consumer is not None:
            self._emit(GroupBlockRemoved(g, entry, self._hash_at(g, node)))
        self._prune(node)

    @guarded
    def evict(self, group: int, n: int) -> int:
        """Evict up to `n` entries of `group` that only the cache holds (demoted to the host
        tier when there is one); returns how many."""
        self._check_open("evict")
        alloc = self._allocator(group)
        count = min(n, sum(1 for e in self._where[group] if alloc.ref_count(e) == 1))
        if count:
            self._reclaim(group, count)
        self.deliver_events()
        return count

    @guarded
    def clear(self) -> None:
        """Drop every entry only the cache holds... and every other: the cache's own
        references go back (entries a sequence still holds stay with it)."""
        for g in range(len(self._groups)):
            for entry in list(self._where[g]):
                self._drop(g, entry)
        self._check_tier()
        if self._tiering is not None:
            self._tiering.forget_all()
        if self._disk is not None:
            self._disk.forget_all(wipe=True)  # the directory forgets them too
        self.deliver_events()
