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
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Sequence

from ..cache.hybrid_cache import HybridKvCache
from ..core.guard import ThreadGuard, guarded
from ..core.validate import int64_bytes_of_ids, token_ids
from ..errors import KvCacheError
from ..groups.window import window_blocks_for_match
from .block_keys import BlockKeys, block_keys, salted_root_hash
from ..core.streams import stream_handle
from ..tiers.hybrid_host_tier import check_tier_of
from .events import EventQueue
from .hybrid_disk_tiering import NO_DISK, HybridDiskTiering
from .hybrid_tiering import HybridTiering
from .stats import HybridPrefixCacheStats
from .hashing import chain_digest, root_hash
from .tree import adapter_id_checked
from .vllm_hash import DEFAULT_SCHEME, SCHEMES, VllmHashes, block_digest, resolve_seed
from .vllm_hash import SCHEME as VLLM_SCHEME


SPEC_KINDS = {"full": "full_attention", "sliding": "sliding_window", "state": "mamba"}
"""A group kind as vLLM's KV events name it (`kv_cache_spec_kind`)."""


@dataclass(frozen=True)
class GroupBlockStored:
    """An entry newly cached: `block_id` (a block, or a state slot) of `group`, ending at token
    `position` of the chain whose unit hash there is `block_hash`.

    What a router needs besides (vLLM's `BlockStored` fields; the wire format sends it as
    one): `token_ids`, the `block_size` tokens the entry ends (an attention group's block;
    a state group's last unit, `[position - unit, position)`), `parent_block_hash`, the
    unit hash where those tokens start (None at the chain's start), `medium`, the group's
    `kv_cache_spec_kind` ("full_attention", "sliding_window", "mamba") and a sliding
    group's window in tokens, `seq`, the event's number in its prefix cache, and
    `extra_keys`, the entry's extra keys where vLLM places them (its units' keys, then the
    cache salt on a prompt's first block; None when none)."""

    group: int
    block_id: int
    position: int
    block_hash: int | bytes
    adapter_id: int
    kind: str = "stored"
    token_ids: tuple = ()
    parent_block_hash: int | None = None
    block_size: int = 0
    medium: str = "GPU"
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    seq: int = field(default=0, compare=False)
    extra_keys: tuple | None = None

    @property
    def group_idx(self) -> int:
        """`group` (the name vLLM's events give it)."""
        return self.group


@dataclass(frozen=True)
class GroupBlockRemoved:
    """An entry evicted (or dropped by `clear`): `block_id` of `group` is free again; `seq`
    is the event's number in its prefix cache."""

    group: int
    block_id: int
    block_hash: int | bytes
    kind: str = "removed"
    medium: str = "GPU"
    seq: int = field(default=0, compare=False)

    @property
    def group_idx(self) -> int:
        """`group` (the name vLLM's events give it)."""
        return self.group


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


class HybridPrefixCache:
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

    # -- plumbing ---------------------------------------------------------------------

    def _allocator(self, g: int):
        return self._cache.group(g).allocator()

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

    def _span(self, g: int) -> int:
        """Tokens an entry of group g ends: an attention block, or a state group's last unit."""
        return self._layout.block_size(g) if self._groups[g].is_attention() else self._unit

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

    def deliver_events(self) -> None:
        """Deliver queued events now."""
        if self._events.consumer is None:
            self._events.pending.clear()
            return
        self._events.deliver()

    _deliver = deliver_events

    def _emit(self, event) -> None:
        if self._events.consumer is not None:
            self._events.emit(event)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise KvCacheError(f"{what} on a closed prefix cache")

    def closed(self) -> bool:
        """True after `close()`."""
        return self._closed

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

    def hash_scheme(self) -> str:
        """The scheme `block_hash` and events use ("pagedkv-blake2b-64" or "vllm-sha256-cbor")."""
        return self._hash_scheme

    def _hash_at(self, g: int, node: _Node):
        """The hash events report for group g's entry on `node`: the node's chained 64-bit
        hash, or vLLM's digest at the group's block size."""
        if self._vroot is None:
            return node.hash
        group = self._groups[g]
        return self._digest(node, self._layout.block_size(g) if group.is_attention() else self._unit)

    def _digest(self, node: _Node, span: int) -> bytes:
        """vLLM's digest of the block of `span` tokens ending at `node` (a multiple of the
        unit), chained over the blocks of that size before it; kept on the nodes."""
        r, u = span // self._unit, self._unit
        chain = []
        while node.depth and (node.digests is None or span not in node.digests):
            chain.append(node)
            for _ in range(r):
                node = node.parent
        parent = self._vroot if not node.depth else node.digests[span]
        for end in reversed(chain):
            units, n = [], end
            for _ in range(r):
                units.append(n)
                n = n.parent
            units.reverse()
            tokens = [int.from_bytes(x.key[i:i + 8], "little") for x in units for i in range(0, 8 * u, 8)]
            if end.digests is None:
                end.digests = {}
            end.digests[span] = parent = block_digest(parent, tokens, self._extra_of(end, span))
        return parent

    def _extra_of(self, end: _Node, span: int) -> tuple | None:
        """The extra keys of the block of `span` tokens ending at `end` as vLLM places them:
        its units' keys in position order, each once, then the salt on a salted prompt's
        first block; None when there are none."""
        units, n = [], end
        for _ in range(span // self._unit):
            units.append(n)
            n = n.parent
        extra = tuple(dict.fromkeys(k for x in reversed(units) for k in x.extra))
        if n.parent is None and n.extra:  # the prompt's first block of a salted root: the salt last
            extra += n.extra
        return extra or None

    @guarded
    def block_hash(self, group: int, entry: int) -> int | bytes:
        """The hash of cached entry `entry` of `group` (its events' `block_hash`): the 64-bit
        chained hash, or under "vllm-sha256-cbor" the 32-byte digest. KeyError when not cached."""
        g = self._layout.check_group(group)
        node = self._where[g].get(entry)
        if node is None:
            raise KeyError(f"entry {entry!r} of group {g} is not cached")
        return self._hash_at(g, node)

    def _touch(self, g: int, entry: int) -> None:
        if entry in self._where[g]:
            self._tick += 1
            self._last[g][entry] = self._tick

    # -- match --------------------------------------------------------------------------

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

    # -- store --------------------------------------------------------------------------

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

    def _stored_event(self, g: int, entry: int, pos: int, path: list, tokens: Sequence[int],
                      adapter_id: int) -> GroupBlockStored:
        """The event of group g's entry `entry` ending at `pos` on `path` (the chain's nodes)."""
        group, u = self._groups[g], self._unit
        span = self._layout.block_size(g) if group.is_attention() else u
        start = pos - span
        return GroupBlockStored(
            g, entry, pos, self._hash_at(g, path[pos // u - 1]), adapter_id,
            token_ids=tuple(int(t) for t in tokens[start:pos]),
            parent_block_hash=self._hash_at(g, path[start // u - 1]) if start > 0 else None,
            block_size=span,
            kv_cache_spec_kind=SPEC_KINDS[group.kind],
            kv_cache_spec_sliding_window=group.window if group.kind == "sliding" else None,
            extra_keys=self._extra_of(path[pos // u - 1], span),
        )

    # -- eviction -----------------------------------------------------------------------

    def _removed_event(self, g: int, entry: int, node: _Node, medium: str = "GPU") -> GroupBlockRemoved:
        """The event of group g's entry `entry` (a device or host id) on `node` leaving `medium`."""
        return GroupBlockRemoved(g, entry, self._hash_at(g, node), medium=medium)

    def _node_stored_event(self, g: int, entry: int, node: _Node, medium: str) -> GroupBlockStored:
        """The stored event of group g's entry `entry` on `node`, now held in `medium`."""
        path, n = [], node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        path.reverse()
        data = b"".join(x.key[: 8 * self._unit] for x in path)
        tokens = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
        event = self._stored_event(g, entry, node.depth * self._unit, path, tokens, node.adapter_id)
        return replace(event, medium=medium)

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

    def _prune(self, node: _Node | None) -> None:
        while (node is not None and node.parent is not None and not node.entries and not node.lower
               and not node.disk and not node.children and node.parent.children.get(node.key) is node):
            del node.parent.children[node.key]
            node = node.parent

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

    # -- queries ------------------------------------------------------------------------

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
