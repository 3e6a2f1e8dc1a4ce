"""The introspection side of `PrefixCache`: statistics, what is cached and how many, block
hashes, the cache's references, and `check_invariants` (the tree, the block index and the
counts agree).
"""

from __future__ import annotations

from ..errors import KvCacheError
from .stats import PrefixCacheStats
from .tree import Node


class PrefixQueries:
    """Mixed into `PrefixCache` (it sets `_by_block`, `_cached_view`, `_policy`, `_counters`,
    `_digest`, `_hash_scheme`, `_tree`, `_cache`, `_disk`, `_check_tier`, `num_host_blocks`,
    `num_disk_blocks`)."""

    def stats(self) -> PrefixCacheStats:
        """Counters since construction (see PrefixCacheStats)."""
        disk = None if self._disk is None else self._disk.disk.stats()
        return self._counters.snapshot(len(self._by_block), self.num_host_blocks(), self.num_disk_blocks(), disk)

    def num_cached_blocks(self) -> int:
        """How many blocks the cache holds."""
        return len(self._by_block)

    def num_evictable_blocks(self) -> int:
        """How many cached device blocks allocation could evict now (held by the cache
        alone, with no held or kept descendant on the device); `PagedKvCache.
        num_available_blocks()` adds them to the free list. O(cached blocks)."""
        return self._policy.count_evictable()

    def is_cached(self, block: int) -> bool:
        """True when `block` is in the cache."""
        return block in self._by_block

    @property
    def cached_index(self):
        """The blocks the cache holds, as a read-only view (`block in index`), the same
        object for the cache's life: what the allocator's free paths test instead of
        calling `is_cached` per block."""
        return self._cached_view

    def block_hash(self, block: int) -> int | bytes:
        """The chained content hash of a cached block (an int under the default scheme, the
        32-byte digest under "vllm-sha256-cbor"); KeyError when it is not cached."""
        node = self._by_block.get(block)
        if node is None:
            raise KeyError(f"block {block} is not in the prefix cache")
        return node.hash if self._digest is None else self._digest(node)

    def hash_scheme(self) -> str:
        """The scheme of `block_hash` and the events' hashes."""
        return self._hash_scheme

    def block_references(self) -> dict[int, int]:
        """block -> references the prefix cache holds (1 per cached block)."""
        return dict.fromkeys(self._by_block, 1)

    def check_invariants(self) -> None:
        """Raise KvCacheError if the tree, the block index and the counts disagree: every
        node has `block_size` tokens under its own key and a correct chained hash, no block
        is cached twice, every cached block holds count >= 1 (O(cached blocks))."""
        tiering = self._check_tier()
        check_lower = tiering.checker() if tiering is not None else _no_lower_tier
        seen = self._tree.check(self._cache.ref_count, check_lower)
        hosts = self.num_host_blocks()
        disk_only = 0 if self._disk is None else self._disk.num_disk_only()
        if seen != len(self._by_block) + hosts + disk_only:
            raise KvCacheError(f"{len(self._by_block)} device, {hosts} host and {disk_only} disk-only blocks indexed "
                               f"but {seen} in the tree")
        if tiering is not None:
            tiering.check_counts()



def _no_lower_tier(node: Node) -> None:
    raise KvCacheError(f"a node with neither a device nor an indexed host block (host {node.lower})")
