"""What a `HybridKvTransfer` puts on the wire beyond its groups' own KvTransfer bytes: the
frame each group's request of one send (or pull) carries, and the bundled tickets of an
export or a grant (one ticket per group, under one header).

A frame is `FRAME_MAGIC`, the sender's 8-byte instance nonce, the send's number (u64 LE),
its group count (u32 LE), then the caller's notify bytes. A bundled ticket is a magic, then
JSON `{<head fields>..., "groups": [[g, <group ticket's JSON body>], ...]}`; each group's
ticket is rebuilt as `<group magic> + JSON body` and checked by that group's KvTransfer.
"""

from __future__ import annotations

import json

from . import transfer_metadata

FRAME_MAGIC = b"pagedkv-hybrid-send\x00"
"""The first bytes of the notify message each group's request of a hybrid send carries."""

LEASE_MAGIC = b"pagedkv-hybrid-lease\x00"
"""The first bytes of a `HybridKvTransfer.export` ticket."""

GRANT_MAGIC = b"pagedkv-hybrid-grant\x00"
"""The first bytes of a `HybridKvTransfer.grant` ticket."""

MAX_BUNDLE_BYTES = 1 << 24
"""A bundled ticket is at most this long."""


def frame(nonce: bytes, number: int, count: int, notify: bytes) -> bytes:
    """The frame of send `number` (of `count` groups) of the instance `nonce`."""
    return FRAME_MAGIC + nonce + number.to_bytes(8, "little") + count.to_bytes(4, "little") + bytes(notify)


def parse_frame(message: bytes, max_groups: int) -> tuple[bytes, int, int, bytes] | None:
    """(nonce, number, count, notify) of a frame, or None for a message that is not one
    (or whose count is not in [1, max_groups])."""
    if not message.startswith(FRAME_MAGIC):
        return None
    body = message[len(FRAME_MAGIC):]
    if len(body) < 20:
        return None
    count = int.from_bytes(body[16:20], "little")
    if not 1 <= count <= max_groups:
        return None
    return body[:8], int.from_bytes(body[8:16], "little"), count, body[20:]


def bundle(magic: bytes, head: dict, groups: dict[int, bytes], group_magic: bytes) -> bytes:
    """One ticket of every group's (`groups`: {g: that group's ticket bytes, starting
    `group_magic`}) under `head`'s fields."""
    parts = [[g, json.loads(t[len(group_magic):])] for g, t in sorted(groups.items())]
    return magic + json.dumps(dict(head, groups=parts), sort_keys=True).encode()


def unbundle(blob: object, magic: bytes, group_magic: bytes, what: str, fields: dict) -> tuple[dict, dict[int, bytes]]:
    """(head, {g: group ticket bytes}) of a bundled ticket; TypeError for non-bytes,
    ValueError naming what is wrong (`what` names the ticket's source, `fields` the head's
    {name: type})."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"ticket must be bytes from {what}, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) > MAX_BUNDLE_BYTES or not blob.startswith(magic):
        raise ValueError(f"ticket is not a {what} ticket (starts {blob[:24]!r}, {len(blob)} bytes)")
    text = blob[len(magic):]
    if transfer_metadata.json_depth(text) > 5:
        raise ValueError(f"{what} ticket nests deeper than its groups' tickets")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    groups = body.get("groups") if type(body) is dict else None
    if (type(body) is not dict or any(type(body.get(k)) is not t for k, t in fields.items())
            or type(groups) is not list or not groups
            or any(type(p) is not list or len(p) != 2 or type(p[0]) is not int or type(p[1]) is not dict
                   for p in groups)):
        raise ValueError(f"{what} ticket is damaged: it lacks {', '.join(fields)} or its groups")
    out: dict[int, bytes] = {}
    for g, part in groups:
        if g in out:
            raise ValueError(f"{what} ticket names group {g} twice")
        out[g] = group_magic + json.dumps(part, sort_keys=True).encode()
    return {k: body[k] for k in fields}, out
