"""`HybridSequenceTable.append_decode`: a whole decode step (one token per sequence) in one
call: the sequences with room counted in one pass, the others planned in order, all or
nothing (`_plan_decode`), then committed (`HybridAppend._plan_step` / `_commit_step`).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from ..core.guard import guarded
from .decode_step import DECODE_MARKS, decode_arguments
from .hybrid_records import _HSeq, _Undo


class HybridDecodeStep:
    """Mixed into `HybridSequenceTable` (it sets `_groups`, `_seqs`, `_pending`, `_skipped`;
    `_plan_step` and `_commit_step` come from `HybridAppend`)."""

    @guarded
    def append_decode(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> None:
        """One decode step: sequence `seq_ids[i]` gets the one token `token_ids[i]`, for every
        i, with the changes `append(seq_ids[i], 1, [token_ids[i]])` called for each i in order
        would make in every group: the same blocks, exports (`slot_mapping` gives each its one
        new slot per attention group), state slots, checkpoint slots (`step_checkpoints`;
        skipped ones counted alike), prefix-cache events and pending copies, except where a
        sliding group releases blocks (below).

        A sequence with room (`_room`: no block boundary, release, copy or checkpoint in any
        group) only counts its token, in one pass; the others are planned after the pass in
        order, each taking its new blocks, copies and checkpoint slots as its own `append`
        would, and applied once the whole step has what it needs. So a sliding group's blocks
        the step releases (out of the window, or an add step's branch-point blocks given up
        at the first append) are offered to the prefix cache and freed after every new block
        and slot of the step is taken, where the per-call appends free each sequence's before
        the next allocates: when an earlier sequence of the step releases blocks of a sliding
        group and a later one allocates there, that group's new block ids may differ (the
        same counts and the same sharing), the step needs its new blocks before the released
        ones come back (it may evict a cached block, or raise KvCacheExhausted, where the
        per-call appends would have reused a released one), and the events of evictions for
        the step's allocations come before those of its offers. Full attention and state
        groups get the same ids, as long as no sliding group had to evict for the step (an
        eviction the per-call appends did not need leaves the prefix cache, and so later
        matches, different).

        All or nothing. Refused before anything changes: ValueError when the two lengths
        differ or an id repeats; KeyError for an unknown id; TypeError when `seq_ids` is not an
        ordered sized collection (None, a str, a set) or an id is unhashable; TypeError/ValueError
        naming a bad token id (as `append`). KvCacheExhausted when a group's new blocks run out, and a
        backend error while initialising or copying them, leave every sequence as it was and
        the step's new blocks and slots freed; cached entries the prefix cache evicted to make
        room stay evicted. A checkpoint no slot is left for is skipped, as in `append`."""
        seq_ids, tokens = decode_arguments(seq_ids, token_ids)
        mark = next(DECODE_MARKS)
        get = self._seqs.get
        records: list[_HSeq] = []
        later: list[tuple[_HSeq, int]] = []  # (record, token) for the full path, in order
        for seq_id, token in zip(seq_ids, tokens):
            try:
                seq = get(seq_id)
            except TypeError:
                raise TypeError(f"sequence id {seq_id!r:.60} is unhashable: no sequence has it") from None
            if seq is None:
                raise KeyError(f"unknown sequence {seq_id!r}")
            if seq.mark == mark:
                raise ValueError(f"sequence {seq_id!r} appears twice in seq_ids")
            seq.mark = mark
            records.append(seq)
            if seq.num_tokens >= seq.room:
                later.append((seq, token))
        plans = self._plan_decode(later) if later else ()
        for seq, token in zip(records, tokens):  # the fast path: counts only (the planned ones have no room)
            old = seq.num_tokens
            if old < seq.room:
                seq.num_tokens = total = old + 1
                seq.step_start = old
                for held in seq.helds:
                    held.num_tokens, held.step_start = total, old
                if seq.tokens_known:
                    seq.tokens.append(token)
        for (seq, token), plan in zip(later, plans):  # nothing below fails
            self._commit_step(seq, plan, 1, [token])

    def _plan_decode(self, later: list[tuple[_HSeq, int]]) -> list[tuple]:
        """`_plan_step` of one token for each record of `later`, in order, all or nothing:
        on any error every block and slot taken is freed (last first), the pending copies
        and the skipped-checkpoint counts are as they were."""
        undo = _Undo(self._groups)
        dropping: dict[tuple[int, int], int] = {}
        pending, skipped = len(self._pending), dict(self._skipped)
        plans = []
        try:
            for seq, _token in later:
                plans.append(self._plan_step(seq, 1, undo, dropping))
        except BaseException:
            undo.undo()
            del self._pending[pending:]
            self._skipped.update(skipped)
            raise
        return plans
