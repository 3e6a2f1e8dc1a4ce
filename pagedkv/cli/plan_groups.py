"""`pagedkv plan --groups`: a byte budget split across the layer groups of a hybrid model, for
a stated context length and concurrency, with each group's bytes per token and per sequence."""

from __future__ import annotations

import argparse
import re

import numpy as np

from ..core.config import KvCacheConfig
from ..core.lazy_dtypes import ml
from ..core.layer_groups import LayerGroup
from ..groups.layout import GroupLayout, split_budget


def parse_pattern(text: str) -> list[tuple[str, int | None, int]]:
    """`sliding/1024:5,full:1` -> [("sliding", 1024, 5), ("full", None, 1)]: a cycle of layer
    kinds (a sliding kind with its window), each with how many consecutive layers."""
    items = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(full|sliding|state)(?:/(\d+))?:(\d+)\s*", item)
        if match is None:
            raise ValueError(f"not a KIND[/WINDOW]:COUNT item: {item!r} (example: sliding/1024:5,full:1)")
        kind, window, count = match.group(1), match.group(2), int(match.group(3))
        if (kind == "sliding") != (window is not None):
            raise ValueError(f"{item!r}: a window goes with sliding layers, and only with them")
        if count < 1:
            raise ValueError(f"{item!r}: the count must be at least 1")
        items.append((kind, int(window) if window else None, count))
    return items


def parse_state(text: str) -> tuple:
    """`4x8192:bfloat16,128x64x128:float32` -> ((shape, dtype), ...) of one state layer."""
    specs = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*([\dx]+):(\w+)\s*", item)
        if match is None:
            raise ValueError(f"not a SHAPE:DTYPE item: {item!r} (example: 4x8192:bfloat16)")
        name = match.group(2)
        dtype = np.dtype(ml().bfloat16) if name in ("bf16", "bfloat16") else np.dtype(name)
        specs.append((tuple(int(d) for d in match.group(1).split("x")), dtype))
    return tuple(specs)


def grouped_config(base: dict, pattern: list, num_layers: int, state: tuple,
                   checkpoint_every: int | None = None) -> KvCacheConfig:
    """`base` (KvCacheConfig keywords) with the layer groups of `pattern` cycled over the
    layers (state groups with `checkpoint_every`)."""
    kinds: list[tuple[str, int | None]] = []
    while len(kinds) < num_layers:
        for kind, window, count in pattern:
            kinds.extend([(kind, window)] * count)
    kinds = kinds[:num_layers]
    groups = []
    for key in dict.fromkeys(kinds):
        kind, window = key
        layers = tuple(i for i, k in enumerate(kinds) if k == key)
        if kind == "state":
            if not state:
                raise ValueError("state layers need --state SHAPE:DTYPE,... (one layer's tensors)")
            groups.append(LayerGroup("state", layers, state=state, checkpoint_every=checkpoint_every))
        else:
            groups.append(LayerGroup(kind, layers, window=window))
    if checkpoint_every is not None and not any(g.kind == "state" for g in groups):
        raise ValueError("--checkpoint-every is for state layers, and the pattern has none")
    return KvCacheConfig(layer_groups=tuple(groups), **base)


def format_groups(config: KvCacheConfig, memory: int, context: int, concurrency: int) -> str:
    """The per-group table of `split_budget`, with the all-full-attention cost beside it: a
    state group's bytes/seq is its live slot, its `ckpts/seq` the checkpoint slots reserved
    per sequence besides; the sequences that fit count those checkpoints."""
    layout = GroupLayout(config)
    rows = split_budget(config, memory, context, concurrency)
    lines = [("group", "kind", "layers", "window", "bytes/token", "bytes/seq", "blocks|slots", "GiB", "ckpts/seq")]
    for row in rows:
        group = layout.groups[row.group]
        lines.append((str(row.group), row.kind, str(len(group.layers)), str(group.window or "-"),
                      f"{row.bytes_per_token:,.1f}", f"{row.bytes_per_sequence:,}", f"{row.count:,}",
                      f"{row.bytes / 2**30:.3f}", "-" if group.is_attention() else f"{row.checkpoints_per_sequence:,}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
    total = layout.total_bytes_per_sequence(context)
    full = config.block_bytes_kv_all_layers() * -(-context // config.block_size)  # every layer full attention
    held = layout.total_held_bytes_per_sequence(context)
    fits = memory // held if held else 0
    checkpoints = f", {held:,} with its checkpoints" if held != total else ""
    return (text + f"\n{total:,} bytes per sequence of {context:,} tokens (every layer full attention: {full:,}, "
            f"ratio {total / full:.3f}){checkpoints}; {fits:,} sequences fit")


def run_groups(args: argparse.Namespace, base: dict, memory: int) -> None:
    """Print the grouped plan (`--groups` given)."""
    config = grouped_config(base, args.groups, args.layers, args.state or (), args.checkpoint_every)
    print(f"{args.layers} layers in groups, block {args.block_size}, memory {memory / 2**30:.2f} GiB, "
          f"context {args.context:,}, concurrency {args.concurrency}")
    print(format_groups(config, memory, args.context, args.concurrency))
