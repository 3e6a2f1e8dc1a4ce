"""PrefixCache: full KV blocks keyed by their exact tokens, so a prompt that starts like an
earlier one reuses that prompt's blocks instead of recomputing them.

A radix tree of whole blocks, one root per adapter (adapters never share). Each node holds
one block and its `block_size` tokens; children are keyed by their exact tokens (int64 little-endian
bytes, also the hash input), so a hash collision can never hand one prompt another prompt's KV. Each node also carries a
chained 64-bit content hash (blake2b of the parent's hash and the tokens: the same on every
machine and process) that events report, for routers that track other engines' caches.

Invariants (checked by `check_invariants`):
- every node holds exactly `block_size` tokens, its key in its parent; no block is cached
  twice; every cached block carries one reference of the cache's own (count >= 1);
- a node's hash is `chain_hash(parent hash, tokens)`; a root's is `root_hash(adapter_id)`.

Eviction takes least-recently-used leaves whose block only the cache holds (count 1), from
a heap of candidates with lazy deletion: a leaf is pushed when it becomes evictable (its
count falls to 1, or its last child is evicted) and checked again when popped, so each
eviction costs O(log n) amortised. A block's "use" is a match, an insert, or the moment its
last other holder released it.

Host tier (`PrefixCache(cache, host_tier=HostTier(...))`): eviction demotes instead of
dropping. The victims of one eviction are copied to host blocks in ONE `swap_out` on
`swap_stream`, and the device blocks go back to the free list only after that swap has
completed (the cache waits for its event: correct first, at the price of a host wait per
eviction batch). A node is then host-resident: same key, same hash, its KV in a host block.
Host blocks are dropped only when the host tier is full, least recently used first (the
tier's LRU). Tree invariants with a tier: every ancestor of a device-resident node is
device-resident (so a match is device blocks, then host blocks); a host node's children are
host-resident; in the tier's LRU a host node is more recent than its host children (so the
oldest is always a leaf). `SequenceTable.add` promotes the host part of its match (device
blocks allocated, ONE `swap_in` on the table's stream, ordered before the sequence's work
there). Events carry `medium`: "GPU" for the device tier (the default), "CPU" for the host.
"""

from __future__ import annotations

import array
import collections
import hashlib
import heapq
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence, Union

import numpy as np

from ..cache.paged_cache import PagedKvCache
from ..errors import KvCacheError, RefCountError
from ..core.guard import ThreadGuard
from ..core.log import get_logger
from ..core.streams import stream_handle
from ..core.validate import block_list, int64_bytes_of_ids, non_negative_int, token_ids

if TYPE_CHECKING:
    from ..tiers.host_tier import HostTier

_log = get_logger("prefix_cache")


def root_hash(adapter_id: int) -> int:
    """The 64-bit hash a root contributes as the parent of an adapter's first blocks."""
    digest = hashlib.blake2b(b"pagedkv-prefix-root" + adapter_id.to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


_HASH_START = hashlib.blake2b(digest_size=8)  # copied per block: cheaper than a constructor


def chain_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    """blake2b-64 of the parent's hash (8 bytes, little-endian) then the tokens (int64
    little-endian): stable across processes and machines."""
    return int.from_bytes(_chain_digest(parent_hash.to_bytes(8, "little"), _int64_bytes(tokens)), "little")


def _chain_digest(parent_digest: bytes, token_bytes: bytes) -> bytes:
    """The 8-byte digest `chain_hash` reads, from the parent's 8 bytes and the tokens' int64 bytes."""
    state = _HASH_START.copy()
    state.update(parent_digest + token_bytes)
    return state.digest()


def _int64_bytes(tokens: Sequence[int]) -> bytes:
    try:
        data = array.array("Q", tokens)  # the same bytes for ids >= 0, and much faster to build than "q"
    except OverflowError:
        data = array.array("q", tokens)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        data.byteswap()
    return data.tobytes()


class PrefixMatch(NamedTuple):
    """The longest cached run of whole blocks: the device blocks (one reference each now
    held by the caller) and how many tokens they cover. With a host tier, `host_blocks`
    continue the run in host memory (not held: `SequenceTable.add` promotes them; they may
    be dropped later) and `host_num_tokens` counts their tokens; otherwise () and 0."""

    blocks: list[int]
    num_tokens: int
    host_blocks = ()
    host_num_tokens = 0


class TieredMatch(PrefixMatch):
    """A PrefixMatch of a prefix cache with a host tier: `host_blocks` (a list of host block
    ids) and `host_num_tokens` are set per match."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks newly cached along one chain: `block_hashes[i]` holds `token_ids[i*block_size:
    (i+1)*block_size]`; `parent_block_hash` is None when the first one starts a prompt."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_size: int
    adapter_id: int
    kind: str = "stored"
    medium: str = "GPU"
    """Where the blocks now live: "GPU" (device blocks) or "CPU" (host-tier blocks)."""


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that left one tier (their hashes, and the block ids freed there): evicted or
    demoted from the device ("GPU"), dropped or promoted from the host tier ("CPU")."""

    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    kind: str = "removed"
    medium: str = "GPU"
    """The tier the blocks left: "GPU" or "CPU"."""


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block was dropped by `clear()`."""

    kind: str = "cleared"


PrefixCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since construction: match calls, tokens asked and found (`hit_tokens`, over
    both tiers), the hit rate (hit / queried tokens, 0.0 before any query), device blocks
    now cached, device blocks evicted (demoted or dropped); per tier: tokens found in device
    blocks and in host blocks, host blocks now cached, blocks demoted to the host tier,
    promoted back, and dropped from it."""

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


class _Node:
    __slots__ = ("key", "block", "hash", "parent", "children", "last_used", "adapter_id", "host", "n_dev")

    def __init__(self, key: bytes, block: int, hash_: int, parent: "_Node | None", adapter_id: int):
        self.key = key  # the block's tokens as int64 little-endian bytes (exact, not a hash)
        self.block = block  # -1 for a root; None once evicted or demoted
        self.host = None  # the host block of a host-resident node
        self.n_dev = 0  # children that are device-resident
        self.hash = hash_
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.last_used = 0
        self.adapter_id = adapter_id


class _Reservation(TieredMatch):
    """A PrefixMatch from `reserve`, remembering whether it is still open (neither
    confirmed nor cancelled), so that it is released only once."""


class PrefixCache:
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

    With `host_tier`, evicted blocks are demoted into it rather than dropped (see the module
    docstring); `num_cached_blocks`, `is_cached`, `block_hash` and `block_references` speak
    of the device tier, `num_host_blocks` of the host tier."""

    def __init__(self, cache: PagedKvCache, on_event: Callable[[PrefixCacheEvent], None] | None = None,
                 host_tier: "HostTier | None" = None, swap_stream: object = 0):
        """`host_tier`: a HostTier of `cache` to demote evicted blocks into (see the module
        docstring); `swap_stream`: the stream demotions are enqueued on, after the work
        already there (give the engine's compute stream)."""
        if not isinstance(cache, PagedKvCache):
            raise TypeError(f"cache must be a PagedKvCache, got {type(cache).__name__}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable, got {on_event!r}")
        if host_tier is not None:
            from ..tiers.host_tier import HostTier

            if not isinstance(host_tier, HostTier):
                raise TypeError(f"host_tier must be a HostTier, got {type(host_tier).__name__}")
            if host_tier.cache() is not cache:
                raise ValueError("host_tier belongs to a different PagedKvCache")
        stream_handle(swap_stream)
        self._tier = host_tier
        self._swap_stream = swap_stream
        self._by_host: dict[int, _Node] = {}
        self._pinned: set[int] = set()  # ids of host nodes a promotion in progress needs
        self._device_hits = self._host_hits = 0
        self._demotions = self._promotions = self._host_drops = 0
        self._cache = cache
        self._block_size = cache.block_size()
        self._key_type = np.dtype(f"V{8 * self._block_size}")  # a block's key: its int64 token bytes
        self._allocator = cache.allocator()
        self._on_event = on_event
        self._events: collections.deque = collections.deque()
        self._delivering = False
        self._guard = ThreadGuard("this PrefixCache")
        self._closed = False
        self._roots: dict[int, _Node] = {}
        self._by_block: dict[int, _Node] = {}
        self._heap: list[tuple[int, int, _Node]] = []
        self._clock = 0
        self._serial = 0
        self._queries = self._queried_tokens = self._hit_tokens = self._evictions = 0
        self._refresh_on_release = True
        cache.attach_prefix_cache(self)

    # -- guard and events --------------------------------------------------------------

    def _emit(self, event: PrefixCacheEvent) -> None:
        self._events.append(event)

    def deliver_events(self) -> None:
        """Hand queued events to `on_event`, oldest first. Does nothing while this thread
        is inside a call of this cache or a table on it (that call delivers when done), or
        while a delivery is already running (it goes on to the new events)."""
        events = self._events
        if not events or self._delivering or self._guard.inside():
            return
        guard = self._guard
        guard.enter()
        self._delivering = True
        guard.exit()
        try:
            while events:
                self._on_event(events.popleft())  # type: ignore[misc]
        finally:
            self._delivering = False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise KvCacheError(f"{what} on a closed PrefixCache: it caches nothing any more")

    def closed(self) -> bool:
        """True once `close()` ran (or the KV cache was released): the cache then holds,
        matches and takes nothing."""
        return self._closed

    # -- lookup and registration -------------------------------------------------------

    def match(self, tokens: Sequence[int], adapter_id: int = 0) -> PrefixMatch:
        """The longest cached run of whole blocks at the start of `tokens`; takes one
        reference for the caller on each returned device block (free it like your own,
        once) and refreshes their recency. With a host tier, the run's continuation in host
        blocks is reported too (`host_blocks`, `host_num_tokens`; recency refreshed, not
        held, counted as host hits). On a closed cache, an empty match."""
        guard = self._guard
        guard.enter()
        try:
            data = int64_bytes_of_ids(tokens) if type(tokens) is list else None
            if data is None:
                tokens = token_ids(tokens, "tokens")  # converts, or raises naming the bad entry
                data = _int64_bytes(tokens)
            adapter_id = adapter_id_checked(adapter_id)
            self._check_tier()
            path, host_path = self._split(self._walk_bytes(data, adapter_id))
            blocks = [n.block for n in path]
            self._allocator.inc_refs_of_valid(blocks)
            clock = self._clock
            for node in path:
                clock += 1
                node.last_used = clock
            self._clock = clock
            bs = self._block_size
            self._count_query(len(tokens), len(blocks) * bs, len(host_path) * bs)
            if self._tier is None:
                found = PrefixMatch(blocks, len(blocks) * bs)
            else:
                self._tier.touch([n.host for n in reversed(host_path)])  # a parent more recent than its child
                found = TieredMatch(blocks, len(blocks) * bs)
                found.host_blocks, found.host_num_tokens = [n.host for n in host_path], len(host_path) * bs
        finally:
            guard.exit()
        if self._events:  # forgetting a released host tier's blocks
            self.deliver_events()
        return found

    def reserve(self, tokens: Sequence[int], adapter_id: int = 0) -> PrefixMatch:
        """`match` in two steps, for a request that may still be refused: the longest cached
        run, with one reference taken for the caller on each block but no statistics or
        recency recorded. Follow it with `confirm` once the request is admitted, or
        `cancel` to hand the references back as if the lookup never happened; either once."""
        guard = self._guard
        guard.enter()
        try:
            tokens = token_ids(tokens, "tokens")
            return self._reserve_checked(tokens, len(tokens), adapter_id_checked(adapter_id))
        finally:
            guard.exit()

    def _reserve_checked(self, tokens: list[int], n: int, adapter_id: int) -> PrefixMatch:
        """`reserve` of `tokens[:n]`, already validated (the guard held by the caller)."""
        self._check_tier()
        return self._reservation(self._walk(tokens, n, adapter_id))

    def _reserve_bytes(self, data: bytes, adapter_id: int) -> PrefixMatch:
        """`reserve` of tokens given as valid int64 bytes (the guard held by the caller)."""
        self._check_tier()
        return self._reservation(self._walk_bytes(data, adapter_id))

    def _reservation(self, whole: list[_Node]) -> PrefixMatch:
        path, host_path = self._split(whole)
        blocks = [node.block for node in path]
        self._allocator.inc_refs_of_valid(blocks)
        found = _Reservation(blocks, len(blocks) * self._block_size)
        found.open, found.path, found.host_path, found.promoted = True, path, host_path, 0
        found.host_blocks = [node.host for node in host_path]
        found.host_num_tokens = len(host_path) * self._block_size
        return found

    def _split(self, path: list[_Node]) -> tuple[list[_Node], list[_Node]]:
        """(device-resident nodes, host-resident nodes) of a path: by the tier invariant the
        device ones come first."""
        if self._tier is None:
            return path, []
        i = 0
        while i < len(path) and path[i].block is not None:
            i += 1
        return path[:i], path[i:]

    def _walk(self, tokens: list[int], n: int, adapter_id: int) -> list[_Node]:
        if n < self._block_size or adapter_id not in self._roots:
            return []
        return self._walk_bytes(_int64_bytes(tokens[: n - n % self._block_size]), adapter_id)

    def _walk_bytes(self, data: bytes, adapter_id: int) -> list[_Node]:
        """The cached nodes along the whole blocks of `data` (int64 token bytes)."""
        node = self._roots.get(adapter_id)
        path: list[_Node] = []
        if node is not None:
            key_type = self._key_type
            for key in np.frombuffer(data, key_type, len(data) // key_type.itemsize).tolist():  # one bytes per block
                node = node.children.get(key)
                if node is None:
                    break
                path.append(node)
        return path

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
        clock = self._clock
        for node in found.path:
            if node.block is not None:  # a clear() since reserve dropped it
                clock += 1
                node.last_used = clock
        self._clock = clock
        self._count_query(queried_tokens, found.num_tokens, found.promoted * self._block_size)

    def _count_query(self, queried_tokens: int, device_hits: int, host_hits: int = 0) -> None:
        self._queries += 1
        self._queried_tokens += queried_tokens
        self._hit_tokens += device_hits + host_hits
        self._device_hits += device_hits
        self._host_hits += host_hits

    def cancel(self, found: PrefixMatch) -> None:
        """Hand back the references a reserved match took, without counting it as a use:
        statistics and recency stay as they were before `reserve`. A second cancel (or a
        cancel after `confirm`) raises RefCountError and changes nothing."""
        guard = self._guard
        guard.enter()
        try:
            self._claim(found, "cancel")
            self._cancel_checked(found)
        finally:
            guard.exit()
        self.deliver_events()

    def _cancel_checked(self, found: PrefixMatch) -> None:
        self._refresh_on_release = False
        try:
            self._cache.free_blocks(found.blocks)
        finally:
            self._refresh_on_release = True

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], adapter_id: int = 0) -> int:
        """Register the caller's full blocks of `tokens` (`blocks[i]` holds tokens
        `i*block_size ..`; a final partial block is not cached). Chunks already cached keep
        their block; new ones take one reference of the cache's own on the caller's block.
        Returns how many blocks were newly cached. Checked before anything changes;
        KvCacheError on a closed cache."""
        guard = self._guard
        guard.enter()
        try:
            self._check_open("insert")
            adapter_id = adapter_id_checked(adapter_id)
            tokens = token_ids(tokens, "tokens")
            blocks = block_list(blocks, self._cache.num_blocks(), "blocks")  # names a bad entry
            bs = self._block_size
            n_full = len(tokens) // bs
            if not n_full <= len(blocks) <= -(-len(tokens) // bs):
                raise ValueError(
                    f"{len(tokens)} tokens fill {n_full} block(s) of {bs}, but {len(blocks)} blocks were given"
                )
            added = self._insert_checked(tokens, blocks, n_full, adapter_id, False)
        finally:
            guard.exit()
        self.deliver_events()
        return added

    def _insert_checked(self, tokens: list[int], blocks: list[int], n_full: int, adapter_id: int, by_block: bool) -> int:
        """Insert the first `n_full` blocks of valid arguments (the guard held by the caller).
        With `by_block`, the caller vouches that `blocks[i]` holds chunk i, so a block
        already cached under the current node is followed without comparing its tokens."""
        self._check_tier()
        bs, step = self._block_size, 8 * self._block_size
        root = self._roots.get(adapter_id)
        node, first_new = root, 0
        path: list[_Node] = []
        data: bytes | None = None  # tokens from block `base` on, as int64 bytes, made when first needed
        base = 0
        adopt: list[_Node] = []  # host-resident nodes on the way: the caller's blocks take them back
        if node is not None:
            index = self._by_block
            while first_new < n_full:
                child = index.get(blocks[first_new]) if by_block else None
                if child is None or child.parent is not node:
                    if data is None:
                        base = first_new
                        data = _int64_bytes(tokens[base * bs : n_full * bs])
                    at = (first_new - base) * step
                    child = node.children.get(data[at : at + step])
                    if child is None:
                        break
                if child.block is None:
                    adopt.append(child)
                else:
                    path.append(child)
                node, first_new = child, first_new + 1
        new_blocks = blocks[first_new - len(adopt) : n_full]
        if len(set(new_blocks)) != len(new_blocks):
            raise ValueError(f"insert given a block twice: {new_blocks}")
        index = self._by_block
        if not index.keys().isdisjoint(new_blocks):
            block = next(b for b in new_blocks if b in index)
            raise ValueError(f"block {block} is already cached for other tokens")
        try:
            self._cache.inc_refs(new_blocks)  # checks every block is held before any count changes
        except RefCountError as err:
            raise RefCountError(f"insert of a free block: the caller must hold every block it inserts ({err})") from None
        if root is None:
            root = node = self._roots[adapter_id] = _Node(b"", -1, root_hash(adapter_id), None, adapter_id)
        if adopt:
            self._to_device(adopt, new_blocks[: len(adopt)])
            path += adopt
        if path:
            self._touch_chain(path)
        if adopt and self._on_event is not None:
            stored = adopt[0].parent
            self._emit(BlockStored(
                block_hashes=tuple(n.hash for n in adopt),
                parent_block_hash=None if stored is root else stored.hash,
                token_ids=tuple(tokens[(first_new - len(adopt)) * bs : first_new * bs]),
                block_ids=tuple(new_blocks[: len(adopt)]), block_size=bs, adapter_id=adapter_id,
            ))
        new_blocks = new_blocks[len(adopt):]
        if not new_blocks:
            return len(adopt)
        parent = node
        parent.n_dev += 1  # the first new child; each later one is the previous one's child
        if data is None:
            base = first_new
            data = _int64_bytes(tokens[base * bs : n_full * bs])  # one array for the run, not one per block
        clock, digest, from_bytes = self._clock, parent.hash.to_bytes(8, "little"), int.from_bytes
        copy_start = _HASH_START.copy
        hashes = []
        for offset, block in enumerate(new_blocks, first_new - base):
            chunk = data[offset * step : (offset + 1) * step]
            state = copy_start()
            state.update(digest + chunk)
            digest = state.digest()
            child = _Node(chunk, block, from_bytes(digest, "little"), parent, adapter_id)
            child.n_dev = 1
            parent.children[chunk] = child
            index[block] = child
            clock += 1
            child.last_used = clock
            hashes.append(child.hash)
            parent = child
        parent.n_dev = 0  # the last new node has no children
        self._clock = clock
        if self._on_event is not None:
            self._emit(
                BlockStored(
                    block_hashes=tuple(hashes),
                    parent_block_hash=None if node is root else node.hash,
                    token_ids=tuple(tokens[first_new * bs : n_full * bs]),
                    block_ids=tuple(new_blocks),
                    block_size=bs,
                    adapter_id=adapter_id,
                )
            )
        return len(adopt) + len(new_blocks)

    def _touch_chain(self, path: list[_Node]) -> None:
        """Record a use of each node of `path` (a chain from the root, in order); only its
        last node can be a leaf, which becomes evictable if the cache alone holds it."""
        clock = self._clock
        for node in path:
            clock += 1
            node.last_used = clock
        self._clock = clock
        last = path[-1]
        if not last.n_dev and self._allocator.ref_count(last.block) == 1:
            self._push(last)

    # -- eviction ----------------------------------------------------------------------

    def on_sole_reference(self, block: int) -> None:
        """Called by the cache when `block`'s count falls to 1: if it is a cached leaf, it is
        now evictable and this release counts as its latest use."""
        node = self._by_block.get(block)
        if node is not None and not node.n_dev:
            if self._refresh_on_release:
                self._clock += 1
                node.last_used = self._clock
            self._push(node)

    def on_sole_references(self, blocks: list[int]) -> None:
        """`on_sole_reference` of each of `blocks` in order, in one call."""
        get = self._by_block.get
        for block in blocks:
            node = get(block)
            if node is not None and not node.n_dev:
                if self._refresh_on_release:
                    self._clock += 1
                    node.last_used = self._clock
                self._push(node)

    def _push(self, node: _Node) -> None:
        heap = self._heap
        if len(heap) > 2 * len(self._by_block) + 64:
            self._rebuild_heap()
        self._serial += 1
        heapq.heappush(self._heap, (node.last_used, self._serial, node))

    def _rebuild_heap(self) -> None:
        """Drop stale entries: keep one per currently evictable leaf."""
        ref_count = self._cache.ref_count
        entries = []
        for node in self._by_block.values():
            if not node.n_dev and ref_count(node.block) == 1:
                self._serial += 1
                entries.append((node.last_used, self._serial, node))
        heapq.heapify(entries)
        self._heap = entries

    def _select(self, limit: int) -> list[tuple[int, _Node]]:
        """Pop up to `limit` victims in eviction order, children before parents, without
        changing the tree; each comes with its stamp so `_unselect` can push it back."""
        heap, ref_count = self._heap, self._cache.ref_count
        chosen: list[tuple[int, _Node]] = []
        chosen_ids: set[int] = set()
        gone_children: dict[int, int] = {}
        while heap and len(chosen) < limit:
            stamp, _, node = heapq.heappop(heap)
            if (
                node.block is None
                or stamp != node.last_used
                or id(node) in chosen_ids
                or node.n_dev != gone_children.get(id(node), 0)
                or ref_count(node.block) != 1
            ):
                continue  # stale: used, grown, re-held or evicted since it was pushed
            chosen.append((stamp, node))
            chosen_ids.add(id(node))
            parent = node.parent
            if parent.block != -1:
                gone = gone_children[id(parent)] = gone_children.get(id(parent), 0) + 1
                if gone == parent.n_dev and ref_count(parent.block) == 1:
                    self._serial += 1
                    heapq.heappush(heap, (parent.last_used, self._serial, parent))
        return chosen

    def _unselect(self, chosen: list[tuple[int, _Node]]) -> None:
        for stamp, node in chosen:
            self._serial += 1
            heapq.heappush(self._heap, (stamp, self._serial, node))

    def _evict_chosen(self, chosen: list[tuple[int, _Node]]) -> list[int]:
        self._check_tier()
        if self._tier is not None and chosen:
            return self._demote(chosen)
        blocks, hashes = [], []
        for _, node in chosen:
            blocks.append(node.block)
            hashes.append(node.hash)
        for block in blocks:
            self._cache.return_evicted_block(block)  # while still cached: the cache's own reference
        for _, node in chosen:
            del node.parent.children[node.key]
            node.parent.n_dev -= 1
            del self._by_block[node.block]
            node.block = None
        self._evictions += len(blocks)
        if blocks:
            _log.debug("prefix_cache_evicted", blocks=len(blocks))
            if self._on_event is not None:
                self._emit(BlockRemoved(block_hashes=tuple(hashes), block_ids=tuple(blocks)))
        return blocks

    # -- the host tier -----------------------------------------------------------------

    def _demote(self, chosen: list[tuple[int, _Node]]) -> list[int]:
        """Evict the chosen device leaves into the host tier: room is made by dropping the
        tier's least recently used leaves, then ONE swap_out copies the victims, and the
        device blocks return to the free list once it has completed. Victims the tier has
        no room for (every host block pinned) are dropped, deepest first, with their host
        subtrees. A swap error unselects the victims and propagates: no device block changed."""
        tier, nodes = self._tier, [node for _, node in chosen]  # children before parents
        short = len(nodes) - tier.num_free_blocks()
        if short > 0:
            self._drop_host(short)
        room = min(len(nodes), tier.num_free_blocks())
        dropped, demoted = nodes[: len(nodes) - room], nodes[len(nodes) - room :]
        hosts = tier.alloc(len(demoted))
        try:
            tier.swap_out([n.block for n in demoted], hosts, self._swap_stream).wait()
        except BaseException:
            tier.free(hosts)
            self._unselect(chosen)
            raise
        blocks = [n.block for n in nodes]
        for block in blocks:
            self._cache.return_evicted_block(block)  # while still cached: the cache's own reference
        for node in dropped:
            self._drop_host_subtree(node)
            del node.parent.children[node.key]
            node.parent.n_dev -= 1
            del self._by_block[node.block]
            node.block = None
        for node, host in zip(demoted, hosts):
            node.parent.n_dev -= 1
            del self._by_block[node.block]
            node.block, node.host = None, host
            self._by_host[host] = node
        tier.touch(hosts)  # children were chosen before parents: a parent is the more recent
        self._evictions += len(blocks)
        self._demotions += len(demoted)
        _log.debug("prefix_cache_demoted", blocks=len(demoted), dropped=len(dropped))
        if self._on_event is not None:
            self._emit(BlockRemoved(block_hashes=tuple(n.hash for n in nodes), block_ids=tuple(blocks)))
            for node, host in zip(demoted, hosts):
                parent = node.parent
                self._emit(BlockStored(
                    block_hashes=(node.hash,), parent_block_hash=None if parent.block == -1 else parent.hash,
                    token_ids=tuple(np.frombuffer(node.key, "<i8").tolist()), block_ids=(host,),
                    block_size=self._block_size, adapter_id=node.adapter_id, medium="CPU",
                ))
        return blocks

    def _drop_host(self, n: int) -> None:
        """Drop up to `n` host-resident leaves, least recently used first (pinned ones kept)."""
        gone: list[_Node] = []
        by_host, pinned = self._by_host, self._pinned
        for host in self._tier.oldest():  # the LRU is left alone until the loop is done
            if len(gone) == n:
                break
            node = by_host[host]
            if node.children or id(node) in pinned:
                continue
            del node.parent.children[node.key]  # its parent, more recent, comes later in the LRU
            gone.append(node)
        self._forget_host(gone)

    def _drop_host_subtree(self, node: _Node) -> None:
        """Drop every host-resident descendant of `node` (whose device children are gone)."""
        gone, stack = [], list(node.children.values())
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            gone.append(child)
        node.children.clear()
        self._forget_host(gone)

    def _forget_host(self, nodes: list[_Node]) -> None:
        if not nodes:
            return
        hosts = [n.host for n in nodes]
        for node in nodes:
            del self._by_host[node.host]
            node.host = None
        self._tier.free(hosts)
        self._host_drops += len(nodes)
        if self._on_event is not None:
            self._emit(BlockRemoved(block_hashes=tuple(n.hash for n in nodes), block_ids=tuple(hosts), medium="CPU"))

    def _to_device(self, nodes: list[_Node], blocks: list[int], after=None) -> None:
        """Make host-resident `nodes` (a chain, parent first) device-resident in `blocks`
        (held by the caller, who adds the cache's reference); their host blocks are freed
        once `after` (the swap reading them, if any) is done. An error polling `after`
        propagates with nothing changed."""
        hosts = [n.host for n in nodes]
        self._tier.free(hosts, after=after)  # first: if polling `after` fails, nothing has changed
        for node, block in zip(nodes, blocks):
            del self._by_host[node.host]
            node.host, node.block = None, block
            self._by_block[block] = node
            node.parent.n_dev += 1
        if self._on_event is not None:
            self._emit(BlockRemoved(block_hashes=tuple(n.hash for n in nodes), block_ids=tuple(hosts), medium="CPU"))

    def _check_tier(self) -> None:
        """Once the host tier has been released, forget every host-resident block (a
        BlockRemoved on the CPU) and go on as a device-only cache."""
        tier = self._tier
        if tier is None or tier.is_live():
            return
        self._tier = None
        nodes = list(self._by_host.values())
        for node in nodes:
            node.parent.children.pop(node.key, None)
        hosts = list(self._by_host)
        for node in nodes:
            node.host = None
        self._by_host.clear()
        self._pinned.clear()
        self._host_drops += len(nodes)
        if nodes and self._on_event is not None:
            self._emit(BlockRemoved(block_hashes=tuple(n.hash for n in nodes), block_ids=tuple(hosts), medium="CPU"))

    def _pin(self, found: PrefixMatch) -> None:
        """Keep a reservation's host part from being dropped until `_unpin`."""
        self._pinned.update(id(n) for n in getattr(found, "host_path", ()))

    def _unpin(self, found: PrefixMatch) -> None:
        self._pinned.difference_update(id(n) for n in getattr(found, "host_path", ()))

    def _promote(self, found: PrefixMatch, blocks: list[int], gpu: object, stream: object, wait: bool) -> None:
        """Bring a reservation's host part into `blocks` (fresh device blocks the caller
        holds, one per host node): ONE swap_in on `stream`, then the nodes are device-resident
        with the cache's reference on `blocks`, and the reservation covers them. A swap error
        propagates with nothing changed. With `wait`, the host waits for the copy."""
        nodes = found.host_path
        tier = self._tier
        if gpu is not None and gpu is not tier.gpu():
            raise ValueError("the sequence table's backend is not the host tier's")
        handle = tier.swap_in([n.host for n in nodes], blocks, stream)
        if wait:
            handle.wait()
        self._to_device(nodes, blocks, after=handle)
        self._cache.inc_refs(blocks)  # after the step that can fail: the caller frees `blocks` once
        self._unpin(found)
        found.path = found.path + nodes
        found.promoted = len(nodes)
        self._promotions += len(nodes)
        if self._on_event is not None:
            parent = nodes[0].parent
            bs = self._block_size
            self._emit(BlockStored(
                block_hashes=tuple(n.hash for n in nodes),
                parent_block_hash=None if parent.block == -1 else parent.hash,
                token_ids=tuple(np.frombuffer(b"".join(n.key for n in nodes), "<i8").tolist()),
                block_ids=tuple(blocks), block_size=bs, adapter_id=nodes[0].adapter_id,
            ))

    def host_tier(self) -> "HostTier | None":
        """The host tier evictions demote into, or None. Releasing the tier before the
        prefix cache is allowed: the next call forgets the host-resident blocks (one
        BlockRemoved on the CPU) and the cache goes on device-only."""
        return self._tier

    def num_host_blocks(self) -> int:
        """How many blocks the cache holds in the host tier."""
        return len(self._by_host)

    def evict(self, n: int) -> list[int]:
        """Evict up to `n` least-recently-used leaves whose block only the cache holds,
        children before parents (demoted into the host tier when there is one); returns the
        device blocks, now on the free list. A block a sequence still holds is never evicted."""
        guard = self._guard
        guard.enter()
        try:
            evicted = self._evict_chosen(self._select(non_negative_int(n, "number of blocks to evict")))
        finally:
            guard.exit()
        self.deliver_events()
        return evicted

    def reclaim(self, n: int) -> bool:
        """Evict exactly `n` blocks if that many are evictable, else nothing; True on
        success. The cache calls this when its free list is short, and `deliver_events()`
        once the allocation is complete."""
        guard = self._guard
        guard.enter()
        try:
            chosen = self._select(n)
            if len(chosen) < n:
                self._unselect(chosen)
                return False
            self._evict_chosen(chosen)
            return True
        finally:
            guard.exit()

    def clear(self) -> None:
        """Forget every cached block, handing back the cache's references (blocks that
        sequences still hold stay with them)."""
        guard = self._guard
        guard.enter()
        try:
            self._clear_checked()
        finally:
            guard.exit()
        self.deliver_events()

    def _clear_checked(self) -> None:
        blocks = list(self._by_block)
        for block in blocks:
            self._cache.return_evicted_block(block)  # while still cached: the cache's own reference
        for node in self._by_block.values():
            node.block = None
        hosts = list(self._by_host)
        if hosts and self._tier.is_live():
            self._tier.free(hosts)
        for node in self._by_host.values():
            node.host = None
        self._by_host.clear()
        self._pinned.clear()
        self._roots.clear()
        self._by_block.clear()
        self._heap = []
        _log.info("prefix_cache_cleared", blocks=len(blocks), host_blocks=len(hosts))
        if self._on_event is not None:
            self._emit(AllBlocksCleared())

    def close(self) -> None:
        """`clear()` and detach from the cache, which then allocates without evicting.
        Afterwards the prefix cache takes nothing: `insert` raises, `match` finds nothing,
        and a SequenceTable on it offers nothing. A second call does nothing."""
        guard = self._guard
        guard.enter()
        try:
            if not self._closed:
                self._closed = True
                try:
                    self._clear_checked()
                finally:
                    self._cache.detach_prefix_cache(self)
        finally:
            guard.exit()
        self.deliver_events()

    # -- introspection -----------------------------------------------------------------

    def stats(self) -> PrefixCacheStats:
        """Counters since construction (see PrefixCacheStats)."""
        rate = self._hit_tokens / self._queried_tokens if self._queried_tokens else 0.0
        return PrefixCacheStats(
            queries=self._queries,
            queried_tokens=self._queried_tokens,
            hit_tokens=self._hit_tokens,
            hit_rate=rate,
            cached_blocks=len(self._by_block),
            evictions=self._evictions,
            device_hit_tokens=self._device_hits,
            host_hit_tokens=self._host_hits,
            host_cached_blocks=len(self._by_host),
            demotions=self._demotions,
            promotions=self._promotions,
            host_evictions=self._host_drops,
        )

    def num_cached_blocks(self) -> int:
        """How many blocks the cache holds."""
        return len(self._by_block)

    def is_cached(self, block: int) -> bool:
        """True when `block` is in the cache."""
        return block in self._by_block

    def block_hash(self, block: int) -> int:
        """The chained content hash of a cached block; KeyError when it is not cached."""
        node = self._by_block.get(block)
        if node is None:
            raise KeyError(f"block {block} is not in the prefix cache")
        return node.hash

    def block_references(self) -> dict[int, int]:
        """block -> references the prefix cache holds (1 per cached block)."""
        return dict.fromkeys(self._by_block, 1)

    def check_invariants(self) -> None:
        """Raise KvCacheError if the tree, the block index and the counts disagree: every
        node has `block_size` tokens under its own key and a correct chained hash, no block
        is cached twice, every cached block holds count >= 1 (O(cached blocks))."""
        self._check_tier()
        seen = 0
        rank = self._lru_rank() if self._tier is not None else {}
        for adapter_id, root in self._roots.items():
            if root.hash != root_hash(adapter_id) or root.block != -1:
                raise KvCacheError(f"root of adapter {adapter_id} is corrupt")
            stack = [root]
            while stack:
                parent = stack.pop()
                if parent.n_dev != sum(c.block is not None for c in parent.children.values()):
                    raise KvCacheError(f"prefix tree node of block {parent.block} miscounts its device children")
                for key, node in parent.children.items():
                    seen += 1
                    if node.parent is not parent or node.key != key or len(key) != 8 * self._block_size:
                        raise KvCacheError(f"prefix tree node for block {node.block} is misplaced")
                    if node.adapter_id != adapter_id:
                        raise KvCacheError(f"block {node.block} sits under adapter {adapter_id}'s root")
                    if node.hash != int.from_bytes(_chain_digest(parent.hash.to_bytes(8, "little"), key), "little"):
                        raise KvCacheError(f"block {node.block} carries a wrong hash {node.hash:#x}")
                    if node.block is None:
                        self._check_host_node(node, rank)
                    else:
                        if parent.block is None:
                            raise KvCacheError(f"device block {node.block} sits under a host-resident node")
                        if self._by_block.get(node.block) is not node:
                            raise KvCacheError(f"block {node.block} is in the tree but not indexed")
                        if self._cache.ref_count(node.block) < 1:
                            raise RefCountError(f"cached block {node.block} has count 0")
                    stack.append(node)
        if seen != len(self._by_block) + len(self._by_host):
            raise KvCacheError(f"{len(self._by_block)} device and {len(self._by_host)} host blocks indexed but {seen} in the tree")
        if self._tier is not None and self._tier.num_cached_blocks() != len(self._by_host):
            raise KvCacheError(f"the host tier's LRU holds {self._tier.num_cached_blocks()} blocks, the tree {len(self._by_host)}")

    def _check_host_node(self, node: _Node, rank: dict[int, int]) -> None:
        tier = self._tier
        if tier is None or node.host is None or self._by_host.get(node.host) is not node:
            raise KvCacheError(f"a node with neither a device nor an indexed host block (host {node.host})")
        if not tier.is_cached(node.host):
            raise KvCacheError(f"host block {node.host} is in the tree but not in the host tier's LRU")
        parent = node.parent
        if parent.block is None:
            if rank[parent.host] < rank[node.host]:
                raise KvCacheError(f"host block {parent.host} is older than its child {node.host} in the LRU")

    def _lru_rank(self) -> dict[int, int]:
        return {host: i for i, host in enumerate(self._tier.lru_blocks())}


def adapter_id_checked(adapter_id: object) -> int:
    """`adapter_id` if it is a non-negative int (0 = base model), else ValueError naming it."""
    return non_negative_int(adapter_id, "adapter_id")
