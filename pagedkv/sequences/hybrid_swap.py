"""Parking a hybrid sequence in the host tier and bringing it back (preemption):
`HybridSequenceTable.swap_out(seq_id, tier)` / `swap_in(parked)`.

`swap_out` copies what the sequence holds on the device - its blocks of every attention
group (a sliding group: only those its window holds), its live state slot and its
checkpoint slots not yet cached, of every state group - into host blocks of a
`HybridHostTier`, in ONE swap on the table's stream, waits for it, then drops the table's
references (blocks shared with other sequences or the prefix cache stay theirs; slots that
go free are poisoned under METRALE_KV_POISON). The sequence leaves the table and is
returned as a `ParkedSequence`.

`swap_in` allocates fresh device blocks and slots in every group, copies the host bytes
back in ONE swap on the table's stream (work enqueued there later sees them), frees the
host blocks once that swap is done and puts the sequence back under its id with the new
ids: its exports (`blocks`, `block_table`, `state_slots`, `checkpoint_slots`, ...) name
the new blocks and slots, and it continues exactly where it stopped.

Both are all or nothing: on any error (a group out of blocks, a swap refused) nothing the
call took is kept and the sequence stays where it was (on the device, or parked).
"""

from __future__ import annotations

from typing import Any, Hashable

from ..errors import KvCacheError


class ParkedSequence:
    """A sequence held by the host tier: its id, the table's record of it (device ids
    meaningless until `swap_in`) and its host blocks per group, in the order of
    `device_order`."""

    __slots__ = ("seq_id", "record", "host", "tier", "_live")

    def __init__(self, seq_id: Hashable, record: Any, host: dict[int, list[int]], tier: Any):
        self.seq_id, self.record, self.host, self.tier, self._live = seq_id, record, host, tier, True

    def num_tokens(self) -> int:
        """Tokens in the parked sequence."""
        return self.record.num_tokens

    def is_parked(self) -> bool:
        """True until `swap_in` brought it back (a ParkedSequence is used once)."""
        return self._live

    def __repr__(self) -> str:
        where = "parked" if self._live else "resumed"
        return f"ParkedSequence({self.seq_id!r}, {self.record.num_tokens} tokens, {where})"


def device_order(table, seq) -> dict[int, list[int]]:
    """What the sequence holds on the device, per group: attention groups' held blocks
    (oldest first); state groups' live slot, then its checkpoint slots in position order."""
    out = {g: list(seq.held[g].blocks) for g in table._attn}
    for g in table._states:
        out[g] = [seq.slots[g]] + [slot for _, slot in seq.checkpoints[g]]
    return out


def swap_out(table, seq_id: Hashable, tier, stream: Any) -> ParkedSequence:
    """See the module docstring."""
    seq = table._get(seq_id)
    device = device_order(table, seq)
    host = tier.alloc({g: len(ids) for g, ids in device.items()})
    try:
        handle = tier.swap_out(device, host, stream, after=stream)
    except BaseException:
        tier.free(host)
        raise
    try:
        handle.wait()  # the device blocks are about to be reused: the copy must have read them
    except BaseException:
        for g, ids in host.items():
            tier.group(g).abandon(handle, ids)
        raise
    del table._seqs[seq_id]
    cache = table._cache
    for g in table._attn:
        table._release_extra(seq, g, 0)  # the last step's extra reads are done: freed, not parked
        cache.group(g).free_blocks(device[g])
    for g in table._states:
        cache.group(g).free_slots(device[g], table._gpu, table._stream)
    return ParkedSequence(seq_id, seq, host, tier)


def swap_in(table, parked: ParkedSequence, stream: Any) -> None:
    """See the module docstring."""
    if not isinstance(parked, ParkedSequence):
        raise TypeError(f"swap_in takes a ParkedSequence (from swap_out), got {type(parked).__name__}")
    if not parked.is_parked():
        raise KvCacheError(f"sequence {parked.seq_id!r} was already swapped back in")
    if parked.seq_id in table._seqs:
        raise ValueError(f"sequence {parked.seq_id!r} already exists")
    if parked.tier.cache() is not table._cache:
        raise KvCacheError("the parked sequence belongs to another cache")
    cache, taken = table._cache, {}
    try:
        for g, ids in parked.host.items():
            taken[g] = cache.group(g).alloc_blocks(len(ids))
        handle = parked.tier.swap_in(parked.host, taken, stream)
    except BaseException:
        for g, ids in taken.items():
            if ids:
                cache.group(g).free_blocks(ids)
        raise
    parked.tier.free(parked.host, after=handle)
    seq = parked.record
    for g in table._attn:
        seq.held[g].blocks = taken[g]
        seq.held[g].maybe_shared = False  # fresh blocks: the sequence's alone
    for g in table._states:
        renamed = dict(zip([seq.slots[g]] + [s for _, s in seq.checkpoints[g]], taken[g]))
        seq.slots[g] = renamed[seq.slots[g]]
        seq.checkpoints[g] = [(pos, renamed[s]) for pos, s in seq.checkpoints[g]]
        # step_checkpoints counts the last of `checkpoints` (renamed in place); cache_prefix
        # emptied both when it handed them to the prefix cache
    table._seqs[parked.seq_id] = seq
    parked._live = False
