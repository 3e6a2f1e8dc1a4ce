"""PrefixCache: full KV blocks keyed by their exact tokens, so a prompt that starts like an
earlier one reuses that prompt's blocks instead of recomputing them.

A radix tree of whole blocks (`tree`), one root per adapter (adapters never share), each
node holding one block and its `block_size` tokens under their exact int64 bytes, so a hash
collision can never hand one prompt another prompt's KV. Each node also carries a chained
64-bit content hash (`hashing`: the same on every machine and process) that events
(`events`) report, for routers that track other engines' caches.

Invariants (checked by `check_invariants`):
- every node holds exactly `block_size` tokens, its key in its parent; no block is cached
  twice; every cached block carries one reference of the cache's own (count >= 1);
- a node's hash is `chain_hash(parent hash, tokens)`; a root's is `root_hash(adapter_id)`.

Eviction (`eviction.LruEviction`, the one policy object) takes least-recently-used leaves
whose block only the cache holds (count 1). A block's "use" is a match, an insert, or the
moment its last other holder released it.

Host tier (`PrefixCache(cache, host_tier=HostTier(...))`, `tiering`): eviction demotes
instead of dropping, and `SequenceTable.add` promotes the host part of its match.

This module holds the class, its construction and the lookup path (`match`, `reserve`,
`confirm`, `cancel`); the rest is mixed in: the store path (`prefix_insert`), eviction,
clearing and closing (`prefix_eviction`), the tier glue (`prefix_tiers`) and the
introspection with `check_invariants` (`prefix_queries`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from ..cache import HybridKvCache, PagedKvCache
from ..core.guard import ThreadGuard, guarded
from ..core.streams import stream_handle
from ..core.validate import int64_bytes_of_ids, non_negative_int, token_ids
from ..errors import KvCacheError, RefCountError
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventQueue, PrefixCacheEvent
from .block_keys import BlockKeys, block_keys
from .retention import RetentionApi, RetentionEviction
from .vllm_hash import DEFAULT_SCHEME, SCHEMES, VllmHashes, resolve_seed
from .vllm_hash import SCHEME as VLLM_SCHEME
from .hashing import chain_hash, int64_bytes, root_hash
from .hybrid_prefix import HybridPrefixCache
from .prefix_eviction import PrefixEviction
from .prefix_insert import PrefixInsert
from .prefix_queries import PrefixQueries
from .prefix_tiers import PrefixTiers
from .stats import PrefixCacheStats, PrefixCounters
from .disk_tiering import DiskTiering
from .tiering import HostTiering
from .tree import Node, RadixTree, adapter_id_checked

if TYPE_CHECKING:
    from ..tiers.disk_tier import DiskTier
    from ..tiers.host_tier import HostTier

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "PrefixCache", "PrefixCacheEvent", "PrefixCacheStats",
    "PrefixMatch", "TieredMatch", "adapter_id_checked", "chain_hash", "root_hash",
]


class PrefixMatch(NamedTuple):
    """The longest cached run of whole blocks: the device blocks (one reference each now
    held by the caller) and how many tokens they cover. With a host tier, `host_blocks`
    continue the run in host memory (not held: `SequenceTable.add` promotes them; they may
    be dropped later) and `host_num_tokens` counts their tokens; otherwise () and 0."""

    blocks: list[int]
    num_tokens: int
    host_blocks = ()
    host_num_tokens = 0
    disk_blocks = ()
    disk_num_tokens = 0


class TieredMatch(PrefixMatch):
    """A PrefixMatch of a prefix cache with a host tier: `host_blocks` (a list of host block
    ids) and `host_num_tokens` are set per match; with a disk tier, `disk_blocks` (the slots
    continuing the run on disk, after the host blocks) and `disk_num_tokens` too."""


class _Reservation(TieredMatch):
    """A PrefixMatch from `reserve`, remembering whether it is still open (neither
    confirmed nor cancelled), so that it is released only once."""


class PrefixCache(PrefixInsert, PrefixEviction, PrefixTiers, PrefixQueries, RetentionApi):
    """A prefix cache attached to one PagedKvCache (one per KV cache). It holds one
    reference of its own on every cached block, so a cached block never reaches the free
    list while cached; `PagedKvCache.alloc_blocks` asks it to evict when short.

    Events go to `on_event` only once the operation that caused them is complete: at the
    end of the public method, or for evictions made by `PagedKvCache.alloc_block(s)` when
    the allocation is done (inside a SequenceTable call, at the end of that call). A
    consumer may call back into the cache. If it raises, the exception propagates out of
    the call that delivered the event, that call's work stays done (an allocation hands
    its blocks back), the raising event is consumed and later events stay queued for the
    next delivery (the next public call, or `deliver_events()`).

    One thread at a time: every public method (and the table's) checks a shared guard and
    raises `ConcurrentUseError`, changing nothing, when another thread is inside.

    With `host_tier`, evicted blocks are demoted into it rather than dropped (see
    `pagedkv.sequences.tiering`); `num_cached_blocks`, `is_cached`, `block_hash` and
    `block_references` speak of the device tier, `num_host_blocks` of the host tier.

    Over a `HybridKvCache` it is a `HybridPrefixCache` (`pagedkv.sequences.hybrid_prefix`:
    the cross-group match rule; `hash_scheme` / `hash_seed` taken as here; `host_tier` a
    `HybridHostTier`, see `pagedkv.sequences.hybrid_tiering`; `disk_tier` a `HybridDiskTier`,
    see `pagedkv.sequences.hybrid_disk_tiering`)."""

    def __new__(cls, cache=None, on_event=None, host_tier=None, swap_stream=0, disk_tier=None, **options):
        if cls is PrefixCache and isinstance(cache, HybridKvCache):
            schemes = {k: options[k] for k in ("hash_scheme", "hash_seed") if k in options}
            others = sorted(set(options) - set(schemes))
            if others:
                raise KvCacheError(f"a cache with layer_groups does not take {', '.join(others)} yet")
            return HybridPrefixCache(cache, on_event, host_tier=host_tier, swap_stream=swap_stream, disk_tier=disk_tier,
                                     **schemes)
        return super().__new__(cls)

    def __init__(self, cache: PagedKvCache, on_event: Callable[[PrefixCacheEvent], None] | None = None,
                 host_tier: "HostTier | None" = None, swap_stream: object = 0, disk_tier: "DiskTier | None" = None,
                 clock: Callable[[], float] = time.monotonic, hash_scheme: str = DEFAULT_SCHEME,
                 hash_seed: str | None = None):
        """`host_tier`: a HostTier of `cache` to demote evicted blocks into (see
        `pagedkv.sequences.tiering`); `swap_stream`: the stream demotions are enqueued on,
        after the work already there (give the engine's compute stream). `disk_tier`: a
        DiskTier below the host tier (see `pagedkv.sequences.disk_tiering`), bound here: a
        directory of another layout is refused (DiskLayoutMismatch) with nothing changed,
        one of the same layout comes up warm (its chains match). `clock` (seconds, monotonic)
        times retention TTLs (`set_retention`). `hash_scheme="vllm-sha256-cbor"` reports block
        hashes as vLLM v1 computes them (`pagedkv.sequences.vllm_hash`: 32-byte digests, in
        `block_hash` and in events) from the root of `hash_seed` (the engines'
        PYTHONHASHSEED string; default: this process's PYTHONHASHSEED, ValueError when
        unset); the default scheme keeps the 64-bit chained blake2b."""
        if not isinstance(cache, PagedKvCache):
            raise TypeError(f"cache must be a PagedKvCache, got {type(cache).__name__}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable, got {on_event!r}")
        if hash_scheme not in SCHEMES:
            raise ValueError(f"hash_scheme must be one of {', '.join(SCHEMES)}, got {hash_scheme!r}")
        digest = VllmHashes(resolve_seed(hash_seed), cache.block_size()) if hash_scheme == VLLM_SCHEME else None
        if not callable(clock):
            raise TypeError(f"clock must be callable (seconds, monotonic), got {clock!r:.60}")
        if host_tier is not None:
            from ..tiers.host_tier import HostTier

            if not isinstance(host_tier, HostTier):
                raise TypeError(f"host_tier must be a HostTier, got {type(host_tier).__name__}")
            if host_tier.cache() is not cache:
                raise ValueError("host_tier belongs to a different PagedKvCache")
        records = None
        if disk_tier is not None:
            from ..tiers.disk_tier import DiskTier

            if not isinstance(disk_tier, DiskTier):
                raise TypeError(f"disk_tier must be a DiskTier, got {type(disk_tier).__name__}")
            if host_tier is None:
                raise ValueError("a disk tier sits below a host tier: give host_tier=HostTier(...) too")
        stream_handle(swap_stream)
        if host_tier is not None:
            check = getattr(host_tier.gpu(), "check_stream", None)
            if check is not None:  # a backend that knows its streams (HostBackend): refused now, not at a swap
                check(swap_stream)
        if disk_tier is not None:
            records = disk_tier.bind(host_tier)  # the last check: refuses another layout, reads nothing then
        self._swap_stream = swap_stream
        self._cache = cache
        self._block_size = cache.block_size()
        self._allocator = cache.allocator()
        self._guard = ThreadGuard("this PrefixCache")
        self._events = EventQueue(on_event, self._guard)
        self._events.digest = self._digest = digest
        self._hash_scheme = hash_scheme
        self._tree = RadixTree(self._block_size)
        self._by_block = self._tree.by_block  # the same dict: the hot paths read it directly
        self._cached_view = self._by_block.keys()  # a live view: `in` without a call
        self._policy = RetentionEviction(self._tree, cache.ref_count, clock)
        self._counters = PrefixCounters()
        self._tiering: HostTiering | None = None
        if host_tier is not None:
            self._tiering = HostTiering(host_tier, swap_stream, self._tree, self._policy, cache, self._events,
                                        self._counters)
            host_tier.attach_owner(self._guard)  # its cached host blocks are freed from within this cache only
        self._disk: DiskTiering | None = None
        if disk_tier is not None:
            self._disk = self._tiering.disk = DiskTiering(disk_tier, self._tiering, self._tree, self._events,
                                                          self._counters)
            self._disk.restore(records)
        self._closed = False
        self._refresh_on_release = True
        cache.attach_prefix_cache(self)

    # -- guard and events --------------------------------------------------------------

    def deliver_events(self) -> None:
        """Hand queued events to `on_event`, oldest first. Does nothing while this thread
        is inside a call of this cache or a table on it (that call delivers when done), or
        while a delivery is already running (it goes on to the new events)."""
        self._events.deliver()

    _deliver = deliver_events  # what `guarded` runs after a call

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise KvCacheError(f"{what} on a closed PrefixCache: it caches nothing any more")

    def closed(self) -> bool:
        """True once `close()` ran (or the KV cache was released): the cache then holds,
        matches and takes nothing."""
        return self._closed

    # -- lookup and registration -------------------------------------------------------

    def match(self, tokens: Sequence[int], adapter_id: int = 0, cache_salt: str | bytes | None = None,
              extra_keys=None) -> PrefixMatch:
        """The longest cached run of whole blocks at the start of `tokens`; takes one
        reference for the caller on each returned device block (free it like your own,
        once) and refreshes their recency. With a host tier, the run's continuation in host
        blocks is reported too (`host_blocks`, `host_num_tokens`; recency refreshed, not
        held, counted as host hits). On a closed cache, an empty match.

        `cache_salt` (a non-empty str or bytes) is a namespace: only blocks cached under the
        same salt match. `extra_keys`, `(offset, length, key)` ranges of token positions
        (key a str, bytes or int >= 0: an image's content hash over its placeholders, a
        LoRA name), are part of the key of every block they cover, even partly; see
        `pagedkv.sequences.block_keys`."""
        guard = self._guard
        guard.enter()
        try:
            data = int64_bytes_of_ids(tokens) if type(tokens) is list else None
            if data is None:
                tokens = token_ids(tokens, "tokens")  # converts, or raises naming the bad entry
                data = int64_bytes(tokens)
            adapter_id = adapter_id_checked(adapter_id)
            keys = block_keys(adapter_id, cache_salt, extra_keys, self._block_size)
            tiering = self._check_tier()
            path = self._tree.walk_bytes(data, adapter_id if keys is None else keys.root_key, keys)
            path, host_path, disk_path = tiering.split(path) if tiering is not None else (path, [], [])
            blocks = [n.block for n in path]
            self._allocator.inc_refs_of_valid(blocks)
            self._policy.touch(path)
            bs = self._block_size
            self._counters.count_query(len(tokens), len(blocks) * bs, len(host_path) * bs, len(disk_path) * bs)
            if tiering is None:
                found = PrefixMatch(blocks, len(blocks) * bs)
            else:
                tiering.tier.touch([n.lower for n in reversed(host_path)])  # a parent more recent than its child
                found = TieredMatch(blocks, len(blocks) * bs)
                found.host_blocks, found.host_num_tokens = [n.lower for n in host_path], len(host_path) * bs
                disk = self._disk
                if disk is not None:
                    disk.touch(path + host_path + disk_path)
                    found.disk_blocks = [disk.slot_of[n] for n in disk_path]
                    found.disk_num_tokens = len(disk_path) * bs
        finally:
            guard.exit()
        if self._events.pending:  # forgetting a released host tier's blocks
            self.deliver_events()
        return found

    def reserve(self, tokens: Sequence[int], adapter_id: int = 0, cache_salt: str | bytes | None = None,
                extra_keys=None) -> PrefixMatch:
        """`match` in two steps, for a request that may still be refused: the longest cached
        run, with one reference taken for the caller on each block but no statistics or
        recency recorded. Follow it with `confirm` once the request is admitted, or
        `cancel` to hand the references back as if the lookup never happened; either once.
        `cache_salt` and `extra_keys` as for `match`."""
        guard = self._guard
        guard.enter()
        try:
            tokens = token_ids(tokens, "tokens")
            adapter_id = adapter_id_checked(adapter_id)
            keys = block_keys(adapter_id, cache_salt, extra_keys, self._block_size)
            return self._reserve_checked(tokens, len(tokens), adapter_id, keys)
        finally:
            guard.exit()

    def _reserve_checked(self, tokens: list[int], n: int, adapter_id: int, keys: BlockKeys | None = None) -> PrefixMatch:
        """`reserve` of `tokens[:n]`, already validated (the guard held by the caller)."""
        self._check_tier()
        return self._reservation(self._tree.walk(tokens, n, adapter_id if keys is None else keys.root_key, keys))

    def _reserve_bytes(self, data: bytes, adapter_id: int, keys: BlockKeys | None = None) -> PrefixMatch:
        """`reserve` of tokens given as valid int64 bytes (the guard held by the caller)."""
        self._check_tier()
        return self._reservation(self._tree.walk_bytes(data, adapter_id if keys is None else keys.root_key, keys))

    def _reservation(self, whole: list[Node]) -> PrefixMatch:
        tiering = self._tiering
        path, host_path, disk_path = tiering.split(whole) if tiering is not None else (whole, [], [])
        blocks = [node.block for node in path]
        self._allocator.inc_refs_of_valid(blocks)
        found = _Reservation(blocks, len(blocks) * self._block_size)
        found.open, found.path, found.host_path, found.promoted, found.loaded = True, path, host_path, 0, 0
        found.host_blocks = [node.lower for node in host_path]
        found.host_num_tokens = len(host_path) * self._block_size
        found.disk_path = disk_path
        if disk_path:
            found.disk_blocks = [self._disk.slot_of[n] for n in disk_path]
            found.disk_num_tokens = len(disk_path) * self._block_size
        return found

    def _claim(self, found: PrefixMatch, verb: str) -> None:
        if not isinstance(found, _Reservation):
            raise TypeError(f"{verb} takes the result of reserve(), got {type(found).__name__}")
        if not found.open:
            raise RefCountError(
                f"{verb} of a reservation already confirmed or cancelled (blocks {found.blocks}): "
                "a reservation is released once"
            )
        found.open = False

    def confirm(self, queried_tokens: int, found: PrefixMatch) -> None:
        """Record a reserved match of a `queried_tokens`-token query as used: statistics,
        and the recency of its blocks. The caller then holds the references like its own."""
        guard = self._guard
        guard.enter()
        try:
            queried_tokens = non_negative_int(queried_tokens, "queried_tokens")
            self._claim(found, "confirm")
            self._confirm_checked(queried_tokens, found)
        finally:
            guard.exit()

    def _confirm_checked(self, queried_tokens: int, found: _Reservation) -> None:
        self._policy.touch([node for node in found.path if node.block is not None])  # a clear() may have dropped some
        bs = self._block_size
        self._counters.count_query(queried_tokens, found.num_tokens, (found.promoted - found.loaded) * bs,
                                   found.loaded * bs)

    @guarded
    def cancel(self, found: PrefixMatch) -> None:
        """Hand back the references a reserved match took, without counting it as a use:
        statistics and recency stay as they were before `reserve`. A second cancel (or a
        cancel after `confirm`) raises RefCountError and changes nothing."""
        self._claim(found, "cancel")
        self._cancel_checked(found)

    def _cancel_checked(self, found: PrefixMatch) -> None:
        self._refresh_on_release = False
        try:
            self._cache.free_blocks(found.blocks)
        finally:
            self._refresh_on_release = True
