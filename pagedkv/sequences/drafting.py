"""The drafting side of `SequenceTable` (speculative decoding): an append that gives draft
positions slots past the committed end (`lookahead`), and `truncate`, which takes back any
suffix. A sequence record's `num_tokens` counts its positions with slots, the last
`lookahead` of them drafts (no committed id: never offered to the prefix cache).
"""

from __future__ import annotations

from typing import Any, Hashable

from ..core.guard import guarded
from ..core.validate import MAX_TOKEN_ID, non_negative_int, step_arguments
from .block_keys import cut_at


class DraftingSteps:
    """Mixed into `SequenceTable` (it sets `_seqs`, `_bs`, `_cache`, `_window`, `_guard`,
    `_get`, `_init`, `_copy`, `_deliver`, `_batch`)."""

    @guarded
    def _append_drafting(self, seq_id: Hashable, n_tokens: object, token_ids: object, lookahead: object) -> None:
        """`append` of a step with drafts, or of a sequence whose latest step left some:
        the old drafts are taken back, `n_tokens` committed from the committed end, then
        `lookahead` draft positions given slots. All or nothing."""
        seq = self._get(seq_id)
        if (
            type(token_ids) is list
            and (n_tokens is None or (type(n_tokens) is int and n_tokens == len(token_ids)))
            and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in token_ids)
        ):  # a step's few plain ids pass without building a copy
            n_tokens = len(token_ids)
        else:
            n_tokens, token_ids = step_arguments(n_tokens, token_ids)
        lookahead = non_negative_int(lookahead, "lookahead")
        old = seq.num_tokens - seq.lookahead  # the committed end
        self._reshape(seq, old, old + n_tokens + lookahead, n_tokens + lookahead)
        seq.lookahead = lookahead
        seq.settle(self._bs)
        if seq.tokens_known and n_tokens:
            if token_ids is None:
                seq.tokens_known = False
            else:
                seq.tokens += token_ids

    def _reshape(self, seq: Any, old: int, total: int, written: int) -> None:
        """Make the sequence's positions `[0, total)`, the step writing `[old, total)`
        (`written` of them; `old` is the committed end, drafts past it already taken back):
        blocks held for exactly those positions, blocks past them released, and a shared
        block holding position `old` copied first when the step writes into it. All or
        nothing: on any error the sequence and every count are as they were."""
        bs, cache = self._bs, self._cache
        self._batch.stale()  # (the token counts change below)
        have = seq.dropped + len(seq.blocks)
        needed = -(-total // bs)
        if self._window is not None and written and needed - old // bs > self._window:
            raise ValueError(
                f"appending {written} positions at {old} spans {needed - old // bs} blocks "
                f"but the window holds {self._window}"
            )
        at = old // bs - seq.dropped  # the held block of position `old`, when it is partly filled
        copy = int(bool(written and seq.maybe_shared and old % bs and cache.ref_count(seq.blocks[at]) > 1))
        if needed == have and not copy:  # the common drafting step: within the blocks held
            if written:
                seq.maybe_shared = False
            seq.num_tokens = total
            seq.step_start = old
            return
        fresh = cache.alloc_blocks(max(needed - have, 0) + copy) if needed > have or copy else []
        try:
            self._init(fresh[copy:])
            if copy:
                self._copy(seq.blocks[at], fresh[0])
        except BaseException:
            cache.free_blocks(fresh)
            raise
        if copy:
            shared, seq.blocks[at] = seq.blocks[at], fresh[0]
            cache.dec_ref(shared)
        seq.blocks.extend(fresh[copy:])
        keep = max(needed - seq.dropped, 0)
        released, seq.blocks[keep:] = seq.blocks[keep:], []
        if written:
            seq.maybe_shared = False
        if self._window is not None and len(seq.blocks) > self._window:
            extra = len(seq.blocks) - self._window
            released += seq.blocks[:extra]
            seq.blocks[:extra] = []
            seq.dropped += extra
            seq.tokens, seq.tokens_known = [], False  # no longer offered to the prefix cache
        seq.num_tokens = total
        seq.step_start = old
        self._batch.rewrite(seq)  # the persistent batch's row follows the blocks
        if released:
            cache.free_blocks(released[::-1])  # tail first, like `free`

    @guarded
    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Take back every position of the sequence from `num_tokens` on: rejected drafts
        (a lookahead's, or tokens appended for verification), or a suffix to regenerate.
        `num_tokens` is at most `num_tokens(seq_id)` and not before `first_block_position`
        (ValueError naming it, nothing changed). Blocks past the new end are released; the
        remembered ids are cut to the new end (an id given only as a count is forgotten
        with its position). A block now partly filled is offered to the prefix cache only
        once committed tokens with ids fill it again, and when another sequence or the
        prefix cache holds it, the next write copies it first (the cached KV is never
        written). Extra keys of positions taken back are cut with them (a range past the
        new end is shortened to it). The latest step then introduced no positions (`slot_mapping` is empty
        for it until the next `append`)."""
        seq = self._get(seq_id)
        num_tokens = non_negative_int(num_tokens, "num_tokens")
        committed = seq.num_tokens - seq.lookahead
        if num_tokens > committed:
            raise ValueError(f"num_tokens is {num_tokens}, past the {committed} tokens of sequence {seq_id!r}")
        first = seq.dropped * self._bs
        if num_tokens < first:
            raise ValueError(
                f"num_tokens is {num_tokens}, but the window released the blocks before position {first} "
                f"of sequence {seq_id!r}"
            )
        self._reshape(seq, num_tokens, num_tokens, 0)
        seq.lookahead = 0
        seq.salt = cut_at(seq.salt, num_tokens)  # extra keys of positions taken back go with them
        if not seq.dropped and len(seq.tokens) >= num_tokens:
            del seq.tokens[num_tokens:]
            seq.tokens_known = True  # every remaining position has its id
        if num_tokens % self._bs:
            seq.maybe_shared = True  # the next write checks the partly filled block for other holders
        seq.settle(self._bs)

    def num_lookahead(self, seq_id: Hashable) -> int:
        """Draft positions past the committed end (the latest append's `lookahead`)."""
        return self._get(seq_id).lookahead

