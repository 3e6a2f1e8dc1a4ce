"""The records of `HybridSequenceTable`: a sequence (`_HSeq`), its part in one attention
group (`_Held`, what the export builders read) and a step's allocations, given back when
the step fails (`_Undo`)."""

from __future__ import annotations


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

