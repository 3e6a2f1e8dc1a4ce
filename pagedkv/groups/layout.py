"""GroupLayout: the groups of a hybrid config, what each costs, and a budget split across them.

Attention group g is stored as its own `KvCacheConfig` (`group_config(g)`): its layers
renumbered 0.. in the order of `LayerGroup.layers`, each keeping its format and dims, the
group's block size, no groups of its own. A state group has no config: its slots are sized
by `LayerGroup.state`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.config import KvCacheConfig
from ..core.layer_groups import LayerGroup, match_unit
from ..core.validate import index_in_range, non_negative_int, positive_int
from .window import max_live_blocks


class GroupLayout:
    """The groups of `config` (one full group of every layer when it has none)."""

    def __init__(self, config: KvCacheConfig):
        if not isinstance(config, KvCacheConfig):
            raise TypeError(f"config must be a KvCacheConfig, got {type(config).__name__}")
        groups = config.layer_groups or (LayerGroup("full", tuple(range(config.num_layers))),)
        self.config = config
        self.groups: tuple[LayerGroup, ...] = groups
        self.group_of = np.empty(config.num_layers, dtype=np.int32)
        self.local_of = np.empty(config.num_layers, dtype=np.int32)
        for g, group in enumerate(groups):
            for i, layer in enumerate(group.layers):
                self.group_of[layer] = g
                self.local_of[layer] = i
        self.group_of.setflags(write=False)
        self.local_of.setflags(write=False)
        self.unit = match_unit(groups, config.block_size)
        self._configs = {g: self._make_config(group) for g, group in enumerate(groups) if group.is_attention()}

    def _make_config(self, group: LayerGroup) -> KvCacheConfig:
        c = self.config
        return KvCacheConfig(
            block_size=group.block_size or c.block_size,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            num_layers=len(group.layers),
            dtype=c.dtype,
            layer_dtypes=tuple(c.dtype_for_layer(layer) for layer in group.layers),
            layer_dims=tuple(c.dims_for_layer(layer) for layer in group.layers),
            v_aliases_k=c.v_aliases_k,
            layout=c.layout,
            tp_rank=c.tp_rank,
            tp_size=c.tp_size,
            k_scale=c.k_scale,
            v_scale=c.v_scale,
        )

    def num_groups(self) -> int:
        """How many groups."""
        return len(self.groups)

    def check_group(self, g: object) -> int:
        """`g` as a group index; IndexError/TypeError naming it otherwise."""
        return index_in_range(g, len(self.groups), "group", f"a cache of {len(self.groups)} group(s)")

    def attention_groups(self) -> list[int]:
        """Indices of the full and sliding groups, in order."""
        return [g for g, group in enumerate(self.groups) if group.is_attention()]

    def state_groups(self) -> list[int]:
        """Indices of the state groups, in order."""
        return [g for g, group in enumerate(self.groups) if not group.is_attention()]

    def group_config(self, g: int) -> KvCacheConfig:
        """The config attention group `g` is stored with; ValueError for a state group."""
        g = self.check_group(g)
        if g not in self._configs:
            raise ValueError(f"group {g} is a state group: it has no K/V config")
        return self._configs[g]

    def block_size(self, g: int) -> int:
        """Tokens per block of attention group `g`."""
        return self.group_config(g).block_size

    def bytes_per_block(self, g: int) -> int:
        """Bytes one block id of attention group `g` costs across its layers (K and V)."""
        return self.group_config(g).block_bytes_kv_all_layers()

    def slot_bytes(self, g: int) -> int:
        """Bytes one state slot of state group `g` costs across its layers."""
        group = self.groups[self.check_group(g)]
        if group.is_attention():
            raise ValueError(f"group {g} is an attention group: it has no state slots")
        return group.state_bytes_per_layer() * len(group.layers)

    def blocks_per_sequence(self, g: int, context: int) -> int:
        """Blocks of attention group `g` one sequence of `context` tokens holds at most."""
        context = non_negative_int(context, "context")
        group, bs = self.groups[g], self.block_size(g)
        need = -(-context // bs)
        if group.kind == "sliding":
            need = min(need, max_live_blocks(group.window, bs))
        return need

    def bytes_per_sequence(self, g: int, context: int) -> int:
        """Bytes group `g` spends on one sequence of `context` tokens (one slot for a state
        group, checkpoints not counted)."""
        if self.groups[self.check_group(g)].is_attention():
            return self.blocks_per_sequence(g, context) * self.bytes_per_block(g)
        return self.slot_bytes(g)

    def total_bytes_per_sequence(self, context: int) -> int:
        """Bytes one sequence of `context` tokens costs over every group (checkpoints not counted)."""
        return sum(self.bytes_per_sequence(g, context) for g in range(len(self.groups)))

    def checkpoints_per_sequence(self, g: int, context: int) -> int:
        """The most checkpoint slots of state group `g` one sequence of at most `context`
        tokens holds at once (they are held until `cache_prefix` / `free`): one at every
        multiple of `checkpoint_every` in `(0, context]`, and at most two more at other match
        unit ends (the prompt's last whole unit and the branch point of its `add`). 0 for an
        attention group."""
        group = self.groups[self.check_group(g)]
        context = non_negative_int(context, "context")
        if group.is_attention():
            return 0
        units = context // self.unit  # checkpoint positions are match unit ends
        every = group.checkpoint_every // self.unit if group.checkpoint_every else None
        periodic = units // every if every else 0
        return periodic + min(2, units - periodic)

    def held_bytes_per_sequence(self, g: int, context: int) -> int:
        """Bytes group `g` may hold for one sequence of at most `context` tokens: its blocks
        (attention), or its live slot and `checkpoints_per_sequence` checkpoint slots (state)."""
        if self.groups[self.check_group(g)].is_attention():
            return self.bytes_per_sequence(g, context)
        return (1 + self.checkpoints_per_sequence(g, context)) * self.slot_bytes(g)

    def total_held_bytes_per_sequence(self, context: int) -> int:
        """`held_bytes_per_sequence` over every group: what the budget split reserves per sequence."""
        return sum(self.held_bytes_per_sequence(g, context) for g in range(len(self.groups)))


@dataclass(frozen=True)
class GroupBudget:
    """One group's share of a byte budget: its blocks (attention) or slots (state), the
    bytes those take, its cost per token and per sequence at the planned context (one live
    slot for a state group), and the checkpoint slots reserved per sequence (0 for attention)."""

    group: int
    kind: str
    count: int
    bytes: int
    bytes_per_token: float
    bytes_per_sequence: int
    checkpoints_per_sequence: int = 0


def split_budget(config: KvCacheConfig, budget: int, context: int, concurrency: int,
                 checkpoints_per_seq: int | None = None) -> list[GroupBudget]:
    """Split `budget` bytes across `config`'s groups so that `concurrency` sequences of
    `context` tokens fit in every group in the same proportion: each attention group gets
    blocks, each state group slots (one live slot plus the checkpoint slots a sequence of
    `context` tokens can hold, `GroupLayout.checkpoints_per_sequence`, or
    `checkpoints_per_seq` when given), scaled by the one factor the budget allows (rounded
    down). ValueError when not even one sequence fits."""
    layout = GroupLayout(config)
    budget = non_negative_int(budget, "budget")
    context = positive_int(context, "context")
    concurrency = positive_int(concurrency, "concurrency")
    if checkpoints_per_seq is not None:
        checkpoints_per_seq = non_negative_int(checkpoints_per_seq, "checkpoints_per_seq")
    need, ckpts = [], []
    for g, group in enumerate(layout.groups):
        if group.is_attention():
            ckpts.append(0)
            need.append((layout.blocks_per_sequence(g, context), layout.bytes_per_block(g)))
        else:
            ckpts.append(layout.checkpoints_per_sequence(g, context) if checkpoints_per_seq is None
                         else checkpoints_per_seq)
            need.append((1 + ckpts[-1], layout.slot_bytes(g)))
    per_seq_bytes = sum(n * b for n, b in need)
    if per_seq_bytes > budget:
        raise ValueError(f"a budget of {budget} bytes does not hold one sequence of {context} tokens "
                         f"({per_seq_bytes} bytes)")
    seqs = min(concurrency, budget // per_seq_bytes)
    scale = budget / (per_seq_bytes * seqs)  # >= 1: leftover bytes go to every group alike
    rows = []
    for g, ((per_seq, unit_bytes), group) in enumerate(zip(need, layout.groups)):
        count = max(1, int(per_seq * seqs * scale))
        rows.append(GroupBudget(g, group.kind, count, count * unit_bytes,
                                layout.bytes_per_sequence(g, context) / context,
                                layout.bytes_per_sequence(g, context), ckpts[g]))
    while sum(r.bytes for r in rows) > budget:  # float rounding: take one back from the largest
        big = max(range(len(rows)), key=lambda i: rows[i].bytes)
        r = rows[big]
        rows[big] = GroupBudget(r.group, r.kind, r.count - 1, (r.count - 1) * need[big][1], r.bytes_per_token,
                                r.bytes_per_sequence, r.checkpoints_per_sequence)
    return rows
