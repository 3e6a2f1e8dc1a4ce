"""The store path of `HybridPrefixCache`: the trie node (`_Node`), the roots (per adapter,
or per adapter and cache salt), a prompt's `BlockKeys` at the unit, `store` (a chain's
nodes made, each group's entries cached on them, their events emitted) and `_prune` (empty
chain ends removed).
"""

from __future__ import annotations

from typing import Sequence

from ..core.guard import guarded
from ..core.validate import int64_bytes_of_ids
from .block_keys import BlockKeys, block_keys, salted_root_hash
from .hashing import chain_digest, root_hash
from .hybrid_disk_tiering import NO_DISK
from .tree import adapter_id_checked


class _Node:
    __slots__ = ("parent", "key", "depth", "children", "entries", "lower", "disk", "hash", "adapter_id", "extra",
                 "digests")

    def __init__(self, parent, key: bytes, depth: int, hash_: int, adapter_id: int, extra: tuple = ()):
        self.parent, self.key, self.depth, self.hash, self.adapter_id = parent, key, depth, hash_, adapter_id
        self.children: dict[bytes, _Node] = {}
        self.entries: dict[int, int] = {}
        self.lower: dict[int, int] = {}  # group -> host id of an entry held on the host tier
        self.disk: dict[int, int] = NO_DISK  # group -> disk slot of an entry on the disk tier (set_disk)
        # the unit's extra keys (a root: its salt as given, or ()); vLLM digests per block size
        self.extra = extra
        self.digests: dict[int, bytes] | None = None



class HybridStore:
    """Mixed into `HybridPrefixCache` (it sets `_roots`, `_unit`, `_layout`, `_where`,
    `_tiering`, `_disk`, `_events`, `_allocator`, `_touch`, `_emit`, `_stored_event`,
    `_check_open`, `_check_tier`)."""

    def _root(self, adapter_id: int, keys: BlockKeys | None = None) -> _Node:
        if keys is None or keys.salt_raw is None:
            root = self._roots.get(adapter_id)
            if root is None:
                root = self._roots[adapter_id] = _Node(None, b"", 0, root_hash(adapter_id), adapter_id)
            return root
        root = self._roots.get(keys.root_key)
        if root is None:
            root = self._roots[keys.root_key] = _Node(None, keys.salt_raw, 0, salted_root_hash(adapter_id, keys.salt_raw),
                                                      adapter_id, (keys.salt,))
        return root

    def _keys(self, adapter_id: int, cache_salt: object, extra_keys: object, keys: BlockKeys | None) -> BlockKeys | None:
        """The prompt's `BlockKeys` at the unit: `keys` when given (already checked), else
        built from `cache_salt` / `extra_keys` (None with neither)."""
        if keys is not None:
            if not isinstance(keys, BlockKeys) or keys.block_size != self._unit or keys.adapter_id != adapter_id:
                raise ValueError(f"keys must be the BlockKeys of adapter {adapter_id} at the unit {self._unit}")
            return keys
        return block_keys(adapter_id, cache_salt, extra_keys, self._unit)

    @guarded
    def store(self, tokens: Sequence[int], adapter_id: int, group_entries: dict, cache_salt: str | bytes | None = None,
              extra_keys=None, *, keys: BlockKeys | None = None) -> int:
        """Cache entries of one chain: `group_entries[g]` lists `(position, id)` pairs, each an
        entry of group g ending at `position` (a block's end, or a checkpoint's position, a
        multiple of the unit) within `tokens`. A position that already holds an entry of g
        keeps it (the new id is not cached). The cache takes its own reference on each entry
        it caches; the caller keeps its own. Returns how many entries were cached.
        `cache_salt`, `extra_keys` and `keys` key the chain as for `match`."""
        self._check_open("store")
        adapter_id = adapter_id_checked(adapter_id)
        keys = self._keys(adapter_id, cache_salt, extra_keys, keys)
        ends = [pos for pairs in group_entries.values() for pos, _ in pairs]
        if not ends:
            return 0
        deepest = max(ends)
        if deepest > len(tokens):
            raise ValueError(f"an entry ends at {deepest}, past the {len(tokens)} tokens given")
        u = self._unit
        for g, pairs in group_entries.items():  # before any node is made: a bad entry changes nothing
            self._layout.check_group(g)
            for pos, _ in pairs:
                if pos % u or pos <= 0:
                    raise ValueError(f"group {g} entry at position {pos}: not a positive multiple of the unit {u}")
        self._check_tier()
        data = int64_bytes_of_ids(list(tokens[: (deepest // u) * u]))
        node, path, step = self._root(adapter_id, keys), [], 8 * u
        for k in range(deepest // u):
            key = data[k * step:(k + 1) * step]
            if keys is not None:
                key += keys.suffix(k)
            child = node.children.get(key)
            if child is None:
                hash_ = int.from_bytes(chain_digest(node.hash.to_bytes(8, "little"), key), "little")
                child = node.children[key] = _Node(node, key, k + 1, hash_, adapter_id,
                                                   keys.keys_of_block(k) if keys is not None else ())
            node = child
            path.append(node)
        stored = 0
        for g, pairs in group_entries.items():
            for pos, entry in pairs:
                target = path[pos // u - 1]
                if g in target.entries or entry in self._where[g]:
                    continue
                # held on the host (or on disk): the device copy takes its place; `target` is
                # not pruned meanwhile (it gets the entry next; the end of the chain is pruned below)
                if g in target.lower:
                    if self._tiering.pinned(g, target.lower[g]):
                        continue
                    self._tiering.forget(g, [target.lower[g]], dropped=False, prune=False)
                if g in target.disk:
                    if self._disk.pinned(g, target.disk[g]):
                        continue
                    self._disk.forget(g, target)
                self._allocator(g).inc_ref(entry)
                target.entries[g] = entry
                self._where[g][entry] = target
                self._touch(g, entry)
                stored += 1
                if self._events.consumer is not None:
                    self._emit(self._stored_event(g, entry, pos, path, tokens, adapter_id))
        self._prune(path[-1] if path else None)
        return stored

    def _prune(self, node: _Node | None) -> None:
        while (node is not None and node.parent is not None and not node.entries and not node.lower
               and not node.disk and not node.children and node.parent.children.get(node.key) is node):
            del node.parent.children[node.key]
            node = node.parent
