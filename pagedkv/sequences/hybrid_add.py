"""The start of a sequence in `HybridSequenceTable`: `add` (the hybrid match, its host and
disk entries promoted in one swap, each group's reused and fresh blocks, the state slots,
checkpoint and branch-point allocations) and `fork`.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from ..core.guard import guarded
from ..core.validate import token_ids as valid_token_ids
from ..groups.window import window_blocks_for_match
from .block_keys import block_keys
from .hybrid_disk_tiering import NoStagingRoom
from .hybrid_records import _Held, _HSeq, _Undo
from .tree import adapter_id_checked


class HybridAdd:
    """Mixed into `HybridSequenceTable` (it sets `_cache`, `_groups`, `_prefix`, `_gpu`,
    `_stream`, `_seqs`, `_attn`, `_states`, `_bs`, `_window`, `_hash_unit`, `_pending_refs`;
    `_span`, `_checkpoints_in`, `_alloc_checkpoints`, `_init_blocks`, `_zero_slots` and
    `_copy` come from `HybridAllocation`, `_get` from the table)."""

    @guarded
    def add(self, seq_id: Hashable, prompt_tokens: Sequence[int], adapter_id: int = 0,
            cache_salt: str | bytes | None = None, extra_keys=None) -> int:
        """Start a sequence; returns the tokens reused from the prefix cache (the hybrid
        match: whole match units, never the last prompt token). With a host tier, the match's
        host-held entries of every group are first promoted to fresh device ids in ONE swap on
        the table's stream (nothing changes when that fails); with a disk tier its disk-held
        entries too, read into host blocks first (an entry failing its read is dropped and the
        prompt matched again; host tiers with no room to stage it: matched without the disk). Each attention group reuses
        its matched blocks (a sliding group only those its window still needs), each state
        group copies the matched checkpoint into the new live slot (zeroed without a hit) and
        is given checkpoint slots (`step_checkpoints`), branch-point blocks too (see the module
        docstring). KvCacheExhausted (nothing changed) when a group runs out of blocks or live
        slots; checkpoint slots are best effort (`_alloc_checkpoints`: short ones are skipped).
        `cache_salt` and `extra_keys` key the prompt as in `SequenceTable.add` (a namespace;
        keys of the units they cover): the match and every later offer of its entries."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = valid_token_ids(prompt_tokens, "prompt_tokens")
        adapter_id = adapter_id_checked(adapter_id)
        keys = block_keys(adapter_id, cache_salt, extra_keys, self._hash_unit)
        n = len(tokens)
        prefix = self._prefix
        found = None
        if prefix is not None and n > 1:
            disk, tries = True, 0
            while True:
                tries += 1
                disk = disk and tries <= 4  # entries failing their reads are dropped: bounded all the same
                found = prefix.match(tokens, adapter_id, limit=n - 1, keys=keys, refresh_host=False, disk=disk)
                if not (any(found.host_entries) or any(found.disk_entries)):
                    break
                try:  # every group's host and disk entries back in one swap, before any use
                    promoted = prefix.promote(found, self._stream if self._gpu is not None
                                              else prefix._tiering.swap_stream, wait=self._gpu is None)
                except NoStagingRoom:  # the host tiers cannot take the disk hit: without the disk then
                    prefix.release(found)
                    disk = False
                    continue
                except BaseException:
                    prefix.release(found)
                    raise
                if promoted is not None:
                    found = promoted
                    break
                prefix.release(found)  # a disk entry failed its read (dropped): match again
        p = found.num_tokens if found is not None else 0
        branch = found.shared_tokens if found is not None and found.shared_tokens > p else 0
        undo = _Undo(self._groups)
        seq = _HSeq(n, tokens, adapter_id, p)
        try:
            for g in self._attn:
                first, end = self._span(g, n)
                matched = found.group_blocks[g] if found is not None else []
                start = found.first_block[g] if found is not None else 0
                keep = [b for i, b in enumerate(matched, start) if i >= first]
                fresh = undo.alloc(g, end - max(p // self._bs[g], first))
                self._init_blocks(g, fresh)
                held = seq.held[g] = _Held(keep + fresh, first if end else 0, n, p)
                # matched blocks the window no longer holds: the prefill still reads them
                held.extra = {i: b for i, b in enumerate(matched, start) if i < first}
                if branch and self._window[g] is not None:
                    span = window_blocks_for_match(branch, self._window[g], self._bs[g])
                    lo, hi = max(span.start, p // self._bs[g]), min(span.stop, first)
                    if hi > lo:
                        ids = undo.alloc(g, hi - lo)
                        self._init_blocks(g, ids)
                        held.extra.update(zip(range(lo, hi), ids))
            for g in self._states:
                (live,) = undo.alloc(g, 1)
                ckpt = found.checkpoints[g] if found is not None else None
                if ckpt is None:
                    self._zero_slots(g, [live])
                seq.slots[g] = live
                positions = self._checkpoints_in(g, p, n, prompt=True) if prefix is not None else []
                if branch and branch not in positions:
                    positions = sorted(positions + [branch])
                pairs = self._alloc_checkpoints(undo, g, positions)
                seq.checkpoints[g] = pairs
                seq.step_checkpoints[g] = len(pairs)
            for g in self._states:  # last: nothing after this can fail
                ckpt = found.checkpoints[g] if found is not None else None
                if ckpt is not None:
                    self._copy(g, ckpt, seq.slots[g])
        except BaseException:
            undo.undo()
            if found is not None:
                prefix.release(found)
            raise
        if found is not None:
            for g in self._states:
                ckpt = found.checkpoints[g]
                if ckpt is not None:
                    if self._gpu is None:
                        self._pending_refs.append((g, ckpt))  # kept until the engine took the copy
                    else:
                        self._cache.group(g).free_blocks([ckpt])
        seq.keys = keys
        self._seqs[seq_id] = seq
        return p

    @guarded
    def fork(self, src: Hashable, dst: Hashable) -> None:
        """Start `dst` as a copy of `src`: every attention block shared (copy-on-write of a
        partly filled last block at the first write), each state slot copied into a new one."""
        parent = self._get(src)
        if dst in self._seqs:
            raise ValueError(f"sequence {dst!r} already exists")
        undo = _Undo(self._groups)
        child = _HSeq(parent.num_tokens, list(parent.tokens), parent.adapter_id, parent.num_tokens)
        child.tokens_known, child.keys = parent.tokens_known, parent.keys
        try:
            for g in self._states:
                (slot,) = undo.alloc(g, 1)
                child.slots[g], child.checkpoints[g], child.step_checkpoints[g] = slot, [], 0
            for g in self._states:
                self._copy(g, parent.slots[g], child.slots[g])
        except BaseException:
            undo.undo()
            raise
        for g in self._attn:
            held = parent.held[g]
            self._cache.group(g).inc_refs(held.blocks)
            twin = child.held[g] = _Held(list(held.blocks), held.dropped, held.num_tokens, held.num_tokens)
            if parent.num_tokens % self._bs[g]:
                held.maybe_shared = twin.maybe_shared = True
                parent.room = 0
        self._seqs[dst] = child
