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
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Sequence

import numpy as np

from ..backends.protocol import GpuBackend
from ..cache.hybrid_cache import HybridKvCache
from ..core.guard import ThreadGuard, guarded
from ..core.streams import stream_handle
from ..core.validate import MAX_TOKEN_ID, checked_token_ids, non_negative_int
from ..core.validate import token_ids as valid_token_ids
from ..errors import KvCacheError, KvCacheExhausted
from ..groups.window import first_live_block, max_live_blocks, window_blocks_for_match
from ..tiers.hybrid_host_tier import check_tier_of
from . import hybrid_swap
from .exports import ExportBuffers, Exported, SequenceQueries, page_table_of
from .block_keys import block_keys, extra_key_ranges, with_ranges
from .hybrid_disk_tiering import NoStagingRoom
from .hybrid_prefix import HybridMatch, HybridPrefixCache
from .hybrid_swap import ParkedSequence
from .tree import adapter_id_checked


class _Held:
    """One attention group's part of a sequence (the record the export builders read)."""

    __slots__ = ("blocks", "dropped", "maybe_shared", "num_tokens", "step_start", "extra")

    def __init__(self, blocks: list[int], dropped: int, num_tokens: int, step_start: int):
        self.blocks, self.dropped, self.maybe_shared = blocks, dropped, False
        self.num_tokens, self.step_start = num_tokens, step_start
        # a sliding group's blocks outside `blocks` the add step reads or writes (block index ->
        # id): the matched window before the hit, the branch-point window; given up after it
        self.extra: dict[int, int] = {}


class _HSeq:
    __slots__ = ("num_tokens", "tokens", "tokens_known", "adapter_id", "step_start", "held", "slots",
                 "checkpoints", "step_checkpoints", "room", "helds", "keys", "mark")

    def __init__(self, num_tokens: int, tokens: list[int], adapter_id: int, step_start: int):
        self.num_tokens, self.tokens, self.tokens_known = num_tokens, tokens, True
        self.adapter_id, self.step_start = adapter_id, step_start
        self.held: dict[int, _Held] = {}
        self.slots: dict[int, int] = {}  # state group -> live slot
        self.checkpoints: dict[int, list[tuple[int, int]]] = {}  # state group -> [(position, slot)]
        self.step_checkpoints: dict[int, int] = {}  # state group -> how many of `checkpoints` the latest step added
        self.room = 0  # the decode fast path may grow the sequence up to this many tokens
        self.helds: tuple[_Held, ...] = ()  # held.values(), for the fast path
        self.keys = None  # its BlockKeys at the prefix cache's unit (salt, extra keys), or None
        self.mark = 0  # the latest append_decode call that counted this record (catches a repeated id)


class _Undo:
    """What a step took so far, given back on failure: (group, ids) pairs."""

    def __init__(self, groups: list):
        self.groups, self.taken = groups, []

    def alloc(self, g: int, n: int) -> list[int]:
        if not n:
            return []
        ids = self.groups[g].alloc_blocks(n)
        self.taken.append((g, ids))
        return ids

    def undo(self) -> None:
        for g, ids in reversed(self.taken):
            self.groups[g].free_blocks(ids)
        self.taken = []


class HybridSequenceTable(SequenceQueries):
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
        self._decode_mark = 0  # the latest append_decode call's mark

    def _deliver(self) -> None:
        if self._prefix is not None:
            self._prefix.deliver_events()

    # -- helpers ----------------------------------------------------------------------

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

    def _get(self, seq_id: Hashable) -> _HSeq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq

    # -- lifecycle ----------------------------------------------------------------------

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
        differ or an id repeats; KeyError for an unknown id; TypeError/ValueError naming a bad
        token id (as `append`). KvCacheExhausted when a group's new blocks run out, and a
        backend error while initialising or copying them, leave every sequence as it was and
        the step's new blocks and slots freed; cached entries the prefix cache evicted to make
        room stay evicted. A checkpoint no slot is left for is skipped, as in `append`."""
        if type(seq_ids) is not list and type(seq_ids) is not tuple:
            if seq_ids is None or isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__"):
                raise TypeError(f"seq_ids must be a list of sequence ids, got {type(seq_ids).__name__} {seq_ids!r:.60}")
            seq_ids = list(seq_ids)
        tokens = checked_token_ids(token_ids, "token_ids") if type(token_ids) is list else \
            valid_token_ids(token_ids, "token_ids")
        if len(tokens) != len(seq_ids):
            raise ValueError(f"{len(seq_ids)} seq_ids but {len(tokens)} token_ids")
        mark = self._decode_mark = self._decode_mark + 1
        get = self._seqs.get
        records: list[_HSeq] = []
        later: list[tuple[_HSeq, int]] = []  # (record, token) for the full path, in order
        for seq_id, token in zip(seq_ids, tokens):
            seq = get(seq_id)
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
        elif token_ids is not None:
            token_ids = valid_token_ids(token_ids, "token_ids")
            if n_tokens is None:
                n_tokens = len(token_ids)
            elif n_tokens != len(token_ids):
                raise ValueError(f"n_tokens is {n_tokens!r} but {len(token_ids)} token ids were given")
        n_tokens = non_negative_int(1 if n_tokens is None else n_tokens, "n_tokens")
        undo = _Undo(self._groups)
        try:
            plan = self._plan_step(seq, n_tokens, undo)
        except BaseException:
            undo.undo()
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

    # -- queries ------------------------------------------------------------------------

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

    def label(self) -> str:
        """A short name for teardown messages."""
        return f"HybridSequenceTable({len(self._seqs)} sequences)"

    @guarded
    def release(self, gpu: GpuBackend | None = None) -> None:
        """Free the export buffers (see `SequenceTable.release`)."""
        self._exports.release(gpu)


__all__ = ["HybridMatch", "HybridSequenceTable"]
