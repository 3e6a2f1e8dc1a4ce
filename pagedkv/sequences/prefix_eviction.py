"""The giving-back side of `PrefixCache`: the allocator's calls when a block's last other
holder releases it (`on_sole_reference(s)`) or when its free list is short (`reclaim`),
`evict`, `clear` and `close`: chosen leaves are demoted into the host tier or returned to
the free list, with their `BlockRemoved` / `AllBlocksCleared` events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.guard import guarded
from ..core.log import debug_enabled, get_logger
from ..core.validate import non_negative_int
from .events import AllBlocksCleared, BlockRemoved
from .retention import priority_of

if TYPE_CHECKING:
    from .eviction import Chosen

_log = get_logger("prefix_cache")


class PrefixEviction:
    """Mixed into `PrefixCache` (it sets `_by_block`, `_policy`, `_refresh_on_release`,
    `_counters`, `_events`, `_cache`, `_tree`, `_tiering`, `_guard`, `_closed`, `_check_tier`,
    `_deliver`)."""

    def on_sole_reference(self, block: int) -> None:
        """Called by the cache when `block`'s count falls to 1: if it is a cached leaf, it is
        now evictable and this release counts as its latest use."""
        node = self._by_block.get(block)
        if node is not None and not node.n_dev:
            self._policy.released(node, self._refresh_on_release)

    def on_sole_references(self, blocks: list[int]) -> None:
        """`on_sole_reference` of each of `blocks` in order, in one call."""
        get, released, refresh = self._by_block.get, self._policy.released, self._refresh_on_release
        for block in blocks:
            node = get(block)
            if node is not None and not node.n_dev:
                released(node, refresh)

    def _evict_chosen(self, chosen: Chosen) -> list[int]:
        tiering = self._check_tier()
        priorities = [priority_of(node) for _, node in chosen] if self._policy.hints else ()
        if tiering is not None and chosen:
            blocks = tiering.demote(chosen)
            self._counters.evictions += len(blocks)
            self._counters.count_priorities(priorities)
            return blocks
        blocks = [node.block for _, node in chosen]
        hashes = self._events.hashes([node for _, node in chosen]) if self._events.consumer is not None else None
        for block in blocks:
            self._cache.return_evicted_block(block)  # while still cached: the cache's own reference
        remove = self._tree.remove_leaf
        for _, node in chosen:
            remove(node)
        self._counters.evictions += len(blocks)
        self._counters.count_priorities(priorities)
        if blocks:
            if debug_enabled():
                _log.debug("prefix_cache_evicted", blocks=len(blocks))
            if hashes is not None:
                self._events.emit(BlockRemoved(block_hashes=tuple(hashes), block_ids=tuple(blocks)))
        return blocks

    @guarded
    def evict(self, n: int) -> list[int]:
        """Evict up to `n` least-recently-used leaves whose block only the cache holds,
        children before parents (demoted into the host tier when there is one); returns the
        device blocks, now on the free list. A block a sequence still holds is never evicted."""
        return self._evict_chosen(self._policy.select(non_negative_int(n, "number of blocks to evict")))

    def reclaim(self, n: int) -> bool:
        """Evict exactly `n` blocks if that many are evictable, else nothing; True on
        success. The cache calls this when its free list is short, and `deliver_events()`
        once the allocation is complete."""
        guard = self._guard
        guard.enter()
        try:
            chosen = self._policy.select(n)
            if len(chosen) < n:
                self._policy.unselect(chosen)
                return False
            self._evict_chosen(chosen)
            return True
        finally:
            guard.exit()

    @guarded
    def clear(self) -> None:
        """Forget every cached block, handing back the cache's references (blocks that
        sequences still hold stay with them). A disk tier's directory forgets its blocks too."""
        self._clear_checked()

    def _clear_checked(self, wipe_disk: bool = True) -> None:
        blocks = list(self._by_block)
        for block in blocks:
            self._cache.return_evicted_block(block)  # while still cached: the cache's own reference
        hosts = 0 if self._tiering is None else self._tiering.clear(wipe_disk)
        self._tree.clear()
        self._policy.clear()
        _log.info("prefix_cache_cleared", blocks=len(blocks), host_blocks=hosts)
        if self._events.consumer is not None:
            self._events.emit(AllBlocksCleared())

    @guarded
    def close(self) -> None:
        """`clear()` and detach from the cache, which then allocates without evicting.
        Afterwards the prefix cache takes nothing: `insert` raises, `match` finds nothing,
        and a SequenceTable on it offers nothing. A second call does nothing. A disk tier's
        directory keeps its blocks (for the next process); close the DiskTier after this."""
        if not self._closed:
            self._closed = True
            try:
                self._clear_checked(wipe_disk=False)
            finally:
                if self._tiering is not None:
                    self._tiering.tier.detach_owner(self._guard)
                self._cache.detach_prefix_cache(self)
