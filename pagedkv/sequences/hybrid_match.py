"""The match path of `HybridPrefixCache`: the walk of a prompt's trie path, the cross-group
match rule (`_best`), `match` (references and host / disk pins taken on what it lists),
`release` (them given back) and `promote` (a match's host and disk entries brought to the
device in one swap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

from ..core.guard import guarded
from ..core.validate import int64_bytes_of_ids, token_ids
from ..groups.window import window_blocks_for_match
from .tree import adapter_id_checked

if TYPE_CHECKING:
    from .block_keys import BlockKeys
    from .hybrid_store import _Node


class HybridMatch(NamedTuple):
    """A hybrid prefix match: `num_tokens` (p), and per group `group_blocks[g]` (the blocks
    covering what group g needs at p: all of `[0, p)` for a full group, `[p - window, p)`
    for a sliding one, first block index `first_block[g]`; [] for a state group) and
    `checkpoints[g]` (a state group's checkpoint slot at p; None for attention groups). The
    caller holds one reference on every block and slot listed (`release` drops them).
    `blocks` is `group_blocks[0]`. `shared_tokens`: how far (a multiple of the match unit,
    at most `limit`) the tokens follow a chain of the cache, hit or not (>= num_tokens).

    With a host tier, an entry held on the host counts as present: its place in
    `group_blocks[g]` (or `checkpoints[g]`) is -1 and `host_entries[g]` lists `(index,
    host id)` for it (index 0 for a state group's checkpoint); the match pins it on the
    host (not dropped) until `release` or `SequenceTable.add`, which promotes it.
    `host_num_tokens`: how many of `num_tokens` only the host entries make a hit (the
    longest hit of device and host entries minus the longest of device entries alone).

    With a disk tier likewise: a disk-held entry's place is -1, `disk_entries[g]` lists
    `(index, disk slot)` for it (slots of group g's `DiskTier`), pinned until `release` or
    `SequenceTable.add`; `disk_num_tokens`: how many of `num_tokens` only the disk entries
    make a hit (p minus the longest hit of device and host entries). `disk_nodes[g]`: the
    trie nodes of `disk_entries[g]`, opaque, for the promotion's checks."""

    blocks: list
    num_tokens: int
    group_blocks: tuple
    checkpoints: tuple
    first_block: tuple
    shared_tokens: int = 0
    host_entries: tuple = ()
    host_num_tokens: int = 0
    disk_entries: tuple = ()
    disk_num_tokens: int = 0
    disk_nodes: tuple = ()



class HybridMatching:
    """Mixed into `HybridPrefixCache` (it sets `_roots`, `_unit`, `_match_unit`, `_groups`,
    `_ratio`, `_states`, `_layout`, `_tiering`, `_disk`, the match counters, `_allocator`,
    `_touch`, `_keys`, `_check_open`, `_check_tier`, `deliver_events`)."""

    def _path(self, tokens: Sequence[int], limit: int, adapter_id: int, keys: BlockKeys | None = None) -> list[_Node]:
        root = self._roots.get(adapter_id if keys is None else keys.root_key)
        path: list[_Node] = []
        if root is None:
            return path
        u, node = self._unit, root
        data = int64_bytes_of_ids(list(tokens[: (limit // u) * u]))
        step = 8 * u
        for k in range(limit // u):
            key = data[k * step:(k + 1) * step]
            node = node.children.get(key if keys is None else key + keys.suffix(k))
            if node is None:
                break
            path.append(node)
        return path

    def _best(self, path: list[_Node], limit: int, host: int = 2) -> int:
        """The longest p the match rule allows along `path`, at most `limit` (0 when none);
        `host`: the lowest tier whose entries count as present (0 the device, 1 the host,
        2 the disk)."""
        u, L = self._unit, self._match_unit
        depth = len(path)
        full_until, missing = {}, {}
        for g, group in enumerate(self._groups):
            if not group.is_attention():
                continue
            r = self._ratio[g]
            present = [self._present(path[(i + 1) * r - 1], g, host) for i in range(depth // r)]
            if group.kind == "full":
                run = 0
                while run < len(present) and present[run]:
                    run += 1
                full_until[g] = run * r * u
            else:
                acc = [0]
                for ok in present:
                    acc.append(acc[-1] + (not ok))
                missing[g] = acc
        best = (min(limit, depth * u) // L) * L
        while best > 0:
            k = best // u
            ok = all(best <= full_until[g] for g in full_until)
            if ok:
                for g, acc in missing.items():
                    span = window_blocks_for_match(best, self._groups[g].window, self._layout.block_size(g))
                    if acc[span.stop] - acc[span.start]:
                        ok = False
                        break
            if ok and all(self._present(path[k - 1], g, host) for g in self._states):
                return best
            best -= L
        return 0

    @staticmethod
    def _present(node: _Node, g: int, host: int) -> bool:
        return g in node.entries or (host > 0 and g in node.lower) or (host > 1 and g in node.disk)

    @guarded
    def match(self, tokens: Sequence[int], adapter_id: int = 0, limit: int | None = None,
              cache_salt: str | bytes | None = None, extra_keys=None, *, keys: BlockKeys | None = None,
              refresh_host: bool = True, disk: bool = True) -> HybridMatch:
        """The longest hybrid prefix of `tokens` (ending at most at `limit`, default all of
        them) under the match rule, with one reference taken on each block and checkpoint
        it lists (give them back with `release`, or hand the match to `SequenceTable.add`).
        `cache_salt` and `extra_keys` as for `PrefixCache.match` (`keys`: them already
        checked, a `BlockKeys` at the unit, as the table passes them). Host entries it lists
        are pinned, and their recency refreshed unless `refresh_host` is False (the table's
        add, which promotes them or leaves the host tier as it was); so are disk entries.
        `disk=False`: disk-held entries do not count (the table's add when its host tiers
        had no room to stage a disk hit)."""
        self._check_open("match")
        tokens = token_ids(tokens, "tokens")
        adapter_id = adapter_id_checked(adapter_id)
        keys = self._keys(adapter_id, cache_salt, extra_keys, keys)
        self._check_tier()
        limit = len(tokens) if limit is None else min(int(limit), len(tokens))
        path = self._path(tokens, limit, adapter_id, keys)
        p = self._best(path, limit, host=2 if disk else 1)
        upper = self._best(path, p, host=1) if p and self._disk is not None and disk else p
        host_tokens = upper - self._best(path, upper, host=0) if upper and self._tiering is not None else 0
        disk_tokens = p - upper
        self.queries += 1
        self.query_tokens += len(tokens)
        if p:
            self.hits += 1
            self.hit_tokens += p
        if host_tokens:
            self.host_hits += 1
            self.host_hit_tokens += host_tokens
        if disk_tokens:
            self.disk_hits += 1
            self.disk_hit_tokens += disk_tokens
        group_blocks, checkpoints, first, hosted, on_disk, disk_nodes = [], [], [], [], [], []
        for g, group in enumerate(self._groups):
            if not group.is_attention():
                group_blocks.append([])
                first.append(0)
                nodes = [path[p // self._unit - 1]] if p else []
            else:
                bs, r = self._layout.block_size(g), self._ratio[g]
                span = range(0, p // bs) if group.kind == "full" else window_blocks_for_match(p, group.window, bs)
                nodes = [path[(i + 1) * r - 1] for i in span]
                first.append(span.start if p else 0)
            ids = [node.entries.get(g, -1) for node in nodes]
            pairs = tuple((i, node.lower[g]) for i, node in enumerate(nodes) if ids[i] == -1 and g in node.lower)
            below = [(i, node) for i, node in enumerate(nodes) if ids[i] == -1 and g not in node.lower]
            self._take(g, [x for x in ids if x != -1])
            self._hold(g, pairs, refresh_host)
            hosted.append(pairs)
            slots = tuple((i, node.disk[g]) for i, node in below)
            if slots:
                for _, slot in slots:
                    self._disk.pin(g, slot)
                if refresh_host:
                    self._disk.touch(g, [slot for _, slot in reversed(slots)])
            on_disk.append(slots)
            disk_nodes.append(tuple(node for _, node in below))
            if group.is_attention():
                checkpoints.append(None)
                group_blocks.append(ids)
            else:
                checkpoints.append(ids[0] if ids else None)
        shared = max(p, (len(path) * self._unit // self._match_unit) * self._match_unit)
        return HybridMatch(group_blocks[0], p, tuple(group_blocks), tuple(checkpoints), tuple(first), shared,
                           tuple(hosted), host_tokens, tuple(on_disk), disk_tokens, tuple(disk_nodes))

    def _hold(self, g: int, pairs: tuple, refresh: bool) -> None:
        """Pin a match's host entries of group g and (`refresh`) refresh their recency (the
        shallowest most recent)."""
        if pairs:
            tiering = self._tiering
            for _, host in pairs:
                tiering.pin(g, host)
            if refresh:
                tiering.tier.group(g).touch([host for _, host in reversed(pairs)])

    @guarded
    def promote(self, found: HybridMatch, stream: object, wait: bool) -> HybridMatch | None:
        """`found` with every group's host and disk entries promoted to fresh device ids in
        ONE swap on `stream` (see `hybrid_tiering.HybridTiering.promote`); `found` itself
        when it has none. Nothing changes when it fails. None when a disk entry failed its
        read or is gone (dropped; release `found` and match again). Called by
        `SequenceTable.add` inside its guard."""
        if self._tiering is None or not (any(found.host_entries) or any(found.disk_entries)):
            return found
        self._check_open("promote")
        self._check_tier()
        if self._tiering is None:  # the host tier was released since the match: match again
            return None
        return self._tiering.promote(found, stream, wait)

    def _take(self, g: int, entries: list[int]) -> None:
        if entries:
            self._allocator(g).inc_refs(entries)
            for entry in entries:
                self._touch(g, entry)

    @guarded
    def release(self, found: HybridMatch) -> None:
        """Drop the references (and host pins) a `match` took."""
        for g, blocks in enumerate(found.group_blocks):
            held = [b for b in blocks if b != -1]
            if held:
                self._allocator(g).free_blocks(held)
        for g, slot in enumerate(found.checkpoints):
            if slot is not None and slot != -1:
                self._allocator(g).free_blocks([slot])
        if self._tiering is not None:
            for g, pairs in enumerate(found.host_entries):
                for _, host in pairs:
                    self._tiering.unpin(g, host)
        if self._disk is not None:
            for g, pairs in enumerate(found.disk_entries):
                for _, slot in pairs:
                    self._disk.unpin(g, slot)
        self.deliver_events()
