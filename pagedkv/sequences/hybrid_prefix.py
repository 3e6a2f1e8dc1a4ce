"""HybridPrefixCache: prefix caching over the groups of a `HybridKvCache`.

One trie per adapter (per `(adapter, cache_salt)` for a salted prompt: a namespace, no hit
across salts), keyed at the smallest attention block size (the hash unit `u`): a node at
depth k stands for the exact tokens `[0, k*u)` (int64 bytes per unit, so a hash collision
never hands one prompt another's KV; a unit that extra keys cover carries them after its
tokens, as `pagedkv.sequences.block_keys` keys a block; each node also carries the chained
64-bit hash of its key that events report). A node holds, per group, at most one cached entry ending at its position: an
attention group's block covering `[pos - block_size, pos)`, or a state group's checkpoint
slot holding the state as of `pos`. No group's block size is inflated to another's.

The match rule: the longest `p` (a multiple of the largest attention block size, at most
`limit`) such that every full group holds all its blocks of `[0, p)`, every sliding group
holds the blocks covering `[p - window, p)`, and every state group a checkpoint at `p`.

The cache holds one reference of its own on every entry (block or slot) and is the
`BlockReclaimer` of every group's allocator. Eviction (per group, when that group's free
list runs short) takes entries only the cache holds: first sliding blocks no hit can use
(no anchor within a window after them: a checkpoint of every state group, or without state
groups a chain end or a branch point), then least recently used, deepest first. Events
(`GroupBlockStored`, `GroupBlockRemoved`) carry the group index, the event's number (`seq`)
and what vLLM's KV events carry (`pagedkv.events` publishes them as vLLM's `BlockStored` /
`BlockRemoved` with `group_idx` and the group's kind).

Hash schemes as `PrefixCache`'s: under `hash_scheme="vllm-sha256-cbor"` an entry's
`block_hash` (events, `block_hash(group, entry)`) is vLLM v1's 32-byte digest of the chain at
the entry's group block size (a state group's: the unit), so an attention group's hashes are
those a one-group cache of its block size reports for the same tokens and keys. A block's
extra keys are those of its units in position order (each once), then the salt on a
prompt's first block: vLLM's placement when keys are given in position order.

Host tier (`PrefixCache(cache, host_tier=HybridHostTier(...))`, `hybrid_tiering`): an
evicted entry is demoted to its group's host tier instead of dropped; the match rule counts
a host-held entry as present (`HybridMatch.host_entries`, `host_num_tokens`), and
`SequenceTable.add` promotes the host entries of every group it reuses in one swap.

Disk tier (`PrefixCache(cache, host_tier=..., disk_tier=HybridDiskTier(directory, ...))`,
`hybrid_disk_tiering`): one `DiskTier` per group (as the host tier is one `HostTier` per
group), in subdirectories of one directory that records the grouping. Host entries the host
LRU drops are written to their group's disk tier (sliding blocks no hit can use are not);
the match rule counts a disk-held entry as present (`HybridMatch.disk_entries`,
`disk_num_tokens`); `SequenceTable.add` reads a match's disk entries into host blocks and
promotes them with its host entries in the same one swap; a directory of the same grouping
comes up warm. `stats()` reports hits per tier and the moves per group.

This module holds the class, its construction, its tier checks and `close`; the rest is
mixed in: the match path with `HybridMatch` (`hybrid_match`), the trie node and the store
path (`hybrid_store`), eviction and `clear` (`hybrid_eviction`), the events and their hashes
(`hybrid_events`) and the introspection with `check_invariants` (`hybrid_queries`).
"""

from __future__ import annotations

from typing import Callable

from ..cache.hybrid_cache import HybridKvCache
from ..core.guard import ThreadGuard, guarded
from ..core.streams import stream_handle
from ..errors import KvCacheError
from ..tiers.hybrid_host_tier import check_tier_of
from .events import EventQueue
from .hybrid_disk_tiering import HybridDiskTiering
from .hybrid_events import SPEC_KINDS, GroupBlockRemoved, GroupBlockStored, HybridEvents
from .hybrid_eviction import HybridEviction, _GroupReclaimer
from .hybrid_match import HybridMatch, HybridMatching
from .hybrid_queries import HybridQueries
from .hybrid_store import HybridStore, _Node
from .hybrid_tiering import HybridTiering
from .vllm_hash import DEFAULT_SCHEME, SCHEMES, VllmHashes, resolve_seed
from .vllm_hash import SCHEME as VLLM_SCHEME

__all__ = ["SPEC_KINDS", "GroupBlockRemoved", "GroupBlockStored", "HybridMatch", "HybridPrefixCache"]


class HybridPrefixCache(HybridMatching, HybridStore, HybridEviction, HybridEvents, HybridQueries):
    """A prefix cache over one `HybridKvCache` (see the module docstring). `PrefixCache(cache)`
    builds one for a hybrid cache (`host_tier`: a `HybridHostTier` of the cache; `disk_tier`:
    a `HybridDiskTier` below it)."""

    def __init__(self, cache: HybridKvCache, on_event: Callable | None = None, hash_scheme: str = DEFAULT_SCHEME,
                 hash_seed: str | None = None, host_tier=None, swap_stream: object = 0, disk_tier=None):
        """`hash_scheme` and `hash_seed` as `PrefixCache`'s (see the module docstring).
        `host_tier`: a `HybridHostTier` of `cache` to demote evicted entries into;
        `swap_stream`: the stream demotions are enqueued on. `disk_tier`: a `HybridDiskTier`
        below the host tier, bound here (the last check: a directory of another grouping or
        layout is refused, `DiskLayoutMismatch` naming the fields, nothing changed); one of
        the same grouping comes up warm."""
        if not isinstance(cache, HybridKvCache):
            raise TypeError(f"cache must be a HybridKvCache, got {type(cache).__name__}")
        if disk_tier is not None:
            from ..tiers.hybrid_disk_tier import HybridDiskTier

            if not isinstance(disk_tier, HybridDiskTier):
                raise TypeError(f"disk_tier of a cache with layer_groups must be a HybridDiskTier, "
                                f"got {type(disk_tier).__name__}")
            if host_tier is None:
                raise ValueError("a disk tier sits below a host tier: give host_tier=HybridHostTier(...) too")
        if host_tier is not None:
            check_tier_of(host_tier, cache)
            stream_handle(swap_stream)
            check = getattr(host_tier.group(0).gpu(), "check_stream", None)
            if check is not None:
                check(swap_stream)
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable, got {on_event!r}")
        if hash_scheme not in SCHEMES:
            raise ValueError(f"hash_scheme must be one of {', '.join(SCHEMES)}, got {hash_scheme!r}")
        self._vroot = VllmHashes(resolve_seed(hash_seed), 1).root if hash_scheme == VLLM_SCHEME else None
        self._hash_scheme = hash_scheme
        layout = cache.layout()
        self._cache = cache
        self._layout = layout
        self._groups = layout.groups
        attention = layout.attention_groups()
        self._unit = min(layout.block_size(g) for g in attention)  # the hash unit
        self._match_unit = layout.unit
        self._ratio = {g: layout.block_size(g) // self._unit for g in attention}
        self._states = layout.state_groups()
        spans = [layout.block_size(g) if group.is_attention() else self._unit for g, group in enumerate(self._groups)]
        self._guard = ThreadGuard("this PrefixCache")
        self._events = EventQueue(on_event, self._guard)
        self._roots: dict[int, _Node] = {}
        self._where: list[dict[int, _Node]] = [{} for _ in self._groups]
        self._last: list[dict[int, int]] = [{} for _ in self._groups]
        self._tick = 0
        self._closed = False
        self._reclaimers = [_GroupReclaimer(self, g) for g in range(len(self._groups))]
        attached = []
        try:
            for g, rec in enumerate(self._reclaimers):
                self._allocator(g).attach_reclaimer(rec)
                attached.append(g)
        except BaseException:
            for g in attached:
                self._allocator(g).detach_reclaimer(self._reclaimers[g])
            raise
        # every group's calls that change it enter this cache's guard while it is attached, so
        # a second thread's call raises ConcurrentUseError (as PagedKvCache's do under PrefixCache)
        cache._take_guard(self._guard, self._events.pending, self.deliver_events)
        self.hits = self.queries = self.hit_tokens = self.query_tokens = 0
        self.host_hits = self.host_hit_tokens = self.disk_hits = self.disk_hit_tokens = 0
        self._evictions = [0] * len(self._groups)
        self._tiering: HybridTiering | None = None
        self._disk: HybridDiskTiering | None = None
        owned = []
        try:
            if host_tier is not None:
                self._tiering = HybridTiering(self, host_tier, swap_stream)
                for g in range(len(self._groups)):  # its cached host ids are freed from within this cache only
                    host_tier.group(g).attach_owner(self._guard)
                    owned.append(g)
            # the last check: another grouping or layout refused, nothing read then
            records = disk_tier.bind(host_tier, spans) if disk_tier is not None else None
        except BaseException:
            for g in owned:
                host_tier.group(g).detach_owner(self._guard)
            cache._drop_guard()
            for g, rec in enumerate(self._reclaimers):
                self._allocator(g).detach_reclaimer(rec)
            raise
        if disk_tier is not None:
            self._disk = self._tiering.disk = HybridDiskTiering(self, disk_tier, self._tiering)
            self._disk.restore(records, spans)
        self._counted = (self._tiering, self._disk)  # their counters outlive a released or closed tier

    def _allocator(self, g: int):
        return self._cache.group(g).allocator()

    def _span(self, g: int) -> int:
        """Tokens an entry of group g ends: an attention block, or a state group's last unit."""
        return self._layout.block_size(g) if self._groups[g].is_attention() else self._unit

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise KvCacheError(f"{what} on a closed prefix cache")

    def closed(self) -> bool:
        """True after `close()`."""
        return self._closed

    def _check_tier(self) -> None:
        """A released host tier: forget its entries (and the disk tier's below it), go on
        device-only (as `PrefixCache` does); a closed disk tier: forget its entries, go on
        with two tiers. Takes the disk tier's finished writes (a failed one drops its entry)."""
        if self._disk is not None:
            if not self._disk.live() or (self._tiering is not None and not self._tiering.live()):
                self._disk.forget_all()
                self._tiering.disk = self._disk = None
            else:
                self._disk.poll()
        if self._tiering is not None and not self._tiering.live():
            self._tiering.forget_released()
            for g in range(len(self._groups)):
                self._tiering.tier.group(g).detach_owner(self._guard)
            self._tiering = None

    @guarded
    def close(self) -> None:
        """Give back every reference and detach from every group (idempotent)."""
        if self._closed:
            return
        for g in range(len(self._groups)):
            for entry in list(self._where[g]):
                self._drop(g, entry)
        if self._disk is not None:
            self._disk.forget_all()  # the directory keeps them for a later process
            self._tiering.disk = self._disk = None
        if self._tiering is not None:
            self._tiering.forget_all() if self._tiering.live() else self._tiering.forget_released()
            for g in range(len(self._groups)):
                self._tiering.tier.group(g).detach_owner(self._guard)
        self._closed = True
        for g, rec in enumerate(self._reclaimers):
            self._allocator(g).detach_reclaimer(rec)
        self._cache._drop_guard()
