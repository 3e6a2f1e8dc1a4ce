"""The bytes of `KvTransfer.metadata()`, and their parse with every check a hostile blob needs.

Layout of a blob: `METADATA_MAGIC`, the JSON part's length (8 bytes, little endian), the JSON
part (the peer's name, block count, memory kind, pools, lease words, layout description, the
NIXL part's length and BLAKE2b digest, and an optional token tag), then NIXL's agent
metadata. `parse` bounds the sizes before any JSON work (`MAX_JSON_BYTES`, `MAX_NIXL_BYTES`),
bounds the nesting depth before `json.loads` (`MAX_DEPTH`), checks every field's type and
range, and checks the NIXL part against its length and digest before NIXL sees it (a
truncated blob never reaches `add_remote_agent`). Every refusal is `BadPeerMetadata`, a
`TransferError` and `ValueError` naming what is wrong; nothing is loaded.

The token tag: with a shared `token` (bytes), `tag(token, name, nixl)` is an HMAC-SHA256 of
the peer's name and the NIXL part's digest, so a receiver holding the same token accepts the
blob and no other party can make one that passes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import numpy as np

from .transfer_errors import TransferError
from .transfer_layout import LAYOUT_VERSION

METADATA_MAGIC = b"pagedkv-kvtransfer\x00"
"""The first bytes of every `KvTransfer.metadata()` blob."""

MAX_JSON_BYTES = 1 << 20
"""The JSON part of a blob is at most this long (a layer's entry is ~200 bytes: room for ~5,000 layers)."""

MAX_NIXL_BYTES = 16 << 20
"""NIXL's part of a blob is at most this long (one remote agent's connection details and
memory descriptors: a few KiB per registered pool)."""

MAX_DEPTH = 8
"""The JSON part nests at most this deep (the layout's layer entries are at depth 4)."""

MAX_NAME = 256
"""An agent name is at most this many characters."""

_INT_LIMIT = 1 << 63


class BadPeerMetadata(TransferError, ValueError):
    """A peer's metadata blob was refused before anything was loaded; the message names the
    field (or the bound) that is wrong."""


def digest(nixl: bytes) -> str:
    """The hex BLAKE2b (16 bytes) of a NIXL part."""
    return hashlib.blake2b(nixl, digest_size=16).hexdigest()


def tag(token: bytes, name: str, nixl_digest: str) -> str:
    """The token tag of a blob: HMAC-SHA256 under `token` of the name and the NIXL digest."""
    return hmac.new(token, name.encode() + b"\x00" + nixl_digest.encode(), hashlib.sha256).hexdigest()


def encode(info: dict, nixl: bytes, token: bytes | None) -> bytes:
    """The blob of `info` (the JSON fields) and `nixl`; the NIXL length, digest and, with a
    token, the tag are added to the JSON part."""
    info = dict(info, nixl_bytes=len(nixl), nixl_digest=digest(nixl))
    if token is not None:
        info["token_tag"] = tag(token, info["name"], info["nixl_digest"])
    text = json.dumps(info, sort_keys=True).encode()
    return METADATA_MAGIC + len(text).to_bytes(8, "little") + text + nixl


def json_depth(text: bytes) -> int:
    """The deepest nesting of `[`/`{` in JSON `text`, outside strings (vectorised)."""
    raw = np.frombuffer(text, dtype=np.uint8)
    if not raw.size:
        return 0
    quote = raw == ord('"')
    escaped = np.zeros(raw.size, dtype=bool)
    backslash = np.flatnonzero(raw == ord("\\"))
    if backslash.size:  # a quote after an odd run of backslashes is escaped
        run_odd = np.zeros(raw.size, dtype=bool)
        count = 0
        previous = -2
        for i in backslash.tolist():  # only strings with escapes pay this loop
            count = count + 1 if i == previous + 1 else 1
            previous = i
            run_odd[i] = count % 2 == 1
        escaped[1:] = run_odd[:-1]
    real_quote = quote & ~escaped
    inside = (np.cumsum(real_quote) % 2 == 1) & ~real_quote
    step = np.zeros(raw.size, dtype=np.int64)
    step[(raw == ord("[")) | (raw == ord("{"))] = 1
    step[(raw == ord("]")) | (raw == ord("}"))] = -1
    step[inside] = 0
    return int(np.cumsum(step).max(initial=0))


def int_field(value: object, what: str, low: int = 0) -> int:
    """`value` when an int in [low, 2**63); BadPeerMetadata naming field `what` otherwise."""
    if type(value) is not int or not low <= value < _INT_LIMIT:
        raise BadPeerMetadata(f"peer_metadata field {what} must be an int in [{low}, 2**63), got {value!r:.80}")
    return value


def str_field(value: object, what: str, limit: int = MAX_NAME) -> str:
    """`value` when a non-empty str of at most `limit` characters without NUL; BadPeerMetadata
    naming field `what` otherwise."""
    if type(value) is not str or not value or len(value) > limit or "\x00" in value:
        raise BadPeerMetadata(
            f"peer_metadata field {what} must be a non-empty str of at most {limit} characters without NUL, "
            f"got {value!r:.80}")
    return value


_LAYOUT_INTS = ("layout_version", "formats_version", "block_size", "num_layers", "tp_rank", "tp_size")
_LAYER_INTS = ("num_kv_heads", "global_heads", "head_start", "head_dim", "k_stride", "v_stride")


MAX_STATE_ROWS = 1 << 14
"""A state group's layout lists at most this many slot rows (layers x state tensors)."""


def _state_layout(layout: dict) -> dict:
    """The checks of a hybrid cache's state-group layout (`transfer_layout.state_layout_of`)."""
    for key in ("formats_version", "tp_rank", "tp_size"):
        int_field(layout.get(key), f"layout.{key}", 1 if key == "tp_size" else 0)
    rows = layout.get("rows")
    if type(rows) is not list or not 1 <= len(rows) <= MAX_STATE_ROWS:
        raise BadPeerMetadata(f"peer_metadata field layout.rows must be a list of 1 to {MAX_STATE_ROWS} state rows, "
                              f"got {type(rows).__name__} {rows!r:.40}")
    for i, row in enumerate(rows):
        if type(row) is not dict:
            raise BadPeerMetadata(f"peer_metadata field layout.rows[{i}] must be an object, got {row!r:.40}")
        for key in ("layer", "tensor", "nbytes", "stride"):
            int_field(row.get(key), f"layout.rows[{i}].{key}", 1 if key in ("nbytes", "stride") else 0)
        str_field(row.get("dtype"), f"layout.rows[{i}].dtype", 64)
        shape = row.get("shape")
        if type(shape) is not list or len(shape) > 8:
            raise BadPeerMetadata(f"peer_metadata field layout.rows[{i}].shape must be a list of at most 8 ints, "
                                  f"got {shape!r:.40}")
        for n in shape:
            int_field(n, f"layout.rows[{i}].shape", 1)
    return layout


def _layout(layout: object) -> dict:
    if type(layout) is not dict:
        raise BadPeerMetadata(f"peer_metadata field layout must be an object, got {type(layout).__name__}")
    version = layout.get("layout_version")
    if version != LAYOUT_VERSION:
        raise BadPeerMetadata(f"peer_metadata layout version {version!r:.40} is not {LAYOUT_VERSION}")
    if layout.get("kind") == "state":
        return _state_layout(layout)
    for key in _LAYOUT_INTS:
        int_field(layout.get(key), f"layout.{key}", 1 if key in ("block_size", "num_layers", "tp_size") else 0)
    if type(layout.get("v_aliases_k")) is not bool:
        raise BadPeerMetadata(f"peer_metadata field layout.v_aliases_k must be a bool, got {layout.get('v_aliases_k')!r:.40}")
    if layout.get("window") is not None:
        int_field(layout.get("window"), "layout.window", 1)
    if layout.get("block_layout") not in ("NHD", "HND"):
        raise BadPeerMetadata(f"peer_metadata field layout.block_layout must be NHD or HND, got {layout.get('block_layout')!r:.40}")
    layers = layout.get("layers")
    if type(layers) is not list or len(layers) != layout["num_layers"]:
        raise BadPeerMetadata(f"peer_metadata field layout.layers must be a list of num_layers "
                              f"({layout['num_layers']}) entries, got {type(layers).__name__} {layers!r:.40}")
    for i, entry in enumerate(layers):
        if type(entry) is not dict:
            raise BadPeerMetadata(f"peer_metadata field layout.layers[{i}] must be an object, got {entry!r:.40}")
        for key in _LAYER_INTS:
            int_field(entry.get(key), f"layout.layers[{i}].{key}", 1 if key in ("global_heads", "head_dim") else 0)
        str_field(entry.get("dtype"), f"layout.layers[{i}].dtype", 64)
        if type(entry.get("replicated")) is not bool:
            raise BadPeerMetadata(f"peer_metadata field layout.layers[{i}].replicated must be a bool")
    return layout


def parse(blob: object) -> tuple[dict, bytes]:
    """(info, NIXL part) of a peer's blob, every field checked (see the module docstring);
    TypeError for a blob that is not bytes, BadPeerMetadata naming anything else wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"peer_metadata must be bytes from KvTransfer.metadata(), got {type(blob).__name__}")
    view = memoryview(blob).cast("B")
    head = len(METADATA_MAGIC)
    if view.nbytes > head + 8 + MAX_JSON_BYTES + MAX_NIXL_BYTES:
        raise BadPeerMetadata(f"peer_metadata is {view.nbytes} bytes, over the bound of "
                              f"{head + 8 + MAX_JSON_BYTES + MAX_NIXL_BYTES} (padding or not KvTransfer metadata)")
    if bytes(view[:head]) != METADATA_MAGIC or view.nbytes < head + 8:
        raise BadPeerMetadata(f"peer_metadata is not KvTransfer metadata (starts {bytes(view[:24])!r})")
    size = int.from_bytes(view[head : head + 8], "little")
    if size > MAX_JSON_BYTES:
        raise BadPeerMetadata(f"peer_metadata declares a {size}-byte layout description, over the bound of {MAX_JSON_BYTES}")
    if head + 8 + size > view.nbytes:
        raise BadPeerMetadata(f"peer_metadata is truncated: its layout description needs {size} bytes, "
                              f"{view.nbytes - head - 8} follow the header")
    text = bytes(view[head + 8 : head + 8 + size])
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise BadPeerMetadata(f"peer_metadata nests {depth} levels deep, over the bound of {MAX_DEPTH}")
    try:
        info = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise BadPeerMetadata(f"peer_metadata has a broken layout description: {err}") from None
    fields = ("name", "num_blocks", "mem_type", "device_id", "layout", "pools", "leases", "nixl_bytes", "nixl_digest")
    if type(info) is not dict or any(k not in info for k in fields):
        raise BadPeerMetadata(f"peer_metadata lacks one of {', '.join(fields)}")
    str_field(info["name"], "name")
    int_field(info["num_blocks"], "num_blocks", 1)
    if info["mem_type"] not in ("DRAM", "VRAM"):
        raise BadPeerMetadata(f"peer_metadata field mem_type must be DRAM or VRAM, got {info['mem_type']!r:.40}")
    int_field(info["device_id"], "device_id")
    int_field(info["leases"], "leases")
    layout = _layout(info["layout"])
    pools = info["pools"]
    most = len(layout["rows"]) if layout.get("kind") == "state" else 2 * layout["num_layers"]
    if type(pools) is not list or len(pools) > most:
        raise BadPeerMetadata(f"peer_metadata field pools must be a list of at most {most} "
                              f"pools, got {type(pools).__name__} of {len(pools) if type(pools) is list else '?'}")
    for i, pool in enumerate(pools):
        if type(pool) is not list or len(pool) != 4 or type(pool[1]) is not str:
            raise BadPeerMetadata(f"peer_metadata field pools[{i}] must be [layer, side, address, stride], got {pool!r:.60}")
        for j, what in ((0, "layer"), (2, "address"), (3, "stride")):
            int_field(pool[j], f"pools[{i}].{what}")
    nixl = bytes(view[head + 8 + size :])
    declared = int_field(info["nixl_bytes"], "nixl_bytes")
    if declared > MAX_NIXL_BYTES:
        raise BadPeerMetadata(f"peer_metadata declares a {declared}-byte NIXL part, over the bound of {MAX_NIXL_BYTES}")
    if len(nixl) != declared:
        raise BadPeerMetadata(f"peer_metadata's NIXL part is {len(nixl)} bytes but {declared} were written "
                              f"({'truncated' if len(nixl) < declared else 'padded'}): nothing was loaded")
    got_digest = info["nixl_digest"]
    if (type(got_digest) is not str or not got_digest.isascii()  # compare_digest refuses non-ASCII str
            or not hmac.compare_digest(got_digest, digest(nixl))):
        raise BadPeerMetadata("peer_metadata's NIXL part does not match its digest (altered in transit): nothing was loaded")
    if "token_tag" in info and type(info["token_tag"]) is not str:
        raise BadPeerMetadata(f"peer_metadata field token_tag must be a str, got {info['token_tag']!r:.40}")
    return info, nixl


def check_token(info: dict, token: bytes | None) -> bool:
    """True when `token` is None or the blob carries the tag `token` gives."""
    if token is None:
        return True
    got: Any = info.get("token_tag")
    return type(got) is str and got.isascii() and hmac.compare_digest(got, tag(token, info["name"], info["nixl_digest"]))
