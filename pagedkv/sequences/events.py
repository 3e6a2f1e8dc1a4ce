"""The prefix cache's KV events and the queue that delivers them.

Events are queued while an operation runs and handed to the consumer only once it is
complete (never from inside it): `EventQueue.deliver` runs at the end of a public call of
the prefix cache or a table on it, or after an allocation that evicted. Every event carries
`seq`, its prefix cache's event number (1, 2, 3, ... in emission order, so a consumer sees a
gap as a lost event) and `medium` where blocks are concerned; a hybrid prefix cache's events
also carry the group index (`group_idx`, with the group's kind and window on stores).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, Union

from ..core.guard import ThreadGuard
from .block_keys import node_extra_keys


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
    seq: int = field(default=0, compare=False)
    """The event's number in its prefix cache (from 1, no gaps; not part of equality)."""
    extra_keys: tuple | None = None
    """Per block, the tuple of its extra keys where vLLM places them (the `extra_keys`
    covering it in the given order, then the cache salt on a prompt's first block), or
    None for a block with none; None for the whole event when no block has any."""
    group_idx: int | None = None
    """The layer group the blocks belong to (a hybrid cache's group index); None for a
    cache without groups. On the wire: vLLM's `group_idx`."""
    kv_cache_spec_kind: str | None = None
    """The group's kind as vLLM names it: "full_attention", "sliding_window" or "mamba" (a
    state group); None without groups."""
    kv_cache_spec_sliding_window: int | None = None
    """A sliding group's window in tokens; else None."""


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that left one tier (their hashes, and the block ids freed there): evicted or
    demoted from the device ("GPU"), dropped or promoted from the host tier ("CPU")."""

    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    kind: str = "removed"
    medium: str = "GPU"
    """The tier the blocks left: "GPU" or "CPU"."""
    seq: int = field(default=0, compare=False)
    """The event's number in its prefix cache (from 1, no gaps; not part of equality)."""
    group_idx: int | None = None
    """The layer group the blocks belonged to (None for a cache without groups)."""


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block was dropped by `clear()`."""

    kind: str = "cleared"
    seq: int = field(default=0, compare=False)
    """The event's number in its prefix cache (from 1, no gaps; not part of equality)."""


PrefixCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def stored(nodes: Sequence, token_ids: Iterable[int], block_ids: Iterable[int], block_size: int,
           medium: str = "GPU", digest: Callable | None = None) -> BlockStored:
    """The BlockStored of `nodes`, a chain of tree nodes (parent first) now held in
    `block_ids` of `medium`; the parent hash is None when the chain starts at a root.
    `digest(node)`, when given, is the hash scheme's hash (else `node.hash`)."""
    parent = nodes[0].parent
    step = 8 * block_size
    extra = None
    if parent.block == -1 and parent.key or any(len(n.key) != step for n in nodes):
        extra = tuple(node_extra_keys(n, block_size) for n in nodes)
    return BlockStored(
        block_hashes=tuple(n.hash for n in nodes) if digest is None else tuple(map(digest, nodes)),
        parent_block_hash=None if parent.block == -1 else parent.hash if digest is None else digest(parent),
        token_ids=tuple(token_ids),
        block_ids=tuple(block_ids),
        block_size=block_size,
        adapter_id=nodes[0].adapter_id,
        medium=medium,
        extra_keys=extra,
    )


class EventQueue:
    """Events waiting for `consumer` (None: no consumer, and callers build no events; check
    `consumer is not None` before making one). `pending` is the queue, oldest first."""

    __slots__ = ("consumer", "pending", "_delivering", "_guard", "seq", "digest")

    def __init__(self, consumer: Callable[[PrefixCacheEvent], None] | None, guard: ThreadGuard):
        self.consumer = consumer
        self.pending: collections.deque = collections.deque()
        self._delivering = False
        self._guard = guard
        self.seq = 0  # the number of the latest event emitted
        self.digest: Callable | None = None  # node -> its hash under another scheme (None: node.hash)

    def hashes(self, nodes: Iterable) -> tuple:
        """The hashes events report for `nodes`: `node.hash`, or the scheme's digest."""
        digest = self.digest
        return tuple(n.hash for n in nodes) if digest is None else tuple(map(digest, nodes))

    def emit(self, event: PrefixCacheEvent) -> None:
        """Number `event` (the next `seq`) and queue it for the next delivery."""
        self.seq += 1
        object.__setattr__(event, "seq", self.seq)  # frozen for consumers; numbered once, here
        self.pending.append(event)

    def deliver(self) -> None:
        """Hand queued events to the consumer, oldest first. Does nothing while this thread
        is inside a guarded call (that call delivers when done; a lone PagedKvCache call
        delivers from within, as the allocator's own delivery expects), or while a delivery is
        already running (it goes on to the new events). If the consumer raises, the raising
        event is consumed and later ones stay queued."""
        events = self.pending
        if not events or self._delivering or (self._guard.inside() and not self._guard.only_lent()):
            return
        guard = self._guard
        guard.enter()
        self._delivering = True
        guard.exit()
        try:
            while events:
                self.consumer(events.popleft())  # type: ignore[misc]
        finally:
            self._delivering = False
