"""The append path of `HybridSequenceTable`: `append` (its one-token decode fast path, the
guard claimed inline), extra keys for the appended tokens, the fast path's room, and a step
planned (`_plan_step`: new blocks, the copy of a shared last block, checkpoint slots) then
committed (`_commit_step`, `_commit`: released sliding blocks offered and freed, counts).
`append_decode` (`hybrid_decode_step`) plans and commits with the same two steps.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from ..core.guard import guarded
from ..core.validate import MAX_TOKEN_ID, non_negative_int, step_arguments
from ..core.validate import token_ids as valid_token_ids
from .block_keys import extra_key_ranges, with_ranges
from .hybrid_records import _HSeq, _Undo


class HybridAppend:
    """Mixed into `HybridSequenceTable` (it sets `_groups`, `_prefix`, `_seqs`, `_guard`,
    `_attn`, `_states`, `_bs`, `_window`, `_every`, `_hash_unit`, `_pending`, `_skipped`; `_span`, `_checkpoints_in`,
    `_alloc_checkpoints`, `_init_blocks` and `_copy` come from `HybridAllocation`,
    `_release_extra` and `_offer_released` from `HybridOffers`, `_get` from the table)."""

    def append(self, seq_id: Hashable, n_tokens: int | None = None, token_ids: Sequence[int] | None = None,
               extra_keys=None) -> None:
        """Extend a sequence by `n_tokens` (default len(token_ids), else 1) in every group:
        new blocks at block boundaries, a shared partly filled last block copied first, a
        sliding group's blocks wholly out of its window released (and the add step's
        branch-point blocks); a checkpoint slot at each `checkpoint_every` position reached.
        KvCacheExhausted, nothing changed, when a group runs out of blocks; a checkpoint no
        slot is left for is skipped (`skipped_checkpoints`), the step still succeeds.

        A decode step's one token id (`token_ids=[t]`) that needs none of that (no block
        boundary, release, copy or checkpoint in any group: `_room`) only counts the token.

        `extra_keys` key the appended tokens as `SequenceTable.append`'s: `(offset, length,
        key)` ranges counted from this step's first token, each within the step (ValueError
        naming it, nothing changed), attached once the step succeeded, after the keys given
        before; the entries they cover are offered to the prefix cache under them."""
        if extra_keys is not None:
            self._append_keyed(seq_id, n_tokens, token_ids, extra_keys)
            return
        seq = self._seqs.get(seq_id)
        if (seq is not None and type(token_ids) is list and len(token_ids) == 1 and seq.num_tokens < seq.room
                and (n_tokens is None or (type(n_tokens) is int and n_tokens == 1))):
            token_id = token_ids[0]
            if type(token_id) is int and 0 <= token_id <= MAX_TOKEN_ID:
                token = self._guard.token
                try:
                    token.pop()  # the guard, claimed inline (free and not re-entered)
                except IndexError:
                    pass  # re-entered or another thread inside: the guarded path says which
                else:
                    try:
                        old = seq.num_tokens
                        seq.num_tokens = total = old + 1
                        seq.step_start = old
                        for held in seq.helds:
                            held.num_tokens, held.step_start = total, old
                        if seq.tokens_known:
                            seq.tokens.append(token_id)
                    finally:
                        token.append(True)
                    return
        self._append(seq_id, n_tokens, token_ids)

    @guarded
    def _append_keyed(self, seq_id: Hashable, n_tokens, token_ids, extra_keys) -> None:
        """`append` with extra keys for the step's tokens: checked first, attached after."""
        seq = self._get(seq_id)
        ranges = extra_key_ranges(extra_keys)
        if n_tokens is None:
            n = 1 if token_ids is None else len(valid_token_ids(token_ids, "token_ids"))
        else:
            n = non_negative_int(n_tokens, "n_tokens")
        for i, (offset, length, _key) in enumerate(ranges):
            if offset + length > n:
                raise ValueError(
                    f"extra_keys[{i}] covers tokens [{offset}, {offset + length}) of the step, which appends {n}"
                )
        start = seq.num_tokens
        self._append(seq_id, n_tokens, token_ids)
        shifted = tuple((start + offset, length, key) for offset, length, key in ranges)
        seq.keys = with_ranges(seq.keys, seq.adapter_id, shifted, self._hash_unit)

    def _room(self, seq: _HSeq) -> int:
        """The most tokens the sequence can reach one token at a time with nothing but counts
        changing: no attention group at a block boundary, releasing out of its window, holding
        a possibly shared last block or branch-point blocks; no checkpoint position (and none
        from the latest step outstanding). 0 when the next append needs the full path."""
        if any(seq.step_checkpoints.values()):
            return 0
        room = MAX_TOKEN_ID
        for g in self._attn:
            held, bs = seq.held[g], self._bs[g]
            if held.maybe_shared or held.extra or not held.blocks:
                return 0
            cap = (held.dropped + len(held.blocks)) * bs
            window = self._window[g]
            if window is not None:
                cap = min(cap, (held.dropped + 1) * bs + window - 1)
            room = min(room, cap)
        if self._prefix is not None:
            for g in self._states:
                every = self._every[g]
                if every:
                    room = min(room, (seq.num_tokens // every + 1) * every - 1)
        return room

    @guarded
    def _append(self, seq_id: Hashable, n_tokens: int | None = None, token_ids: Sequence[int] | None = None) -> None:
        """`append`, every case."""
        seq = self._get(seq_id)
        if (type(token_ids) is list and len(token_ids) == 1 and type(token_ids[0]) is int
                and 0 <= token_ids[0] <= MAX_TOKEN_ID
                and (n_tokens is None or (type(n_tokens) is int and n_tokens == 1))):
            n_tokens = 1  # a decode step's one valid id: no copy to validate
        else:
            n_tokens, token_ids = step_arguments(n_tokens, token_ids)
        undo = _Undo(self._groups)
        pending, skipped = len(self._pending), dict(self._skipped)
        try:
            plan = self._plan_step(seq, n_tokens, undo)
        except BaseException:
            undo.undo()
            del self._pending[pending:]  # (a copy planned before the failure, left pending)
            self._skipped.update(skipped)  # (checkpoints the failed step skipped)
            raise
        self._commit_step(seq, plan, n_tokens, token_ids)

    def _plan_step(self, seq: _HSeq, n_tokens: int, undo: _Undo, dropping: dict | None = None) -> tuple:
        """What the step of `n_tokens` needs, taken (recorded in `undo`; the caller undoes it
        when this raises): each attention group's new blocks (initialised) and the copy of a
        shared last block (performed or left pending), the checkpoint slots. Nothing of the
        sequence changes. `dropping` (a batched step's): `(group, block) ->` the references
        the step's earlier planned copies will drop, so a shared block is copied as the
        per-call appends would decide after those copies."""
        old = seq.num_tokens
        total = old + n_tokens
        plans = []
        for g in self._attn:
            held, bs = seq.held[g], self._bs[g]
            first, end = self._span(g, total)
            have = held.dropped + len(held.blocks)
            last = have - 1
            copy = 0
            if n_tokens and held.maybe_shared and old % bs and last >= first:
                shared = held.blocks[-1]
                refs = self._groups[g].ref_count(shared)
                if dropping is None:
                    copy = int(refs > 1)
                else:
                    copy = int(refs - dropping.get((g, shared), 0) > 1)
                    if copy:
                        dropping[(g, shared)] = dropping.get((g, shared), 0) + 1
            start = max(have, first)
            fresh = undo.alloc(g, max(end - start, 0) + copy)
            self._init_blocks(g, fresh[copy:])
            plans.append((g, first, start, fresh, copy))
        new_ckpts = []
        if self._prefix is not None:
            for g in self._states:
                pairs = self._alloc_checkpoints(undo, g, self._checkpoints_in(g, old, total, prompt=False))
                if pairs:
                    new_ckpts.append((g, pairs))
        for g, first, start, fresh, copy in plans:
            if copy:
                self._copy(g, seq.held[g].blocks[-1], fresh[0])
        return plans, new_ckpts

    def _commit_step(self, seq: _HSeq, plan: tuple, n_tokens: int, token_ids: Sequence[int] | None) -> None:
        """Apply a planned step to the sequence (nothing here fails): its tokens, each group's
        new and released blocks (released ones offered to the prefix cache first), its
        checkpoints, counts and fast-path room."""
        plans, new_ckpts = plan
        old = seq.num_tokens
        total = old + n_tokens
        if token_ids is None and n_tokens:
            seq.tokens_known = False
        elif seq.tokens_known and n_tokens:
            seq.tokens += token_ids
        for g, first, start, fresh, copy in plans:
            self._release_extra(seq, g, old)
            self._commit(seq, g, old, total, first, start, fresh, copy, n_tokens)
        for g in self._states:
            seq.step_checkpoints[g] = 0
        for g, pairs in new_ckpts:
            seq.checkpoints[g].extend(pairs)
            seq.step_checkpoints[g] = len(pairs)
        seq.num_tokens, seq.step_start = total, old
        seq.helds = tuple(seq.held.values())
        seq.room = self._room(seq)

    def _commit(self, seq: _HSeq, g: int, old: int, total: int, first: int, start: int, fresh: list[int],
                copy: int, n_tokens: int) -> None:
        held, bs, group = seq.held[g], self._bs[g], self._groups[g]
        if copy:
            shared, held.blocks[-1] = held.blocks[-1], fresh[0]
            group.dec_ref(shared)
        if n_tokens:
            held.maybe_shared = False
        old_first = held.dropped
        blocks = held.blocks + fresh[copy:]
        if start > old_first + len(held.blocks):  # a gap: every held block is out of the window
            out = len(held.blocks)
        else:
            out = max(first - old_first, 0)
        released, kept = blocks[:out], blocks[out:]
        if released:
            self._offer_released(seq, g, old_first, released, old)
            # a step of several tokens attends from `old + 1 - window`: what it reads stays for the step
            reads_from = max(0, old + 1 - self._window[g]) // bs
            held.extra.update((i, b) for i, b in enumerate(released, old_first) if i >= reads_from)
            group.free_blocks([b for i, b in enumerate(released, old_first) if i < reads_from])
        held.blocks = kept
        held.dropped = first if kept else (start if fresh else old_first + out)
        held.num_tokens, held.step_start = total, old
