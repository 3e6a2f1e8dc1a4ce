"""The prefix cache's counters and the `PrefixCacheStats` snapshot of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since construction: match calls, tokens asked and found (`hit_tokens`, over
    both tiers), the hit rate (hit / queried tokens, 0.0 before any query), device blocks
    now cached, device blocks evicted (demoted or dropped); per tier: tokens found in device
    blocks and in host blocks, host blocks now cached, blocks demoted to the host tier,
    promoted back, and dropped from it; with a disk tier: tokens found on disk, blocks with a
    disk copy now, blocks given a disk copy (queued for writing), read back from disk, and
    disk copies dropped for room; and the disk tier's degradations: writes skipped (its
    queue full), writes failed (disk full, I/O error), reads dropped (a checksum mismatch
    or an I/O error), each of which only made a block "not cached"; and the device
    evictions by the priority the blocks had (`evictions_by_priority`, priority -> count;
    blocks with no hint count under 35)."""

    queries: int
    queried_tokens: int
    hit_tokens: int
    hit_rate: float
    cached_blocks: int
    evictions: int
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    host_cached_blocks: int = 0
    demotions: int = 0
    promotions: int = 0
    host_evictions: int = 0
    disk_hit_tokens: int = 0
    disk_cached_blocks: int = 0
    disk_demotions: int = 0
    disk_promotions: int = 0
    disk_evictions: int = 0
    disk_skipped_writes: int = 0
    disk_failed_writes: int = 0
    disk_failed_reads: int = 0
    evictions_by_priority: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HybridPrefixCacheStats:
    """A hybrid prefix cache's counters since construction (`HybridPrefixCache.stats()`).

    Per match (one number): `queries`, `queried_tokens`, `hit_tokens` (the match lengths,
    over every tier), `hit_rate` (hit / queried tokens, 0.0 before any query) and how the
    hit tokens split by the lowest tier a match needed: `device_hit_tokens` (device entries
    alone gave them), `host_hit_tokens` (host entries made or lengthened the hit: the longest
    hit of device and host entries minus that of device entries), `disk_hit_tokens` (the
    match minus the longest hit of device and host entries). They add up to `hit_tokens`.

    Per group (a tuple, one entry per group; entries are blocks, or a state group's
    checkpoint slots): entries cached now on the device (`cached_entries`), the host
    (`host_cached_entries`) and disk (`disk_cached_entries`); device entries evicted
    (`evictions`: demoted or dropped), demoted to the host (`demotions`), promoted from the
    host to the device (`promotions`), host entries leaving the host tier for room
    (`host_evictions`: written to disk or dropped), written to disk (`disk_demotions`:
    queued for writing), promoted from disk to the device through staged host blocks
    (`disk_promotions`, not counted in `promotions`), disk entries dropped for room
    (`disk_evictions`); and the disk tier's degradations, each of which only made an entry
    "not cached": writes skipped (`disk_skipped_writes`: its queue full), writes failed
    (`disk_failed_writes`), reads dropped (`disk_failed_reads`). All 0 for a tier the cache
    does not have."""

    queries: int
    queried_tokens: int
    hit_tokens: int
    hit_rate: float
    device_hit_tokens: int
    host_hit_tokens: int
    disk_hit_tokens: int
    cached_entries: tuple
    host_cached_entries: tuple
    disk_cached_entries: tuple
    evictions: tuple
    demotions: tuple
    promotions: tuple
    host_evictions: tuple
    disk_demotions: tuple
    disk_promotions: tuple
    disk_evictions: tuple
    disk_skipped_writes: tuple
    disk_failed_writes: tuple
    disk_failed_reads: tuple


class PrefixCounters:
    """What a prefix cache has done since it was made; the parts (eviction, tiering) add
    to the fields they own. They outlive a released host tier."""

    __slots__ = ("queries", "queried_tokens", "device_hits", "host_hits", "disk_hits", "evictions", "demotions",
                 "promotions", "host_drops", "disk_stores", "disk_loads", "disk_drops", "by_priority")

    def __init__(self):
        self.queries = self.queried_tokens = self.device_hits = self.host_hits = self.disk_hits = 0
        self.evictions = self.demotions = self.promotions = self.host_drops = 0
        self.disk_stores = self.disk_loads = self.disk_drops = 0
        self.by_priority: dict[int, int] = {}  # filled once a retention hint exists; else all at 35

    def count_priorities(self, priorities: Iterable[int]) -> None:
        """Device evictions at these priorities (one per block)."""
        by = self.by_priority
        for p in priorities:
            by[p] = by.get(p, 0) + 1

    def count_query(self, queried_tokens: int, device_hits: int, host_hits: int = 0, disk_hits: int = 0) -> None:
        """One lookup of `queried_tokens` tokens that found `device_hits` tokens in device
        blocks, `host_hits` more in host blocks and `disk_hits` more on disk."""
        self.queries += 1
        self.queried_tokens += queried_tokens
        self.device_hits += device_hits
        self.host_hits += host_hits
        self.disk_hits += disk_hits

    def snapshot(self, cached_blocks: int, host_cached_blocks: int, disk_cached_blocks: int = 0,
                 disk: object = None) -> PrefixCacheStats:
        """The counters as a PrefixCacheStats, with the current block counts and the disk
        tier's `DiskTierStats` (or None)."""
        hits = self.device_hits + self.host_hits + self.disk_hits
        return PrefixCacheStats(
            queries=self.queries,
            queried_tokens=self.queried_tokens,
            hit_tokens=hits,
            hit_rate=hits / self.queried_tokens if self.queried_tokens else 0.0,
            cached_blocks=cached_blocks,
            evictions=self.evictions,
            device_hit_tokens=self.device_hits,
            host_hit_tokens=self.host_hits,
            host_cached_blocks=host_cached_blocks,
            demotions=self.demotions,
            promotions=self.promotions,
            host_evictions=self.host_drops,
            disk_hit_tokens=self.disk_hits,
            disk_cached_blocks=disk_cached_blocks,
            disk_demotions=self.disk_stores,
            disk_promotions=self.disk_loads,
            disk_evictions=self.disk_drops,
            disk_skipped_writes=getattr(disk, "skipped_writes", 0),
            disk_failed_writes=getattr(disk, "failed_writes", 0),
            disk_failed_reads=getattr(disk, "failed_reads", 0),
            evictions_by_priority=self._by_priority(),
        )

    def _by_priority(self) -> dict[int, int]:
        """Evictions by priority: those counted while hints existed, the rest at 35."""
        by = dict(self.by_priority)
        rest = self.evictions - sum(by.values())
        if rest > 0:
            by[35] = by.get(35, 0) + rest
        return dict(sorted(by.items()))
