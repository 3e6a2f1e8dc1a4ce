"""The disk tier's layout: what one slot of a tier directory holds, and the check that a
directory written by another process holds the same.

A slot holds one block as the host tier keeps it: every row of the region table (each
layer's K pool, then its V pool; one row per layer under `v_aliases_k`) one after the
other, each its host-tier stride long, so mixed formats and dims keep theirs. The layout
description (`describe`) names, per row, the layer, side, stored format, dims and stride,
plus the block size, the formats' byte-contract version, the tier format and the lossless
compression. It is written once, as `layout.json`, when a directory is first used; a later
process with another description is refused (`DiskLayoutMismatch`, every difference named)
before the index or any slot is read. The slot count is not part of it: a directory may be
reopened larger or smaller.

Worked example: 2 layers, BF16, 2 KV heads x 64, block 16: 4 rows of 4096 bytes, a block is
16384 bytes, a slot 16384 (rounded up to 4 KiB); `capacity_bytes=1 << 20` gives 64 slots.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ..errors import KvCacheError

LAYOUT_FILE = "layout.json"
SLOTS_FILE = "slots.bin"
INDEX_FILE = "index.log"
LOCK_FILE = "writer.lock"

DISK_LAYOUT_VERSION = 1
"""Bumped when the meaning of a slot or of an index record changes."""

FORMATS_VERSION = 1
"""The version of docs/FORMATS.md's byte contract a slot's bytes follow."""

SLOT_ALIGN = 4096
"""Slots start on 4 KiB boundaries (page-aligned file I/O)."""

DEFAULT_SCALES = (1.0, 1.0)
"""The fp8 scales a description without `fp8_scales` was written with."""

COMPRESSIONS = (None, "zstd")
"""Lossless compressions a disk tier may apply to a slot's bytes (`zstd`: the zstandard package)."""


class DiskLayoutMismatch(KvCacheError, ValueError):
    """A tier directory was written with another layout; the message lists every difference."""


def slot_bytes_for(block_bytes: int) -> int:
    """Bytes of one slot holding a block of `block_bytes`: rounded up to `SLOT_ALIGN`."""
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


def describe(rows: list[dict], block_size: int, v_aliases_k: bool, tier_format: str | None,
             compression: str | None, block_layout: str = "NHD", fp8_scales: tuple = DEFAULT_SCALES) -> dict:
    """The layout description of a tier whose host blocks have `rows` (dicts with layer, side,
    dtype, num_kv_heads, head_dim, stride: `HostTier.rows()`). `block_layout` ("NHD" or
    "HND", the cache's `layout`) is recorded only when it is not NHD, so an NHD directory's
    description is what it was before layouts existed; `fp8_scales` (the cache's `(k_scale,
    v_scale)`) only when a row is stored in fp8 and they are not (1.0, 1.0), likewise."""
    block_bytes = sum(int(r["stride"]) for r in rows)
    extra = {} if block_layout == "NHD" else {"block_layout": block_layout}
    scales = [float(fp8_scales[0]), float(fp8_scales[1])]
    if scales != list(DEFAULT_SCALES) and any(r.get("dtype") == "fp8" for r in rows):
        extra["fp8_scales"] = scales
    return {**extra,
        "layout_version": DISK_LAYOUT_VERSION,
        "formats_version": FORMATS_VERSION,
        "block_size": int(block_size),
        "v_aliases_k": bool(v_aliases_k),
        "tier_format": tier_format,
        "compression": compression,
        "rows": [dict(r) for r in rows],
        "block_bytes": block_bytes,
        "slot_bytes": slot_bytes_for(block_bytes),
    }


def fingerprint(layout: dict) -> str:
    """A short stable hash of a layout description (the index file's header carries it)."""
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


def differences(mine: dict, theirs: dict) -> list[str]:
    """Every difference between two layout descriptions, as `what: here X, directory Y`."""
    out = []
    for key in ("layout_version", "formats_version", "block_size", "v_aliases_k", "tier_format", "compression",
                "block_bytes", "slot_bytes"):
        if mine.get(key) != theirs.get(key):
            out.append(f"{key}: here {mine.get(key)!r}, directory {theirs.get(key)!r}")
    if mine.get("block_layout", "NHD") != theirs.get("block_layout", "NHD"):
        out.append(f"block_layout: here {mine.get('block_layout', 'NHD')!r}, "
                   f"directory {theirs.get('block_layout', 'NHD')!r}")
    here, there = mine.get("fp8_scales", list(DEFAULT_SCALES)), theirs.get("fp8_scales", list(DEFAULT_SCALES))
    if here != there:
        out.append(f"fp8_scales (k_scale, v_scale): here {here!r}, directory {there!r}")
    a_rows, b_rows = mine.get("rows", []), theirs.get("rows", [])
    if len(a_rows) != len(b_rows):
        out.append(f"region rows: here {len(a_rows)}, directory {len(b_rows)}")
    for i, (a, b) in enumerate(zip(a_rows, b_rows)):
        for key in ("layer", "side", "tensor", "dtype", "num_kv_heads", "head_dim", "shape", "stride"):
            if a.get(key) != b.get(key):
                out.append(f"row {i} (layer {a.get('layer')} {a.get('side')}) {key}: here {a.get(key)!r}, "
                           f"directory {b.get(key)!r}")
    return out


def read_layout(directory: str) -> dict | None:
    """The layout description stored in `directory`, or None when it has none yet.
    KvCacheError for a file that is not one."""
    return read_description(os.path.join(directory, LAYOUT_FILE), "a disk tier layout", "rows")


def read_description(path: str, what: str, key: str) -> dict | None:
    """The JSON object stored at `path`, or None when there is no such file. KvCacheError
    naming `path` as not `what` when it is not JSON or not an object holding `key`."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        found = json.loads(text)
    except ValueError as err:
        raise KvCacheError(f"{path} is not {what} ({err})") from None
    if not isinstance(found, dict) or key not in found:
        raise KvCacheError(f"{path} is not {what} (no {key})")
    return found


def write_layout(directory: str, layout: dict, capacity_slots: int) -> None:
    """Write `layout` (and the slot count it was created with) atomically: a temporary file,
    fsync, rename, fsync of the directory."""
    path = os.path.join(directory, LAYOUT_FILE)
    tmp = path + ".tmp"
    data = json.dumps({**layout, "capacity_slots": int(capacity_slots)}, sort_keys=True, indent=1).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """fsync a directory so that a rename in it is durable (best effort where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def comparable(layout: dict) -> dict[str, Any]:
    """`layout` without the fields a reopening may change (the slot count)."""
    return {k: v for k, v in layout.items() if k != "capacity_slots"}
