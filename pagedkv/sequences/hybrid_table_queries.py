"""The queries and kernel exports of `HybridSequenceTable`: counts, a group's blocks and
step blocks, `block_table`, `page_table`, `slot_mapping` per attention group, `state_slots`
and the checkpoint slots per state group, and `check_invariants`.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import numpy as np

from ..core.guard import guarded
from ..core.validate import non_negative_int
from ..errors import KvCacheError
from ..groups.window import max_live_blocks
from .exports import Exported, page_table_of
from .hybrid_records import _HSeq


class HybridTableQueries:
    """Mixed into `HybridSequenceTable` (it sets `_cache`, `_layout`, `_prefix`, `_seqs`,
    `_exports`, `_pending_refs`, `_states`, `_bs`, `_window`; `_span` comes from
    `HybridAllocation`, `_get` from the table)."""

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens in the sequence."""
        return self._get(seq_id).num_tokens

    def _attention(self, group: int) -> int:
        g = self._layout.check_group(group)
        if g not in self._bs:
            raise ValueError(f"group {g} is a state group: it has no blocks")
        return g

    def _state(self, group: int | None) -> int:
        if group is None:
            if len(self._states) != 1:
                raise ValueError(f"the cache has {len(self._states)} state groups: name one with group=")
            return self._states[0]
        g = self._layout.check_group(group)
        if g not in self._states:
            raise ValueError(f"group {g} is not a state group")
        return g

    def step_blocks(self, seq_id: Hashable, group: int = 0) -> dict[int, int]:
        """Block index -> block id of every block of attention group `group` the sequence's
        latest step may read or write: its held blocks and, after an `add`, the blocks outside
        its window that step still needs (a sliding group's matched blocks covering
        `[hit - window, hit)`, which the prefill attends to, and its branch-point blocks).
        Those extra ones are the sequence's until its next `append`, `cache_prefix` or `free`."""
        h = self._get(seq_id).held[self._attention(group)]
        out = dict(h.extra)
        out.update(enumerate(h.blocks, h.dropped))
        return out

    def blocks(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """The blocks the sequence holds in attention group `group`, oldest first (a copy)."""
        return list(self._get(seq_id).held[self._attention(group)].blocks)

    def first_block_position(self, seq_id: Hashable, group: int = 0) -> int:
        """Token position where the sequence's first held block of `group` starts."""
        g = self._attention(group)
        return self._get(seq_id).held[g].dropped * self._bs[g]

    def _seq_list(self, seq_ids: Iterable[Hashable]) -> list[_HSeq]:
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
            raise TypeError(f"seq_ids must be an iterable of sequence ids, got {seq_ids!r:.60}")
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            dup = next(s for s in ids if ids.count(s) > 1)
            raise ValueError(f"sequence {dup!r} is listed more than once in seq_ids")
        return [self._get(s) for s in ids]

    def _upload(self, kind: str, arrays: list[np.ndarray]):
        return self._exports.upload(kind, arrays)

    @guarded
    def block_table(self, seq_ids: Iterable[Hashable], group: int = 0) -> Exported:
        """`[num_seqs, max_blocks]` int32 held blocks of attention group `group`, -1 padded."""
        g = self._attention(group)
        helds = [s.held[g] for s in self._seq_list(seq_ids)]
        width = max((len(h.blocks) for h in helds), default=0)
        table = np.full((len(helds), width), -1, dtype=np.int32)
        for i, h in enumerate(helds):
            table[i, : len(h.blocks)] = h.blocks
        return Exported(table, self._upload(f"block_table:{g}", [table]))

    @guarded
    def page_table(self, seq_ids: Iterable[Hashable], group: int = 0) -> Exported:
        """The CSR triple of attention group `group`'s held blocks (see `SequenceTable.page_table`)."""
        g = self._attention(group)
        host = page_table_of([s.held[g] for s in self._seq_list(seq_ids)], self._bs[g])
        device = self._upload(f"page_table:{g}", list(host))
        return Exported(host, None if device is None else type(host)(*device))

    @guarded
    def slot_mapping(self, seq_ids: Iterable[Hashable], group: int = 0, pad_to: int | None = None) -> Exported:
        """int64 slots in attention group `group` of the positions each sequence's latest step
        introduced (-1 for a position whose block the window no longer holds), -1 padded."""
        g = self._attention(group)
        bs, out = self._bs[g], []
        for seq in self._seq_list(seq_ids):
            h = seq.held[g]
            for pos in range(h.step_start, h.num_tokens):
                i = pos // bs - h.dropped
                b = h.blocks[i] if 0 <= i < len(h.blocks) else h.extra.get(pos // bs, -1)
                out.append(b * bs + pos % bs if b != -1 else -1)
        slots = np.array(out, dtype=np.int64)
        if pad_to is not None:
            pad_to = non_negative_int(pad_to, "pad_to")
            if pad_to < slots.size:
                raise ValueError(f"pad_to must be an int >= the {slots.size} slots, got {pad_to!r}")
            slots = np.concatenate([slots, np.full(pad_to - slots.size, -1, dtype=np.int64)])
        return Exported(slots, self._upload(f"slot_mapping:{g}", [slots]))

    @guarded
    def state_slots(self, seq_ids: Iterable[Hashable], group: int | None = None) -> Exported:
        """int32, one per sequence: its live slot in state group `group` (the only one when None)."""
        g = self._state(group)
        slots = np.array([s.slots[g] for s in self._seq_list(seq_ids)], dtype=np.int32)
        return Exported(slots, self._upload(f"state_slots:{g}", [slots]))

    def _step_pairs(self, seq: _HSeq, g: int) -> list[tuple[int, int]]:
        n = seq.step_checkpoints[g]
        return seq.checkpoints[g][len(seq.checkpoints[g]) - n:] if n else []

    @guarded
    def checkpoint_slots(self, seq_ids: Iterable[Hashable], group: int | None = None) -> Exported:
        """int32, one per sequence: the deepest checkpoint slot its latest `add`/`append` was
        given in state group `group` (-1 where that step reached no checkpoint position). The
        engine writes the state as of that position there (or `cache.copy_state` from the live
        slot). A step that reached several positions (a long prompt) lists them all in
        `step_checkpoints`."""
        g = self._state(group)
        slots = np.array([(self._step_pairs(s, g) or [(0, -1)])[-1][1] for s in self._seq_list(seq_ids)],
                         dtype=np.int32)
        return Exported(slots, self._upload(f"checkpoint_slots:{g}", [slots]))

    def checkpoint_position(self, seq_id: Hashable, group: int | None = None) -> int:
        """The token position of the latest step's deepest checkpoint in state group `group` (-1: none)."""
        g = self._state(group)
        return (self._step_pairs(self._get(seq_id), g) or [(-1, -1)])[-1][0]

    def step_checkpoints(self, seq_id: Hashable, group: int | None = None) -> list[tuple[int, int]]:
        """`(position, slot)` of every checkpoint the latest `add`/`append` of the sequence was
        given in state group `group`, ascending: the positions of `(old, new]` that are
        multiples of `checkpoint_every`, and for `add` the end of the prompt's last whole match
        unit. The engine writes the state as of each position into its slot before the step's
        `cache_prefix` or `free` (after which the slots belong to the prefix cache). When the
        state pool is short the step lists only the deepest positions it got slots for
        (`skipped_checkpoints` counts the rest)."""
        g = self._state(group)
        return list(self._step_pairs(self._get(seq_id), g))

    @guarded
    def check_invariants(self) -> None:
        """Every group's counts equal the references the table, its prefix cache and pending
        copies hold; no sliding group holds more than its window needs."""
        for g in range(self._layout.num_groups()):
            held: dict[int, int] = {}

            def count(x: int) -> None:
                held[x] = held.get(x, 0) + 1

            for seq_id, seq in self._seqs.items():
                if g in self._bs:
                    h = seq.held[g]
                    first, end = self._span(g, seq.num_tokens)
                    if (h.dropped, h.dropped + len(h.blocks)) != (first, end) and h.blocks:
                        raise KvCacheError(f"sequence {seq_id!r} group {g} holds blocks {h.dropped}.."
                                           f"{h.dropped + len(h.blocks)} for span {first}..{end}")
                    if self._window[g] is not None and len(h.blocks) > max_live_blocks(self._window[g], self._bs[g]):
                        raise KvCacheError(f"sequence {seq_id!r} holds {len(h.blocks)} blocks of sliding group {g}")
                    for b in h.blocks + list(h.extra.values()):
                        count(b)
                else:
                    count(seq.slots[g])
                    for _, slot in seq.checkpoints[g]:
                        count(slot)
            for pg, slot in self._pending_refs:
                if pg == g:
                    count(slot)
            if self._prefix is not None:
                for x in self._prefix.block_references(g):
                    count(x)
            self._cache.group(g).allocator().check_invariants(held)
        if self._prefix is not None:
            self._prefix.check_invariants()
