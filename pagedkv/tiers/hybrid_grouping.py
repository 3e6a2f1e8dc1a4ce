"""The grouping two `HybridKvTransfer` peers must agree on before any group connects: per
group its kind, global layers, window (tokens), block size and state tensors. Each group's
own KvTransfer checks the bytes of its pools (formats, heads, strides, TP placement); these
are the facts a group's pool description does not carry (a sliding window, which global
layers a group holds, full vs sliding), so a peer differing in them would connect and write
blocks meaning something else.

Worked example: peers of groups (full [0], sliding [1] window 8, state [2]) and (full [0],
sliding [1] window 16, state [2]) are refused with "group 1 window: here 8, peer 16".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cache.hybrid_cache import HybridKvCache

FIELDS = ("kind", "layers", "window", "block_size", "state")
"""The fields of one group's description, in the order differences are named."""


def grouping_of(cache: HybridKvCache) -> list[dict]:
    """One description per group of `cache`: kind, global layers, window (tokens, or None),
    block size (None for a state group) and state tensors as [shape, dtype name] pairs."""
    layout = cache.layout()
    out = []
    for g, group in enumerate(layout.groups):
        out.append({
            "kind": group.kind,
            "layers": [int(x) for x in group.layers],
            "window": None if group.window is None else int(group.window),
            "block_size": layout.block_size(g) if group.is_attention() else None,
            "state": [[[int(n) for n in shape], str(np.dtype(dtype))] for shape, dtype in group.state],
        })
    return out


def grouping_differences(mine: list[dict], theirs: Any, tp_sizes: tuple = (1, 1)) -> list[str]:
    """Every difference between two groupings, as `group g field: here X, peer Y` lines
    (the group count first; a state tensor's as `group g state[i] shape` / `dtype`); empty
    when they agree. `tp_sizes` (here, peer): when they differ, a state tensor's line says
    that state is never split by head. A peer's grouping that is not a list of objects is
    one line saying so."""
    if type(theirs) is not list or any(type(g) is not dict for g in theirs):
        return [f"groups: the peer's grouping is not a list of group descriptions ({type(theirs).__name__})"]
    if len(mine) != len(theirs):
        return [f"groups: here {len(mine)}, peer {len(theirs)} "
                f"(here {[g['kind'] for g in mine]}, peer {[g.get('kind') for g in theirs]!r:.120})"]
    note = ""
    if tp_sizes[0] != tp_sizes[1]:
        note = (f" (TP size here {tp_sizes[0]}, peer {tp_sizes[1]!r:.20}: pagedkv does not split a state tensor by "
                f"head, so every rank must hold the whole state)")
    out = []
    for g, (a, b) in enumerate(zip(mine, theirs)):
        for key in FIELDS:
            here, peer = a.get(key), b.get(key)
            if here == peer:
                continue
            if key == "state" and type(peer) is list and len(peer) == len(here):
                for i, (x, y) in enumerate(zip(here, peer)):
                    y = y if type(y) is list and len(y) == 2 else [y, None]
                    for name, u, v in (("shape", x[0], y[0]), ("dtype", x[1], y[1])):
                        if u != v:
                            out.append(f"group {g} state[{i}] {name}: here {u!r}, peer {v!r:.120}{note}")
                continue
            out.append(f"group {g} {key}: here {here!r}, peer {peer!r:.120}")
    return out
