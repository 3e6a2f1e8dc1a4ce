"""What a sequence of `HybridSequenceTable` hands the prefix cache: a sliding group's
released and branch-point blocks (`_release_extra`, `_offer_released`), its written, known
blocks and its checkpoints (`_offer`), at `cache_prefix` and at `free`.
"""

from __future__ import annotations

from typing import Hashable

from ..core.guard import guarded
from .hybrid_records import _HSeq


class HybridOffers:
    """Mixed into `HybridSequenceTable` (it sets `_cache`, `_groups`, `_prefix`, `_seqs`,
    `_attn`, `_states`, `_bs`; `_free_slots` comes from `HybridAllocation`, `_get` from the
    table)."""

    def _release_extra(self, seq: _HSeq, g: int, written: int) -> None:
        """Offer (what of it is written) and free a sliding group's branch-point blocks."""
        held = seq.held[g]
        if held.extra:
            extra, held.extra = held.extra, {}
            prefix, bs = self._prefix, self._bs[g]
            if prefix is not None and not prefix.closed():
                known = min(len(seq.tokens), written)
                pairs = [((i + 1) * bs, b) for i, b in sorted(extra.items()) if (i + 1) * bs <= known]
                if pairs:
                    prefix.store(seq.tokens, seq.adapter_id, {g: pairs}, keys=seq.keys)
            self._groups[g].free_blocks(list(extra.values()))

    def _offer_released(self, seq: _HSeq, g: int, first: int, blocks: list[int], written: int) -> None:
        """Offer a sliding group's released blocks whose KV was written (end <= `written`)
        and whose tokens are known, before they are freed."""
        prefix = self._prefix
        if prefix is None or prefix.closed():
            return
        bs, known = self._bs[g], min(len(seq.tokens), written)
        pairs = [((i + 1) * bs, b) for i, b in enumerate(blocks, first) if (i + 1) * bs <= known]
        if pairs:
            prefix.store(seq.tokens, seq.adapter_id, {g: pairs}, keys=seq.keys)

    def _offer(self, seq: _HSeq) -> int:
        prefix = self._prefix
        if prefix is None or prefix.closed():
            return 0
        limit = min(len(seq.tokens), seq.num_tokens)
        entries = {}
        for g in self._attn:
            held, bs = seq.held[g], self._bs[g]
            pairs = [((i + 1) * bs, b) for i, b in sorted(held.extra.items()) if (i + 1) * bs <= limit]
            pairs += [((i + 1) * bs, b) for i, b in enumerate(held.blocks, held.dropped) if (i + 1) * bs <= limit]
            if pairs:
                entries[g] = pairs
        for g in self._states:
            pairs = [(pos, slot) for pos, slot in seq.checkpoints[g] if pos <= limit]
            if pairs:
                entries[g] = pairs
        return prefix.store(seq.tokens, seq.adapter_id, entries, keys=seq.keys) if entries else 0

    def _drop_checkpoints(self, seq: _HSeq) -> None:
        for g in self._states:
            slots = [slot for _, slot in seq.checkpoints[g]]
            seq.checkpoints[g], seq.step_checkpoints[g] = [], 0
            self._free_slots(g, slots)

    @guarded
    def free(self, seq_id: Hashable) -> None:
        """End a sequence: offer its written, known blocks and its checkpoints to the prefix
        cache, then drop every reference (blocks, live slots, checkpoint slots)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        try:
            self._offer(seq)
        finally:
            self._drop_checkpoints(seq)
            for g in self._attn:
                self._release_extra(seq, g, 0)
                self._cache.group(g).free_blocks(seq.held[g].blocks)
            for g in self._states:
                self._free_slots(g, [seq.slots[g]])

    @guarded
    def cache_prefix(self, seq_id: Hashable) -> int:
        """Offer a live sequence's written, known blocks and its checkpoints now (call it once
        the step's KV and checkpoint states are written); returns how many entries were newly
        cached. The sequence keeps its blocks; its checkpoint slots go to the cache."""
        seq = self._get(seq_id)
        if self._prefix is None:
            return 0
        self._prefix._check_open("cache_prefix")
        try:
            return self._offer(seq)
        finally:
            self._drop_checkpoints(seq)
            for g in self._attn:
                self._release_extra(seq, g, 0)
