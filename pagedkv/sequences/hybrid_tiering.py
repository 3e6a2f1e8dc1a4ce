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

With a disk tier below (`disk`, a `HybridDiskTiering`), host entries the LRU drops are
written to disk instead, and `promote` brings the match's disk entries up in the same swap
(read into staged host blocks first; see `hybrid_disk_tiering`).
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
    the tiers and their counts per group (`demotions`, `promotions`, `host_drops`)."""

    def __init__(self, owner: Any, tier: HybridHostTier, swap_stream: object):
        self.owner, self.tier, self.swap_stream = owner, tier, swap_stream
        n = tier.num_groups()
        self.by_host: list[dict[int, Any]] = [{} for _ in range(n)]
        self._pins: dict[tuple[int, int], int] = {}
        self.demotions, self.promotions, self.host_drops = [0] * n, [0] * n, [0] * n
        self.disk = None  # the HybridDiskTiering below, when the prefix cache has a disk tier

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
        entry changed (host entries dropped to make room stay dropped). With a disk tier,
        more victims than the host tier can take go in rounds of what it can (one swap
        each, the least worth first, each round's host drops writing the round before to
        disk); a swap error then leaves the earlier rounds demoted."""
        keep = [e for e in victims if e not in useless]
        if self.disk is not None:
            room = self.tier.group(g).num_blocks() - sum(1 for key in self._pins if key[0] == g)
            while room > 0 and len(keep) > room:
                self._demote(g, keep[:room], set())
                keep = keep[room:]
            last = set(keep)
            victims = [e for e in victims if e in useless or e in last]
        self._demote(g, victims, useless)

    def _demote(self, g: int, victims: list[int], useless: set[int]) -> None:
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
        self.demotions[g] += len(demoted)
        _log.debug("prefix_cache_demoted", group=g, entries=len(demoted), dropped=len(victims) - len(demoted))
        if owner._events.consumer is not None:
            for entry, host, node in zip(demoted, hosts, nodes):
                owner._emit(owner._removed_event(g, entry, node))
                owner._emit(owner._node_stored_event(g, host, node, "CPU"))

    def drop(self, g: int, n: int) -> int:
        """Drop up to `n` host entries of group g, least recently used first (pinned ones
        kept), each written to the disk tier when there is one (see `HybridDiskTiering.spill`);
        returns how many."""
        tier, by_host = self.tier.group(g), self.by_host[g]
        gone = []
        for host in tier.oldest():
            if len(gone) == n:
                break
            if not self.pinned(g, host):
                gone.append(host)
        written = self.disk.spill(g, [(h, by_host[h]) for h in gone]) if self.disk is not None and gone else []
        self.forget(g, gone)
        if written:
            self.disk.announce(g, written)
        return len(gone)

    def forget(self, g: int, hosts: list[int], dropped: bool = True, prune: bool = True) -> None:
        """Host entries `hosts` of group g leave the trie; their host ids are freed (one
        `GroupBlockRemoved` on the CPU each). `dropped`: they left for room (counted in
        `host_drops`, the stats' `host_evictions`); not so for a device copy taking their
        place (`store`) or `clear`/`close`. `prune`: their nodes left empty leave the trie
        (False when the caller is about to give the node an entry, and prunes after)."""
        if not hosts:
            return
        owner, by_host = self.owner, self.by_host[g]
        nodes = [by_host.pop(host) for host in hosts]
        for node in nodes:
            del node.lower[g]
        self.tier.group(g).free(hosts)
        if dropped:
            self.host_drops[g] += len(hosts)
        for host, node in zip(hosts, nodes):
            if owner._events.consumer is not None:
                owner._emit(owner._removed_event(g, host, node, "CPU"))
            if prune:
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
                self.host_drops[g] += 1
                if owner._events.consumer is not None:
                    owner._emit(owner._removed_event(g, host, node, "CPU"))
                owner._prune(node)
            by_host.clear()
        self._pins.clear()
        _log.info("prefix_cache_host_tier_gone", groups=len(self.by_host))

    def forget_all(self) -> None:
        """Drop every host entry of every group (clear, close; not counted in `host_drops`:
        none left for room)."""
        for g, by_host in enumerate(self.by_host):
            self.forget(g, list(by_host), dropped=False)
        self._pins.clear()

    # -- promotion ------------------------------------------------------------------------

    def promote(self, found: Any, stream: Any, wait: bool) -> Any:
        """`found` with its host entries (and, with a disk tier, its disk entries, read into
        staged host blocks first) of every group brought to fresh device ids in ONE swap_in
        on `stream` (the host waits for it when `wait`): the cache's reference on them, the
        caller's reference (the one the match stands for) on them too, their host ids (disk
        slots) freed once the swap is done. Disk entries beyond what the host tiers can stage
        at once go up in further rounds (one swap each, each waited for); when the match's own
        host entries fill a group's host tier, they go up first (kept on the device even if
        the disk part then fails) and the disk part follows through the blocks they leave. A
        failure (a group out of ids, a swap error, `NoStagingRoom`) frees what was allocated
        and propagates with every entry of the match cached (where it was, or on the device):
        the caller releases `found`. None when a disk entry is gone or failed its read
        (dropped; the caller releases `found` and matches again)."""
        disk = self.disk
        hosted = {g: list(pairs) for g, pairs in enumerate(found.host_entries) if pairs}
        below: dict[int, list] = {}
        if disk is not None and any(getattr(found, "disk_entries", ())):
            below = disk.wanted(found)
            if below is None:
                return None
        if not hosted and not below:
            return found
        if below and hosted and any(self.room(g) == 0 for g in below):
            # the match's own host entries fill a group's host tier: they go up first (one
            # swap, kept), then the disk part through the host blocks they leave
            mid = self._promote(found, hosted, {}, stream, True)
            try:
                out = self._promote(mid, {}, below, stream, wait)
            except BaseException:
                self._let_go(found, mid)
                raise
            if out is None:
                self._let_go(found, mid)
            return out
        return self._promote(found, hosted, below, stream, wait)

    def room(self, g: int) -> int:
        """Host blocks of group g free or held by entries no match pins (what staging may use)."""
        tier = self.tier.group(g)
        return tier.num_free_blocks() + tier.num_cached_blocks() - sum(1 for key in self._pins if key[0] == g)

    def _let_go(self, found: Any, mid: Any) -> None:
        """Drop the caller's references `mid` took beyond `found`'s (host entries promoted by
        a first step): `found` is what the caller releases."""
        owner = self.owner
        for g, pairs in enumerate(found.host_entries):
            if not pairs:
                continue
            if owner._groups[g].is_attention():
                ids = [mid.group_blocks[g][i] for i, _ in pairs]
            else:
                ids = [mid.checkpoints[g]]
            owner._allocator(g).free_blocks(ids)

    def _promote(self, found: Any, hosted: dict, below: dict, stream: Any, wait: bool) -> Any:
        owner, disk = self.owner, self.disk
        fresh: dict[int, list[int]] = {}
        handle = None
        staged: dict = {}
        try:
            for g in set(hosted) | set(below):
                fresh[g] = owner._cache.group(g).alloc_blocks(len(hosted.get(g, ())) + len(below.get(g, ())))
            done = {g: 0 for g in below}
            first = True
            while first or any(done[g] < len(items) for g, items in below.items()):
                staged = disk.stage({g: items[done[g]:] for g, items in below.items()}) if below else {}
                if staged is None:
                    staged = {}
                    for g, ids in fresh.items():
                        owner._cache.group(g).free_blocks(ids)
                    return None
                host, device = {}, {}
                for g, pairs in (hosted.items() if first else ()):
                    host[g], device[g] = [h for _, h in pairs], fresh[g][:len(pairs)]
                for g, items in staged.items():
                    at = len(hosted.get(g, ())) + done[g]
                    host[g] = host.get(g, []) + [h for _, h, _, _ in items]
                    device[g] = device.get(g, []) + fresh[g][at:at + len(items)]
                    done[g] += len(items)
                last = not any(done[g] < len(items) for g, items in below.items())
                handle = self.tier.swap_in(host, device, stream)
                if wait or not last:
                    handle.wait()
                handle.done()  # an error polling it raises here, before anything changed
                if staged:
                    disk.unstage(staged, handle, failed=False)
                    staged = {}
                first = False
        except BaseException:
            if handle is not None:
                self.tier.group(0).keep(handle)
            for g, ids in fresh.items():
                owner._cache.group(g).free_blocks(ids)
            if staged:
                disk.unstage(staged, handle)
            raise
        if hosted:
            self.tier.free({g: [h for _, h in pairs] for g, pairs in hosted.items()}, after=handle)
        blocks, checkpoints = [list(b) for b in found.group_blocks], list(found.checkpoints)
        for g, ids in fresh.items():
            alloc = owner._allocator(g)
            moves = [(index, h, None, None) for index, h in hosted.get(g, ())] + list(below.get(g, ()))
            for (index, h, slot, node), new in zip(moves, ids):
                if slot is None:
                    self.unpin(g, h)
                    node = self.by_host[g].pop(h)
                    del node.lower[g]
                else:
                    disk.promoted(g, slot, node)
                node.entries[g] = new
                owner._where[g][new] = node
                alloc.inc_ref(new)  # the cache's own; the caller keeps the allocation's
                owner._touch(g, new)
                if owner._groups[g].is_attention():
                    blocks[g][index] = new
                else:
                    checkpoints[g] = new
                if owner._events.consumer is not None:
                    if slot is None:
                        owner._emit(owner._removed_event(g, h, node, "CPU"))
                    owner._emit(owner._node_stored_event(g, new, node, "GPU"))
            self.promotions[g] += len(hosted.get(g, ()))
        empty = tuple(() for _ in found.host_entries)
        if below or not any(getattr(found, "disk_entries", ())):
            return found._replace(blocks=blocks[0], group_blocks=tuple(blocks), checkpoints=tuple(checkpoints),
                                  host_entries=empty, disk_entries=empty, disk_nodes=empty)
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
