"""The hybrid prefix cache over a `HybridHostTier`: demotion of evicted entries, promotion back.

When group g evicts cached entries (its blocks, or a state group's checkpoint slots), the
victims are copied to host blocks (slots) of g's `HostTier` in ONE swap on the swap stream,
and the device ids go back to g's free list only after that swap has completed (the cache
waits for it: correct first, as the one-group cache does). The trie node then holds the
entry on the host (`node.lower[g]`, same key and hash): the match rule counts it as present.
A sliding block no hit can use is dropped rather than demoted. Host entries are dropped only
when g's host tier is full, least recently used first (the tier's LRU, per group), never one
a match still pins. `promote` brings a match's host entries of every group back in ONE
`swap_in` (fresh device ids, the cache's reference on them). Events carry `medium`: "GPU"
for the device, "CPU" for the host.
"""

from __future__ import annotations

from typing import Any

from ..core.log import get_logger
from ..errors import KvCacheError
from ..tiers.hybrid_host_tier import HybridHostTier

_log = get_logger("prefix_cache")


class HybridTiering:
    """The host-tier part of one `HybridPrefixCache` (`owner`): per group, which node each host id
    holds (`by_host[g]`), the host entries pinned by outstanding matches, the moves between
    the tiers and their counts (`demotions`, `promotions`, `host_drops`)."""

    def __init__(self, owner: Any, tier: HybridHostTier, swap_stream: object):
        self.owner, self.tier, self.swap_stream = owner, tier, swap_stream
        self.by_host: list[dict[int, Any]] = [{} for _ in range(tier.num_groups())]
        self._pins: dict[tuple[int, int], int] = {}
        self.demotions = self.promotions = self.host_drops = 0

    # -- pins -----------------------------------------------------------------------------

    def pin(self, g: int, host: int) -> None:
        """Keep host entry `host` of group g from being dropped (one count per match)."""
        self._pins[g, host] = self._pins.get((g, host), 0) + 1

    def unpin(self, g: int, host: int) -> None:
        """Undo one `pin`."""
        left = self._pins.get((g, host), 0) - 1
        if left > 0:
            self._pins[g, host] = left
        else:
            self._pins.pop((g, host), None)

    def pinned(self, g: int, host: int) -> bool:
        """True while a match pins host entry `host` of group g."""
        return (g, host) in self._pins

    # -- demotion -------------------------------------------------------------------------

    def demote(self, g: int, victims: list[int], useless: set[int]) -> None:
        """Evict group g's `victims` (entries only the cache holds, least worth keeping
        first): those in `useless` and those the host tier has no room for (every host entry
        pinned) are dropped, the others copied to host in ONE swap_out, waited for, then
        their device ids return to the free list. A swap error propagates with no device
        entry changed (host entries dropped to make room stay dropped)."""
        owner, tier = self.owner, self.tier.group(g)
        keep = [e for e in victims if e not in useless]
        short = len(keep) - tier.num_free_blocks()
        if short > 0:
            self.drop(g, short)
        room = min(len(keep), tier.num_free_blocks())
        demoted = keep[len(keep) - room:]  # the most recently used keep their place on the host
        moved = set(demoted)
        hosts = tier.alloc(len(demoted))
        handle = None
        try:
            if demoted:
                handle = self.tier.swap_out({g: demoted}, {g: hosts}, self.swap_stream)
                handle.wait()  # the device ids are about to be reused: the copy must have read them
        except BaseException:
            if handle is None or handle.event() is None:
                tier.free(hosts)
            else:
                tier.abandon(handle, hosts)
            raise
        for entry in victims:
            if entry not in moved:
                owner._drop(g, entry)
        where, last, alloc = owner._where[g], owner._last[g], owner._allocator(g)
        for entry in demoted:
            alloc.return_evicted_block(entry)  # while still listed: the allocator asks is_cached
        nodes = []
        for entry, host in zip(demoted, hosts):
            node = where.pop(entry)
            del last[entry]
            del node.entries[g]
            node.lower[g] = host
            self.by_host[g][host] = node
            nodes.append(node)
        tier.touch(hosts)
        self.demotions += len(demoted)
        _log.debug("prefix_cache_demoted", group=g, entries=len(demoted), dropped=len(victims) - len(demoted))
        if owner._events.consumer is not None:
            for entry, host, node in zip(demoted, hosts, nodes):
                owner._emit(owner._removed_event(g, entry, node))
                owner._emit(owner._node_stored_event(g, host, node, "CPU"))

    def drop(self, g: int, n: int) -> int:
        """Drop up to `n` host entries of group g, least recently used first (pinned ones
        kept); returns how many."""
        tier, by_host = self.tier.group(g), self.by_host[g]
        gone = []
        for host in tier.oldest():
            if len(gone) == n:
                break
            if not self.pinned(g, host):
                gone.append(host)
        self.forget(g, gone)
        return len(gone)

    def forget(self, g: int, hosts: list[int]) -> None:
        """Host entries `hosts` of group g leave the trie; their host ids are freed."""
        if not hosts:
            return
        owner, by_host = self.owner, self.by_host[g]
        nodes = [by_host.pop(host) for host in hosts]
        for node in nodes:
            del node.lower[g]
        self.tier.group(g).free(hosts)
        self.host_drops += len(hosts)
        for host, node in zip(hosts, nodes):
            if owner._events.consumer is not None:
                owner._emit(owner._removed_event(g, host, node, "CPU"))
            owner._prune(node)

    def live(self) -> bool:
        """False once any group's host tier was released."""
        return all(self.tier.group(g).is_live() for g in range(len(self.by_host)))

    def forget_released(self) -> None:
        """The host tier was released: forget every host entry (their host ids are gone with
        it), one `GroupBlockRemoved` on the CPU each; the owner goes on device-only."""
        owner = self.owner
        for g, by_host in enumerate(self.by_host):
            for host, node in list(by_host.items()):
                del node.lower[g]
                self.host_drops += 1
                if owner._events.consumer is not None:
                    owner._emit(owner._removed_event(g, host, node, "CPU"))
                owner._prune(node)
            by_host.clear()
        self._pins.clear()
        _log.info("prefix_cache_host_tier_gone", groups=len(self.by_host))

    def forget_all(self) -> None:
        """Drop every host entry of every group (clear, close)."""
        for g, by_host in enumerate(self.by_host):
            self.forget(g, list(by_host))
        self._pins.clear()

    # -- promotion ------------------------------------------------------------------------

    def promote(self, found: Any, stream: Any, wait: bool) -> Any:
        """`found` with its host entries of every group brought to fresh device ids in ONE
        swap_in on `stream` (the host waits for it when `wait`): the cache's reference on
        them, the caller's reference (the one the match stands for) on them too, their host
        ids freed once the swap is done. A failure (a group out of ids, a swap error) frees
        what was allocated and propagates with nothing changed: `found` still stands."""
        owner = self.owner
        host = {g: [h for _, h in pairs] for g, pairs in enumerate(found.host_entries) if pairs}
        if not host:
            return found
        fresh: dict[int, list[int]] = {}
        handle = None
        try:
            for g, ids in host.items():
                fresh[g] = owner._cache.group(g).alloc_blocks(len(ids))
            handle = self.tier.swap_in(host, fresh, stream)
            if wait:
                handle.wait()
            handle.done()  # an error polling it raises here, before anything changed
        except BaseException:
            if handle is not None:
                self.tier.group(0).keep(handle)
            for g, ids in fresh.items():
                owner._cache.group(g).free_blocks(ids)
            raise
        self.tier.free(host, after=handle)
        blocks, checkpoints = [list(b) for b in found.group_blocks], list(found.checkpoints)
        for g, pairs in enumerate(found.host_entries):
            alloc = owner._allocator(g)
            for (index, h), new in zip(pairs, fresh.get(g, ())):
                self.unpin(g, h)
                node = self.by_host[g].pop(h)
                del node.lower[g]
                node.entries[g] = new
                owner._where[g][new] = node
                alloc.inc_ref(new)  # the cache's own; the caller keeps the allocation's
                owner._touch(g, new)
                if owner._groups[g].is_attention():
                    blocks[g][index] = new
                else:
                    checkpoints[g] = new
                if owner._events.consumer is not None:
                    owner._emit(owner._removed_event(g, h, node, "CPU"))
                    owner._emit(owner._node_stored_event(g, new, node, "GPU"))
        self.promotions += sum(len(ids) for ids in fresh.values())
        empty = tuple(() for _ in found.host_entries)
        return found._replace(blocks=blocks[0], group_blocks=tuple(blocks), checkpoints=tuple(checkpoints),
                              host_entries=empty)

    # -- checks ---------------------------------------------------------------------------

    def check(self) -> None:
        """KvCacheError where a host entry is not on its node, not in its tier's LRU, or the
        LRU and the index disagree on how many there are."""
        for g, by_host in enumerate(self.by_host):
            tier = self.tier.group(g)
            for host, node in by_host.items():
                if node.lower.get(g) != host:
                    raise KvCacheError(f"group {g} host entry {host} is not on its node")
                if not tier.is_cached(host):
                    raise KvCacheError(f"group {g} host entry {host} is not in its host tier's LRU")
            if tier.num_cached_blocks() != len(by_host):
                raise KvCacheError(f"group {g}'s host tier LRU holds {tier.num_cached_blocks()}, the trie {len(by_host)}")
