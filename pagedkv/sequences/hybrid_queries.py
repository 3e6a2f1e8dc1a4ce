"""The introspection side of `HybridPrefixCache`: its cache and tiers, statistics and tier
counts, what each group has cached on each tier, the cache's references, and
`check_invariants` (every entry on the node that lists it, every node reachable, empty chain
ends pruned).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import KvCacheError
from .stats import HybridPrefixCacheStats

if TYPE_CHECKING:
    from ..cache.hybrid_cache import HybridKvCache
    from .hybrid_store import _Node


class HybridQueries:
    """Mixed into `HybridPrefixCache` (it sets `_cache`, `_layout`, `_groups`, `_unit`,
    `_where`, `_roots`, `_tiering`, `_disk`, `_counted`, `_evictions`, the match counters,
    `_allocator`)."""

    def cache(self) -> HybridKvCache:
        """The hybrid cache this prefix cache serves."""
        return self._cache

    def host_tier(self):
        """The `HybridHostTier` evicted entries are demoted to (None without one)."""
        return self._tiering.tier if self._tiering is not None else None

    def num_host_entries(self, group: int) -> int:
        """Entries of `group` held on the host tier (0 without one)."""
        g = self._layout.check_group(group)
        return len(self._tiering.by_host[g]) if self._tiering is not None else 0

    def disk_tier(self):
        """The `HybridDiskTier` below the host tier (None without one, or once it was closed:
        the next call forgets its entries; the directory keeps them)."""
        return self._disk.disk if self._disk is not None else None

    def num_disk_entries(self, group: int) -> int:
        """Entries of `group` held on the disk tier (0 without one)."""
        g = self._layout.check_group(group)
        return self._disk.num_entries(g) if self._disk is not None else 0

    def stats(self) -> HybridPrefixCacheStats:
        """Counters since construction and entries now, per tier (see `HybridPrefixCacheStats`)."""
        n = len(self._groups)
        t, d = self._counted
        zeros = (0,) * n
        disk_stats = d.disk.stats() if d is not None else []
        now_t, now_d = self._tiering, self._disk
        hits = self.hit_tokens
        return HybridPrefixCacheStats(
            queries=self.queries, queried_tokens=self.query_tokens, hit_tokens=hits,
            hit_rate=hits / self.query_tokens if self.query_tokens else 0.0,
            device_hit_tokens=hits - self.host_hit_tokens - self.disk_hit_tokens,
            host_hit_tokens=self.host_hit_tokens, disk_hit_tokens=self.disk_hit_tokens,
            cached_entries=tuple(len(w) for w in self._where),
            host_cached_entries=tuple(len(b) for b in now_t.by_host) if now_t is not None else zeros,
            disk_cached_entries=tuple(len(b) for b in now_d.by_slot) if now_d is not None else zeros,
            evictions=tuple(self._evictions),
            demotions=tuple(t.demotions) if t is not None else zeros,
            promotions=tuple(t.promotions) if t is not None else zeros,
            host_evictions=tuple(t.host_drops) if t is not None else zeros,
            disk_demotions=tuple(d.stores) if d is not None else zeros,
            disk_promotions=tuple(d.loads) if d is not None else zeros,
            disk_evictions=tuple(d.drops) if d is not None else zeros,
            disk_skipped_writes=tuple(x.skipped_writes for x in disk_stats) or zeros,
            disk_failed_writes=tuple(x.failed_writes for x in disk_stats) or zeros,
            disk_failed_reads=tuple(x.failed_reads for x in disk_stats) or zeros,
        )

    def tier_counts(self) -> dict[str, int]:
        """Moves between the tiers since construction: `demotions`, `promotions` and
        `host_drops` (entries), `host_hits` (matches a host entry made or lengthened) and
        `host_hit_tokens` (their `host_num_tokens`)."""
        t = self._tiering
        moves = (sum(t.demotions), sum(t.promotions), sum(t.host_drops)) if t is not None else (0, 0, 0)
        return dict(zip(("demotions", "promotions", "host_drops"), moves), host_hits=self.host_hits,
                    host_hit_tokens=self.host_hit_tokens)

    def unit(self) -> int:
        """Tokens per trie node (the smallest attention block size)."""
        return self._unit

    def num_cached(self, group: int) -> int:
        """Entries `group` has cached."""
        return len(self._where[self._layout.check_group(group)])

    def is_cached(self, group: int, entry: int) -> bool:
        """True when block (or slot) `entry` of `group` is cached."""
        return entry in self._where[self._layout.check_group(group)]

    def entries(self) -> list[tuple[int, tuple[int, ...], int, int]]:
        """Every cached entry on the device as `(adapter_id, tokens of [0, position), group,
        id)`: for tests and brute-force references (O(entries * depth))."""
        return self._listed(self._where)

    def host_entries(self) -> list[tuple[int, tuple[int, ...], int, int]]:
        """Every entry held on the host tier, as `entries` lists them (with host ids)."""
        return self._listed(self._tiering.by_host if self._tiering is not None else [])

    def disk_entries(self) -> list[tuple[int, tuple[int, ...], int, int]]:
        """Every entry held on the disk tier, as `entries` lists them (with disk slots)."""
        return self._listed(self._disk.by_slot if self._disk is not None else [])

    def _listed(self, index) -> list[tuple[int, tuple[int, ...], int, int]]:
        out = []
        for g, where in enumerate(index):
            for entry, node in where.items():
                keys, n = [], node
                while n.parent is not None:
                    keys.append(n.key)
                    n = n.parent
                data = b"".join(k[:8 * self._unit] for k in reversed(keys))
                tokens = tuple(int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8))
                out.append((node.adapter_id, tokens, g, entry))
        return out

    def block_references(self, group: int) -> dict[int, int]:
        """entry -> 1 for every entry of `group` the cache holds."""
        return dict.fromkeys(self._where[self._layout.check_group(group)], 1)

    def check_invariants(self) -> None:
        """Every entry is on one node that lists it, and holds a count >= 1; every node an
        entry of any tier is on is reachable from one of the cache's roots (each parent lists
        it as its child); every node below a root holds an entry of some tier or a child
        (empty chain ends are pruned)."""
        roots = {id(root) for root in self._roots.values()}
        for g, where in enumerate(self._where):
            alloc = self._allocator(g)
            for entry, node in where.items():
                if node.entries.get(g) != entry:
                    raise KvCacheError(f"group {g} entry {entry} is not on its node")
                if alloc.ref_count(entry) < 1:
                    raise KvCacheError(f"group {g} cached entry {entry} has count 0")
        tiers = [("device", self._where)]
        if self._tiering is not None:
            tiers.append(("host", self._tiering.by_host))
        if self._disk is not None:
            tiers.append(("disk", self._disk.by_slot))
        for medium, index in tiers:
            for g, where in enumerate(index):
                for entry, node in where.items():
                    if not self._reachable(node, roots):
                        raise KvCacheError(f"group {g} {medium} entry {entry} is on a node no root reaches "
                                           f"(depth {node.depth})")
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None and not (node.entries or node.lower or node.disk or node.children):
                raise KvCacheError(f"a trie node at depth {node.depth} holds no entry and no child (not pruned)")
            stack.extend(node.children.values())
        if self._tiering is not None:
            self._tiering.check()
        if self._disk is not None:
            self._disk.poll()
            self._disk.check()

    @staticmethod
    def _reachable(node: _Node, roots: set) -> bool:
        """True when walking up from `node` every parent lists the node below as its child and
        the walk ends at a root whose id is in `roots`."""
        while node.parent is not None:
            if node.parent.children.get(node.key) is not node:
                return False
            node = node.parent
        return id(node) in roots
