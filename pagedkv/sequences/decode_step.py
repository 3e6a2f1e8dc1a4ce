"""The batched decode append of `SequenceTable`: one call gives every decoding sequence of
a step its one new token (`append_decode`), as an engine's scheduler allocates a step's
slots in one pass, instead of one `append` call per sequence.

The call is checked whole before anything changes (the ids, the token ids), then makes the
same changes the per-call appends `append(seq_ids[i], 1, [token_ids[i]])` would make in
order: a sequence with room in a private last block only counts its token; the others (a
block boundary, a shared partly filled last block) are grown after the pass, their new
blocks allocated one at a time in that order, so a table without a window holds the same
blocks, the same exports and sends the same events as the per-call appends. With a window
the oldest blocks are released once the step's new blocks are all allocated (the per-call
appends release each before the next allocates, so the block ids may differ).
"""

from __future__ import annotations

import itertools
from collections.abc import Set as AbstractSet
from typing import Any, Hashable, Sequence

from ..core.guard import guarded
from ..core.validate import checked_token_ids
from ..core.validate import token_ids as valid_token_ids


DECODE_MARKS = itertools.count(1)
"""Each append_decode call's mark, unique in the process (every table, one- or hybrid-group):
a record counted by this call carries it, so a repeated id is caught, and a record moved to
another table (swap_out / swap_in) can never carry a mark that table's next call will use."""


def decode_arguments(seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> tuple[Sequence[Hashable], list[int]]:
    """A decode step's `(seq_ids, token ids)` checked: the ids a list or tuple (another sized,
    ordered iterable is listed; TypeError for None, a str or bytes, and for a set, whose
    order would pair ids and tokens by hash), the tokens valid ids (TypeError / ValueError
    naming a bad one), ValueError when their lengths differ."""
    if type(seq_ids) is not list and type(seq_ids) is not tuple:
        if seq_ids is None or isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__"):
            raise TypeError(f"seq_ids must be a list of sequence ids, got {type(seq_ids).__name__} {seq_ids!r:.60}")
        if isinstance(seq_ids, AbstractSet):
            raise TypeError(f"seq_ids must be ordered (a list or tuple: the i-th id takes the i-th token), got "
                            f"{type(seq_ids).__name__} {seq_ids!r:.60}")
        seq_ids = list(seq_ids)
    tokens = checked_token_ids(token_ids, "token_ids") if type(token_ids) is list else \
        valid_token_ids(token_ids, "token_ids")
    if len(tokens) != len(seq_ids):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(tokens)} token_ids")
    return seq_ids, tokens


class DecodeSteps:
    """Mixed into `SequenceTable` (it sets `_seqs`, `_bs`, `_cache`, `_window`, `_gpu`,
    `_stream`, `_guard`, `_init`, `_pending_copies`, `_deliver`, `_batch`)."""

    @guarded
    def append_decode(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> None:
        """One decode step: sequence `seq_ids[i]` gets the one token `token_ids[i]`, for
        every i; the same blocks, exports (`slot_mapping` gives each its one new slot) and
        prefix-cache events as `append(seq_ids[i], 1, [token_ids[i]])` called for each i in
        order (a table with a window may get other block ids: the module docstring).

        All or nothing. Refused before anything changes: ValueError when the two lengths
        differ, an id repeats, or a sequence holds drafts of a lookahead (take them back
        with `append` or `truncate`); KeyError for an unknown id; TypeError when `seq_ids`
        is not an ordered sized collection (None, a str, a set) or an id is unhashable;
        TypeError/ValueError naming a bad token id (as `append`). KvCacheExhausted when the
        step's new blocks run out, and a backend error while initialising or copying them,
        leave every sequence as it was and the new blocks freed; cached blocks the prefix
        cache evicted to make room stay evicted (every count stays consistent)."""
        seq_ids, tokens = decode_arguments(seq_ids, token_ids)
        mark = next(DECODE_MARKS)
        batch = self._batch
        whole = batch.gathered and len(seq_ids) == len(batch.seqs)  # every row once (no id repeats)
        batch.stale()  # (the exports' kept gather of token counts; `decoded` below keeps it)
        get = self._seqs.get
        starts: list[int] = []  # the step starts, before this call, of the records counted in the pass
        later: list[tuple[Any, int]] = []  # (record, token) to grow after the pass
        for seq_id, token in zip(seq_ids, tokens):
            try:
                seq = get(seq_id)
            except TypeError:  # an unhashable id: what this pass counted goes back
                self._undo_counted(seq_ids, starts, later)
                raise TypeError(f"sequence id {seq_id!r:.60} is unhashable: no sequence has it") from None
            if seq is None or seq.mark == mark:
                self._undo_counted(seq_ids, starts, later)
                raise self._refused(seq_id, seq, mark)
            seq.mark = mark
            old = seq.num_tokens
            if old < seq.room:  # room in a private last block (the one-token fast path)
                starts.append(seq.step_start)
                seq.num_tokens = old + 1
                seq.step_start = old
                if seq.tokens_known:
                    seq.tokens.append(token)
            elif seq.lookahead:  # (a record with drafts has no room: it always comes here)
                self._undo_counted(seq_ids, starts, later)
                raise self._refused(seq_id, seq, mark)
            else:
                later.append((seq, token))
        if later:
            try:
                self._grow_step(later)
            except BaseException:
                self._undo_counted(seq_ids, starts, later)
                raise
        batch.decoded(whole)

    def _undo_counted(self, seq_ids: Sequence[Hashable], starts: list[int], later: list[tuple[Any, int]]) -> None:
        """Take back the tokens the pass counted: the records of the first `len(starts) +
        len(later)` ids other than those of `later` (each id appears once up to there)."""
        grown = {id(seq) for seq, _ in later}
        get = self._seqs.get
        counted = [seq for seq in map(get, seq_ids[: len(starts) + len(later)]) if id(seq) not in grown]
        for seq, start in zip(counted, starts):
            seq.num_tokens -= 1
            if seq.tokens_known:
                seq.tokens.pop()
            seq.step_start = start

    @staticmethod
    def _refused(seq_id: Hashable, seq: Any, mark: int) -> Exception:
        if seq is None:
            return KeyError(f"unknown sequence {seq_id!r}")
        if seq.lookahead:  # (refused at its first occurrence: never a repeat)
            return ValueError(
                f"sequence {seq_id!r} holds {seq.lookahead} draft position(s): append_decode takes no drafts "
                "(take them back with append or truncate)"
            )
        return ValueError(f"sequence {seq_id!r} appears twice in seq_ids")

    def _grow_step(self, later: list[tuple[Any, int]]) -> None:
        """Grow each record of `later` by its one token: a new block at a block boundary, a
        copy of a shared partly filled last block; all or nothing."""
        bs, allocator, window = self._bs, self._cache.allocator(), self._window
        alloc, ref_count = allocator.alloc_block, allocator.ref_count
        plan: list[tuple[Any, int, int, bool]] = []  # (record, token, its new block or -1, a copy of the last)
        dropping: dict[int, int] = {}  # shared last block -> references the planned copies drop
        fresh: list[int] = []
        try:
            for seq, token in later:  # each decided and allocated in the per-call appends' order
                boundary = seq.num_tokens == (seq.dropped + len(seq.blocks)) * bs
                copy = False
                if not boundary and seq.maybe_shared:
                    last = seq.blocks[-1]
                    copy = ref_count(last) - dropping.get(last, 0) > 1
                    if copy:
                        dropping[last] = dropping.get(last, 0) + 1
                block = -1
                if boundary or copy:
                    block = alloc()
                    fresh.append(block)
                plan.append((seq, token, block, copy))
            pairs = [(seq.blocks[-1], block) for seq, _token, block, copy in plan if copy]
            self._init([block for _seq, _token, block, copy in plan if block >= 0 and not copy])
            if pairs:
                if self._gpu is not None:
                    self._cache.copy_blocks(pairs, self._gpu, self._stream)
                else:
                    self._pending_copies.extend(pairs)
        except BaseException:
            for block in reversed(fresh):
                allocator.dec_ref(block)
            raise
        batch, released = self._batch, []
        for seq, token, block, copy in plan:  # nothing below fails
            blocks, old = seq.blocks, seq.num_tokens
            if copy:
                shared, blocks[-1] = blocks[-1], block
                allocator.dec_ref(shared)
            elif block >= 0:
                blocks.append(block)
            seq.maybe_shared = False
            if window is not None and len(blocks) > window:
                extra = len(blocks) - window
                released += blocks[:extra]
                del blocks[:extra]
                seq.dropped += extra
                seq.tokens, seq.tokens_known = [], False  # no longer offered to the prefix cache
                batch.rewrite(seq)
            elif block >= 0 and not copy:
                batch.block_appended(seq)
            else:
                batch.rewrite(seq)
            seq.num_tokens, seq.step_start = old + 1, old
            if seq.tokens_known:
                seq.tokens.append(token)
            seq.room = (seq.dropped + len(blocks)) * bs  # (`settle`: no drafts, no longer shared)
        if released:
            allocator.free_blocks(released)
