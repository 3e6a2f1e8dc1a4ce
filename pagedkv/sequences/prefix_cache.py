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
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from ..cache import HybridKvCache, PagedKvCache
from ..core.guard import ThreadGuard, guarded
from ..core.log import debug_enabled, get_logger
from ..core.streams import stream_handle
from ..core.validate import block_list, int64_bytes_of_ids, non_negative_int, token_ids, token_ids_and_bytes
from ..errors import KvCacheError, RefCountError
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventQueue, PrefixCacheEvent, stored
from .block_keys import BlockKeys, block_keys
from .eviction import Chosen
from .retention import RetentionApi, RetentionEviction, priority_of
from .vllm_hash import DEFAULT_SCHEME, SCHEMES, VllmHashes, resolve_seed
from .vllm_hash import SCHEME as VLLM_SCHEME
from .hashing import chain_hash, int64_bytes, root_hash
from .hybrid_prefix import HybridPrefixCache
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

_log = get_logger("prefix_cache")


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


class PrefixCache(RetentionApi):
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

    @guarded
    def insert(self, tokens: Sequence[int], blocks: Sequence[int], adapter_id: int = 0,
               cache_salt: str | bytes | None = None, extra_keys=None) -> int:
        """Register the caller's full blocks of `tokens` (`blocks[i]` holds tokens
        `i*block_size ..`; a final partial block is not cached). Chunks already cached keep
        their block; new ones take one reference of the cache's own on the caller's block.
        Returns how many blocks were newly cached. Checked before anything changes;
        KvCacheError on a closed cache. `cache_salt` and `extra_keys` as for `match`."""
        self._check_open("insert")
        adapter_id = adapter_id_checked(adapter_id)
        keys = block_keys(adapter_id, cache_salt, extra_keys, self._block_size)
        tokens, packed = token_ids_and_bytes(tokens, "tokens", copy=False)  # checked and packed once; not kept
        blocks = block_list(blocks, self._cache.num_blocks(), "blocks")  # names a bad entry
        bs = self._block_size
        n_full = len(tokens) // bs
        if not n_full <= len(blocks) <= -(-len(tokens) // bs):
            raise ValueError(f"{len(tokens)} tokens fill {n_full} block(s) of {bs}, but {len(blocks)} blocks were given")
        return self._insert_checked(tokens, blocks, n_full, adapter_id, False, keys, packed)

    def _insert_checked(self, tokens: list[int], blocks: list[int], n_full: int, adapter_id: int, by_block: bool,
                        keys: BlockKeys | None = None, packed: bytes | None = None, hint: list[Node] = ()) -> int:
        """Insert the first `n_full` blocks of valid arguments (the guard held by the caller).
        With `by_block`, the caller vouches that `blocks[i]` holds chunk i, so a block
        already cached under the current node is followed without comparing its tokens,
        and `hint` may name the nodes of `blocks[:len(hint)]` as a walk found them (a
        sequence's matched prefix): taken without a walk while the last of them still
        holds its block (a device node's ancestors are device nodes with their blocks,
        and a block the caller holds is never evicted), else ignored.
        `packed`: the tokens' int64 bytes when the caller has them (else packed here, the
        new part only)."""
        tiering = self._check_tier()
        bs, tree = self._block_size, self._tree
        root_key = adapter_id if keys is None else keys.root_key
        root = tree.roots.get(root_key)
        node, path, data, base = root, [], packed, 0
        if root is not None:
            k = len(hint)
            if by_block and 0 < k <= n_full and self._by_block.get(blocks[k - 1]) is hint[k - 1]:
                node, path, data, base = tree.follow(hint[-1], tokens, blocks, n_full, by_block, keys, packed, hint)
            else:
                node, path, data, base = tree.follow(root, tokens, blocks, n_full, by_block, keys, packed)
        first_new = len(path)
        path, adopt, adopt_disk = tiering.split(path) if tiering is not None else (path, [], [])
        adopt += adopt_disk  # host and disk-only nodes on the way: adopted into the caller's blocks
        index = self._by_block
        new_blocks = blocks[first_new - len(adopt) : n_full]
        if len(set(new_blocks)) != len(new_blocks):
            raise ValueError(f"insert given a block twice: {new_blocks}")
        if not index.keys().isdisjoint(new_blocks):
            block = next(b for b in new_blocks if b in index)
            raise ValueError(f"block {block} is already cached for other tokens")
        try:
            self._cache.inc_refs(new_blocks)  # checks every block is held before any count changes
        except RefCountError as err:
            raise RefCountError(f"insert of a free block: the caller must hold every block it inserts ({err})") from None
        if root is None:
            root = node = tree.root(root_key)
        if adopt:
            tiering.to_device(adopt, new_blocks[: len(adopt)])
            path += adopt
        if path:
            self._policy.touch_chain(path)
        events = self._events
        if adopt and events.consumer is not None:
            events.emit(stored(adopt, tokens[(first_new - len(adopt)) * bs : first_new * bs], new_blocks[: len(adopt)], bs,
                               digest=events.digest))
        new_blocks = new_blocks[len(adopt):]
        if not new_blocks:
            return len(adopt)
        if data is None:
            base = first_new
            data = int64_bytes(tokens[base * bs : n_full * bs])  # one array for the run, not one per block
        made = tree.extend(node, data, first_new - base, new_blocks, keys, base)
        self._policy.touch(made)
        if events.consumer is not None:
            events.emit(stored(made, tokens[first_new * bs : n_full * bs], new_blocks, bs, digest=events.digest))
        return len(adopt) + len(new_blocks)

    # -- eviction ----------------------------------------------------------------------

    def on_sole_reference(self, block: int) -> None:
        """Called by the cache when `block`'s count falls to 1: if it is a cached leaf, it is
        now evictable and this release counts as its latest use."""
        node = self._by_block.get(block)
        if node is not None and not node.n_dev:
            self._policy.released(node, self._refresh_on_release)

    def on_sole_references(self, blocks: list[int]) -> None:
        """`on_sole_reference` of each of `blocks` in order, in one call."""
        get, released, refresh = self._by_block.get, self._policy.released, self._refresh_on_release
        for block in blocks:
            node = get(block)
            if node is not None and not node.n_dev:
                released(node, refresh)

    def _evict_chosen(self, chosen: Chosen) -> list[int]:
        tiering = self._check_tier()
        priorities = [priority_of(node) for _, node in chosen] if self._policy.hints else ()
        if tiering is not None and chosen:
            blocks = tiering.demote(chosen)
            self._counters.evictions += len(blocks)
            self._counters.count_priorities(priorities)
            return blocks
        blocks = [node.block for _, node in chosen]
        hashes = self._events.hashes([node for _, node in chosen]) if self._events.consumer is not None else None
        for block in blocks:
            self._cache.return_evicted_block(block)  # while still cached: the cache's own reference
        remove = self._tree.remove_leaf
        for _, node in chosen:
            remove(node)
        self._counters.evictions += len(blocks)
        self._counters.count_priorities(priorities)
        if blocks:
            if debug_enabled():
                _log.debug("prefix_cache_evicted", blocks=len(blocks))
            if hashes is not None:
                self._events.emit(BlockRemoved(block_hashes=tuple(hashes), block_ids=tuple(blocks)))
        return blocks

    @guarded
    def evict(self, n: int) -> list[int]:
        """Evict up to `n` least-recently-used leaves whose block only the cache holds,
        children before parents (demoted into the host tier when there is one); returns the
        device blocks, now on the free list. A block a sequence still holds is never evicted."""
        return self._evict_chosen(self._policy.select(non_negative_int(n, "number of blocks to evict")))

    def reclaim(self, n: int) -> bool:
        """Evict exactly `n` blocks if that many are evictable, else nothing; True on
        success. The cache calls this when its free list is short, and `deliver_events()`
        once the allocation is complete."""
        guard = self._guard
        guard.enter()
        try:
            chosen = self._policy.select(n)
            if len(chosen) < n:
                self._policy.unselect(chosen)
                return False
            self._evict_chosen(chosen)
            return True
        finally:
            guard.exit()

    # -- the host tier -----------------------------------------------------------------

    def _check_tier(self) -> HostTiering | None:
        """The tiering part while its host tier is live. Once the tier has been released,
        forget every host-resident block (a BlockRemoved on the CPU) and go on as a
        device-only cache (None)."""
        tiering = self._tiering
        if tiering is not None:
            if not tiering.tier.is_live():
                tiering.forget_all()
                self._tiering = tiering = None
                self._disk = None
            elif self._disk is not None:
                if self._disk.disk.is_bound():
                    self._disk.poll()
                else:  # the disk tier was closed first: forget its blocks, go on with two tiers
                    self._disk.forget_all()
                    tiering.disk = self._disk = None
        return tiering

    def host_tier(self) -> "HostTier | None":
        """The host tier evictions demote into, or None. Releasing the tier before the
        prefix cache is allowed: the next call forgets the host-resident blocks (one
        BlockRemoved on the CPU) and the cache goes on device-only."""
        return None if self._tiering is None else self._tiering.tier

    def num_host_blocks(self) -> int:
        """How many blocks the cache holds in the host tier (0 once the tier was released:
        the next call forgets them)."""
        tiering = self._tiering
        return 0 if tiering is None or not tiering.tier.is_live() else len(tiering.by_host)

    def disk_tier(self) -> "DiskTier | None":
        """The disk tier below the host tier, or None. Closing the disk tier before the
        prefix cache is allowed: the next call forgets the disk blocks (the directory keeps
        them) and the cache goes on with two tiers."""
        return None if self._disk is None else self._disk.disk

    def num_disk_blocks(self) -> int:
        """How many cached blocks have a copy in the disk tier (on disk only, or beside a
        device or host block)."""
        return 0 if self._disk is None else self._disk.num_blocks()

    # -- clearing ----------------------------------------------------------------------

    @guarded
    def clear(self) -> None:
        """Forget every cached block, handing back the cache's references (blocks that
        sequences still hold stay with them). A disk tier's directory forgets its blocks too."""
        self._clear_checked()

    def _clear_checked(self, wipe_disk: bool = True) -> None:
        blocks = list(self._by_block)
        for block in blocks:
            self._cache.return_evicted_block(block)  # while still cached: the cache's own reference
        hosts = 0 if self._tiering is None else self._tiering.clear(wipe_disk)
        self._tree.clear()
        self._policy.clear()
        _log.info("prefix_cache_cleared", blocks=len(blocks), host_blocks=hosts)
        if self._events.consumer is not None:
            self._events.emit(AllBlocksCleared())

    @guarded
    def close(self) -> None:
        """`clear()` and detach from the cache, which then allocates without evicting.
        Afterwards the prefix cache takes nothing: `insert` raises, `match` finds nothing,
        and a SequenceTable on it offers nothing. A second call does nothing. A disk tier's
        directory keeps its blocks (for the next process); close the DiskTier after this."""
        if not self._closed:
            self._closed = True
            try:
                self._clear_checked(wipe_disk=False)
            finally:
                if self._tiering is not None:
                    self._tiering.tier.detach_owner(self._guard)
                self._cache.detach_prefix_cache(self)

    # -- introspection -----------------------------------------------------------------

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
