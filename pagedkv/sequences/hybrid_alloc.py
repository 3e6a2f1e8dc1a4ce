"""The allocation helpers of `HybridSequenceTable`: the block span a group holds, the
checkpoint positions a step reaches and their best-effort slots (`skipped_checkpoints`),
and the initialisation, copies and release of blocks and slots (performed on the table's
backend, or left pending without one).
"""

from __future__ import annotations

from ..errors import KvCacheExhausted
from ..groups.window import first_live_block
from .hybrid_records import _Undo


class HybridAllocation:
    """Mixed into `HybridSequenceTable` (it sets `_cache`, `_layout`, `_groups`, `_prefix`,
    `_gpu`, `_stream`, `_bs`, `_window`, `_unit`, `_every`, `_skipped`, `_pending`; `_state`
    comes from `HybridTableQueries`)."""

    def _span(self, g: int, n: int) -> tuple[int, int]:
        """Block indices [first, end) group g holds for a sequence of n tokens."""
        bs, window = self._bs[g], self._window[g]
        first = first_live_block(n, window, bs) if window is not None else 0
        return first, -(-n // bs)

    def _checkpoints_in(self, g: int, old: int, total: int, prompt: bool) -> list[int]:
        """Every checkpoint position of state group g in (old, total], ascending: each
        multiple of `checkpoint_every`, and (`prompt`) the end of the last whole match unit."""
        every = self._every[g]
        out = list(range((old // every + 1) * every, total + 1, every)) if every else []
        if prompt:
            end = (total // self._unit) * self._unit
            if end > old and end not in out:
                out.append(end)
        return out

    def _alloc_checkpoints(self, undo: _Undo, g: int, positions: list[int]) -> list[tuple[int, int]]:
        """Checkpoint slots of state group g for `positions` (ascending), best effort: a
        checkpoint only makes a later hit possible, so when the group's free and evictable
        slots are short the step keeps the deepest positions it can get and skips the rest
        (counted in `skipped_checkpoints`) rather than failing. The slots are initialised
        (`_init_slots`) and recorded in `undo`."""
        if not positions:
            return []
        try:
            slots = undo.alloc(g, len(positions))
        except KvCacheExhausted:
            group = self._groups[g]
            evictable = 0
            if self._prefix is not None and not self._prefix.closed():
                evictable = sum(1 for slot in self._prefix.block_references(g) if group.ref_count(slot) == 1)
            have = min(len(positions) - 1, group.num_free_blocks() + evictable)
            while True:  # the estimate may be high (an eviction can free less): shrink to what is there
                try:
                    slots = undo.alloc(g, have) if have else []
                    break
                except KvCacheExhausted:
                    have -= 1
            self._skipped[g] += len(positions) - have
            positions = positions[len(positions) - have:]
        self._init_slots(g, slots)
        return list(zip(positions, slots))

    def skipped_checkpoints(self, group: int | None = None) -> int:
        """Checkpoints a step could not be given a slot for since the table was built (state
        group `group`; every state group when None): the state pool held no free or
        evictable slot for them. Such a step still succeeds; its skipped positions are
        simply never cached (a later prompt cannot hit there)."""
        if group is None:
            return sum(self._skipped.values())
        return self._skipped[self._state(group)]

    def _init_blocks(self, g: int, blocks: list[int]) -> None:
        if blocks and self._gpu is not None:
            self._cache.group(g).init_blocks(blocks, self._gpu, self._stream)

    def _copy(self, g: int, src: int, dst: int) -> None:
        if self._gpu is None:
            self._pending.append((g, src, dst))
        elif self._layout.groups[g].is_attention():
            self._cache.group(g).copy_blocks([(src, dst)], self._gpu, self._stream)
        else:
            self._cache.group(g).pools().copy([src], [dst], self._gpu, self._stream)

    def _zero_slots(self, g: int, slots: list[int]) -> None:
        if slots and self._gpu is not None:
            self._cache.group(g).pools().fill(slots, 0, self._gpu, self._stream)

    def _init_slots(self, g: int, slots: list[int]) -> None:
        """Fresh checkpoint slots: zeroed, or poisoned under METRALE_KV_POISON (`init_slots`)."""
        if slots and self._gpu is not None:
            self._cache.group(g).init_slots(slots, self._gpu, self._stream)

    def _free_slots(self, g: int, slots: list[int]) -> None:
        """Drop the table's references; slots that went free are poisoned under METRALE_KV_POISON."""
        if slots:
            self._cache.group(g).free_slots(slots, self._gpu, self._stream)
