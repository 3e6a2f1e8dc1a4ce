"""The layout description KvTransfer peers exchange, and the checks made on a peer's: what
cannot be mapped (`layout_differences`), what contradicts itself (`layout_lies`), and the
pools it implies (`pool_geometries`, for pagedkv.tiers.head_plan). A hybrid cache's state
group has its own description (`state_layout_of`): slot rows that move whole."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from ..core.dtype import KvCacheDtype, side_bytes
from ..core.layout import SideLayout
from .head_plan import PoolGeometry

LAYOUT_VERSION = 3
"""Bumped whenever the layout description changes; peers of different versions refuse each other
(2: block layout, TP placement and the sliding window joined the description; 3: the fp8 scales)."""

FORMATS_VERSION = 1
"""The version of docs/FORMATS.md (the byte contract both sides' blocks follow)."""


def layout_of(cache: Any) -> dict:
    """The layout description two caches must agree on to exchange blocks: the byte-format
    versions, block size, layer count, V aliasing, sliding window (`window`, in blocks, or
    None), block layout (`block_layout`, NHD or HND), TP placement (`tp_rank`, `tp_size`),
    the fp8 sides' dequantisation scales (`k_scale`, `v_scale`), and per layer its format, local and global heads, first global head, replication,
    head_dim and K/V strides. The block count is not part of it (the two caches may differ
    in size)."""
    config = cache.config()
    pools = cache.pools()
    layers = []
    for layer in range(config.num_layers):
        heads, head_dim = config.dims_for_layer(layer)
        start, _, global_heads = config.head_range(layer)
        layers.append({
            "dtype": str(config.dtype_for_layer(layer)),
            "num_kv_heads": heads,
            "global_heads": global_heads,
            "head_start": start,
            "replicated": config.v_aliases_k,
            "head_dim": head_dim,
            "k_stride": pools.k_stride(layer),
            "v_stride": pools.v_stride(layer),
        })
    return {
        "layout_version": LAYOUT_VERSION,
        "formats_version": FORMATS_VERSION,
        "block_size": config.block_size,
        "num_layers": config.num_layers,
        "v_aliases_k": config.v_aliases_k,
        "window": config.cache_blocks_per_seq,
        "block_layout": config.layout,
        "tp_rank": config.tp_rank,
        "tp_size": config.tp_size,
        "k_scale": config.k_scale,
        "v_scale": config.v_scale,
        "layers": layers,
    }


def state_layout_of(group: Any) -> dict:
    """The layout description of a hybrid cache's state group (a `StateGroup`): the
    versions, `kind: "state"` and per slot row (layer, then state tensor) its layer, tensor,
    dtype, shape, bytes and slot stride, and the cache's TP placement (`tp_rank`,
    `tp_size`). Slots move whole, so peers must agree on all of it (the slot count and the
    placement aside: between TP sizes a slot is replicated, sent by one rank)."""
    pools = group.pools()
    rows = [{"layer": layer, "tensor": t, "dtype": str(np.dtype(dtype)), "shape": [int(n) for n in shape],
             "nbytes": pools.tensor_bytes(t), "stride": pools.stride(t)}
            for layer in group.layers for t, (shape, dtype) in enumerate(pools.group().state)]
    rank, size = getattr(group, "tp", (0, 1))
    return {"layout_version": LAYOUT_VERSION, "formats_version": FORMATS_VERSION, "kind": "state", "rows": rows,
            "tp_rank": rank, "tp_size": size}


def is_state_layout(layout: dict) -> bool:
    """True for the description of a state group (`state_layout_of`)."""
    return layout.get("kind") == "state"


def _state_differences(mine: dict, theirs: dict) -> list[str]:
    out = []
    for key in ("layout_version", "formats_version", "kind"):
        if mine.get(key) != theirs.get(key):
            out.append(f"{key}: here {mine.get(key)!r}, peer {theirs.get(key)!r}")
    a, b = mine.get("rows", []), theirs.get("rows", [])
    if len(a) != len(b):
        out.append(f"state rows: here {len(a)}, peer {len(b)}")
    tp_note = ""
    if mine.get("tp_size", 1) != theirs.get("tp_size", 1):
        tp_note = (f" (TP size here {mine.get('tp_size', 1)}, peer {theirs.get('tp_size', 1)}: pagedkv does not split "
                   f"a state tensor by head, so every rank must hold the whole state)")
    for i, (x, y) in enumerate(zip(a, b)):
        for key in ("layer", "tensor", "dtype", "shape", "nbytes", "stride"):
            if x.get(key) != y.get(key):
                note = tp_note if key in ("shape", "nbytes", "stride") else ""
                out.append(f"state row {i} {key}: here {x.get(key)!r}, peer {y.get(key)!r}{note}")
    return out


def _state_lies(layout: dict) -> list[str]:
    out = []
    try:
        for i, row in enumerate(layout.get("rows", [])):
            want = int(np.prod(row["shape"], dtype=np.int64)) * np.dtype(row["dtype"]).itemsize
            if row["nbytes"] != want or row["stride"] < want or row["stride"] % 16:
                out.append(f"state row {i} of {row['dtype']}{row['shape']} says {row['nbytes']} bytes in slots of "
                           f"{row['stride']}, but takes {want} (16-byte aligned slots)")
        rank, size = layout.get("tp_rank", 0), layout.get("tp_size", 1)
        if type(rank) is not int or type(size) is not int or not 0 <= rank < size:
            out.append(f"state group at TP rank {rank!r} of {size!r}")
    except (KeyError, TypeError, ValueError) as err:
        out.append(f"broken state row description: {type(err).__name__}: {err}")
    return out


def fingerprint(layout: dict) -> str:
    """A short stable hash of a layout description (what logs and error messages show)."""
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


def layout_differences(mine: dict, theirs: dict) -> list[str]:
    """Every difference between two layout descriptions that a transfer cannot map, as
    `what: here X, peer Y` lines (empty when blocks can move between them). The block
    layout (NHD/HND) and the TP placement may differ: blocks are split and gathered by head.
    Between the same TP sizes every layer's local heads and strides must match; between
    different ones the global heads and the bytes per head. The fp8 scales must match when
    either side has a layer with an fp8 side (the bytes mean `e4m3 * scale`)."""
    if is_state_layout(mine) or is_state_layout(theirs):
        return _state_differences(mine, theirs)
    out = []
    keys = ["layout_version", "formats_version", "block_size", "num_layers", "v_aliases_k", "window"]
    if _has_fp8(mine) or _has_fp8(theirs):
        keys += ["k_scale", "v_scale"]
    for key in keys:
        if mine.get(key) != theirs.get(key):
            out.append(f"{key}: here {mine.get(key)!r}, peer {theirs.get(key)!r}")
    same_tp = mine.get("tp_size") == theirs.get("tp_size")
    keys = ("dtype", "num_kv_heads", "head_dim", "k_stride", "v_stride") if same_tp else (
        "dtype", "global_heads", "head_dim", "k_head_bytes", "v_head_bytes")
    for layer, (a, b) in enumerate(zip(mine.get("layers", []), theirs.get("layers", []))):
        for key in keys:
            here, peer = _layer_field(a, key), _layer_field(b, key)
            if here != peer:
                out.append(f"layer {layer} {key}: here {here!r}, peer {peer!r}")
    return out


def _has_fp8(layout: dict) -> bool:
    """True when a layer of `layout` stores a side in fp8 (an unreadable dtype counts as not)."""
    for entry in layout.get("layers", []):
        try:
            if KvCacheDtype.FP8 in KvCacheDtype.parse(entry["dtype"]).kv_pair():
                return True
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return False


def _layer_field(layer: dict, key: str) -> object:
    if key in ("k_head_bytes", "v_head_bytes"):
        stride, heads = layer.get(key[0] + "_stride"), layer.get("num_kv_heads")
        return stride // heads if isinstance(stride, int) and isinstance(heads, int) and heads > 0 else None
    return layer.get(key)


def layout_lies(layout: dict) -> list[str]:
    """Where a layout description contradicts itself: a stride that its layer's format,
    heads, head_dim and block size do not give, or a head range outside its global heads
    (a peer whose metadata was edited, or that lies about its pools). Empty when consistent."""
    if is_state_layout(layout):
        return _state_lies(layout)
    out = []
    block_size = layout.get("block_size")
    try:
        for layer, entry in enumerate(layout.get("layers", [])):
            k_fmt, v_fmt = KvCacheDtype.parse(entry["dtype"]).kv_pair()
            n = int(block_size) * int(entry["num_kv_heads"]) * int(entry["head_dim"])
            want_v = side_bytes(k_fmt if layout.get("v_aliases_k") else v_fmt, n)
            for side, want in (("k_stride", side_bytes(k_fmt, n)), ("v_stride", want_v)):
                if entry.get(side) != want:
                    out.append(f"layer {layer} {side} is {entry.get(side)!r} but {entry['dtype']} x "
                               f"{entry['num_kv_heads']} heads x {entry['head_dim']} in blocks of {block_size} "
                               f"takes {want}")
            start, heads, total = int(entry["head_start"]), int(entry["num_kv_heads"]), int(entry["global_heads"])
            if start < 0 or start + heads > total:
                out.append(f"layer {layer} holds heads [{start}, {start + heads}) of {total}")
    except (KeyError, TypeError, ValueError) as err:
        out.append(f"broken layer description: {type(err).__name__}: {err}")
    return out


def pool_geometries(layout: dict) -> list[PoolGeometry]:
    """The pools a layout description implies, K then V per layer (K only under V aliasing)."""
    out = []
    for entry in layout["layers"]:
        k_fmt, v_fmt = KvCacheDtype.parse(entry["dtype"]).kv_pair()
        sides = [(k_fmt, entry["k_stride"])]
        if not layout["v_aliases_k"]:
            sides.append((v_fmt, entry["v_stride"]))
        for fmt, stride in sides:
            geometry = SideLayout(fmt, layout["block_size"], entry["num_kv_heads"], entry["head_dim"],
                                  layout.get("block_layout", "NHD"))
            out.append(PoolGeometry(geometry, entry["head_start"], bool(entry["replicated"]), stride))
    return out
