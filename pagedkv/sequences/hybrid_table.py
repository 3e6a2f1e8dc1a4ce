"""HybridSequenceTable: per-sequence block lists, state slots and checkpoints over the groups
of a `HybridKvCache`. `SequenceTable(cache, ...)` builds one for a hybrid cache.

Per attention group a sequence holds its own blocks (ids of that group): a full group every
block of its tokens, a sliding group only the blocks that intersect its last `window`
tokens (older ones are released as it grows, offered first to the prefix cache when their
KV was written and their tokens are known), so at most `ceil(window / block_size) + 1`.
Per state group it owns one live slot (zeroed at `add`, or copied from the matched
checkpoint; copied on `fork`). With a prefix cache, a step (`add`/`append`) is given a
checkpoint slot per state group at every checkpoint position it reaches: each multiple of
`checkpoint_every`, and for `add` the end of the prompt's last whole match unit and the
branch point (`step_checkpoints`; `checkpoint_slots` exports the deepest); `cache_prefix`
and `free` hand them to the prefix cache with the blocks. Checkpoint slots are best effort:
when the state pool has no free or evictable slot left, the step keeps the deepest
positions it can get, skips the others (`skipped_checkpoints()` counts them) and succeeds,
so an undersized pool costs hits, never a failed decode step. `compute_num_blocks` sizes
the pool so that this does not happen (`GroupLayout.checkpoints_per_sequence`).

The branch point: where an added prompt leaves a chain the prefix cache holds, further than
it hits (`HybridMatch.shared_tokens`), as a second conversation leaves the first one's
system prompt. The add step is given, besides a checkpoint there, the sliding blocks that
cover the window before it (outside the window the sequence holds, so the hold bound is
kept); the engine's prefill writes them (`slot_mapping` maps their positions) and they go to
the prefix cache at the sequence's next `append`, `cache_prefix` or `free`, so the next prompt
with that start hits there.

A step attends to the window before each of its positions, so a step of several tokens (a
prefill, a chunk) reads blocks the window after it no longer needs: an `add` keeps the
matched sliding blocks before its hit, an `append` of several tokens the released blocks
from `old + 1 - window`, until the sequence's next step (`step_blocks` lists every block a
step may read or write; `blocks` and `block_table` only those the window holds). A decode
step of one token reads exactly its window, so the bound holds between steps.
`append_decode(seq_ids, token_ids)` makes a whole decode step in one call (as the per-call
appends would, but for the order of a sliding group's releases: its docstring).

All-or-nothing like `SequenceTable`: on any error every count is as it was (cached entries
evicted to make room stay evicted). Without a backend, copies are left to the engine:
`take_pending_copies()` returns `(group, src, dst)` triples (blocks of an attention group,
slots of a state group).

This module holds the class, its construction, the pending copies and the swap calls; the
rest is mixed in: the allocation helpers (`hybrid_alloc`), `add` and `fork`
(`hybrid_add`), `append` with its planned steps (`hybrid_append`), `append_decode`
(`hybrid_decode_step`), the offers to the prefix cache with `free` and `cache_prefix`
(`hybrid_offers`) and the queries and exports with `check_invariants`
(`hybrid_table_queries`); the records are in `hybrid_records`.
"""

from __future__ import annotations

from typing import Any, Hashable

from ..backends.protocol import GpuBackend
from ..cache.hybrid_cache import HybridKvCache
from ..core.guard import ThreadGuard, guarded
from ..core.streams import stream_handle
from ..errors import KvCacheError
from ..tiers.hybrid_host_tier import check_tier_of
from . import hybrid_swap
from .exports import ExportBuffers, SequenceQueries
from .hybrid_add import HybridAdd
from .hybrid_alloc import HybridAllocation
from .hybrid_append import HybridAppend
from .hybrid_decode_step import HybridDecodeStep
from .hybrid_offers import HybridOffers
from .hybrid_prefix import HybridMatch, HybridPrefixCache
from .hybrid_records import _HSeq
from .hybrid_swap import ParkedSequence
from .hybrid_table_queries import HybridTableQueries


class HybridSequenceTable(HybridAdd, HybridAppend, HybridDecodeStep, HybridOffers, HybridAllocation,
                          HybridTableQueries, SequenceQueries):
    """Sequences over a hybrid cache; see the module docstring and `SequenceTable`."""

    def __init__(self, cache: HybridKvCache, prefix_cache: HybridPrefixCache | None = None,
                 gpu: GpuBackend | None = None, stream: int = 0):
        if not isinstance(cache, HybridKvCache):
            raise TypeError(f"cache must be a HybridKvCache, got {type(cache).__name__}")
        if prefix_cache is not None:
            if not isinstance(prefix_cache, HybridPrefixCache):
                raise TypeError(f"prefix_cache must be a PrefixCache of a hybrid cache, got {type(prefix_cache).__name__}")
            if prefix_cache.cache() is not cache:
                raise ValueError("prefix_cache is attached to a different cache")
            tier = prefix_cache.host_tier()
            if tier is not None and gpu is not None and gpu is not tier.group(0).gpu():
                raise ValueError("gpu is not the backend of the prefix cache's host tier")
        stream_handle(stream)
        layout = cache.layout()
        self._cache, self._layout, self._prefix = cache, layout, prefix_cache
        self._groups = [cache.group(g) for g in range(layout.num_groups())]
        self._gpu, self._stream = gpu, stream
        self._attn, self._states = layout.attention_groups(), layout.state_groups()
        self._bs = {g: layout.block_size(g) for g in self._attn}
        self._window = {g: layout.groups[g].window for g in self._attn}
        self._unit = layout.unit
        self._hash_unit = min(self._bs.values())  # the prefix cache's trie unit: extra keys are kept at it
        self._every = {g: layout.groups[g].checkpoint_every for g in self._states}
        self._skipped = dict.fromkeys(self._states, 0)  # checkpoints skipped for want of a slot
        self._seqs: dict[Hashable, _HSeq] = {}
        self._pending: list[tuple[int, int, int]] = []
        self._pending_refs: list[tuple[int, int]] = []
        self._exports = ExportBuffers(gpu, stream)
        self._guard = prefix_cache._guard if prefix_cache is not None else ThreadGuard("this SequenceTable")

    def _deliver(self) -> None:
        if self._prefix is not None:
            self._prefix.deliver_events()

    def _get(self, seq_id: Hashable) -> _HSeq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq

    @guarded
    def take_pending_copies(self) -> list[tuple[int, int, int]]:
        """`(group, src, dst)` copies a table without a backend could not perform (attention
        blocks: `cache.group(g).copy_blocks`; state slots: `cache.copy_state`); the engine
        must perform them before its next step. Returns and forgets them (and the references
        that kept matched checkpoints alive until now)."""
        pairs, self._pending = self._pending, []
        refs, self._pending_refs = self._pending_refs, []
        for g, slot in refs:
            self._cache.group(g).free_blocks([slot])
        return pairs

    @guarded
    def swap_out(self, seq_id: Hashable, tier, stream: Any = None) -> ParkedSequence:
        """Park the sequence in `tier` (the cache's `HybridHostTier`): every group's blocks,
        its live state slot and pending checkpoints copied in one swap on `stream` (the
        table's by default), then released; see `pagedkv.sequences.hybrid_swap`."""
        self._check_swap(tier)
        return hybrid_swap.swap_out(self, seq_id, tier, self._stream if stream is None else stream)

    @guarded
    def swap_in(self, parked: ParkedSequence, stream: Any = None) -> None:
        """Bring a parked sequence back under its id, in fresh blocks and slots of every
        group (one swap on `stream`, the table's by default); see `hybrid_swap`."""
        if isinstance(parked, ParkedSequence):
            self._check_swap(parked.tier)
        hybrid_swap.swap_in(self, parked, self._stream if stream is None else stream)

    def _check_swap(self, tier) -> None:
        check_tier_of(tier, self._cache)
        if self._gpu is None:
            raise KvCacheError("swap_out / swap_in need a table with a backend (SequenceTable(cache, prefix, gpu))")

    def label(self) -> str:
        """A short name for teardown messages."""
        return f"HybridSequenceTable({len(self._seqs)} sequences)"

    @guarded
    def release(self, gpu: GpuBackend | None = None) -> None:
        """Free the export buffers (see `SequenceTable.release`)."""
        self._exports.release(gpu)


__all__ = ["HybridMatch", "HybridSequenceTable"]
