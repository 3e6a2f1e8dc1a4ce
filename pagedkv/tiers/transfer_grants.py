"""Write grants: the receiver names the blocks one transfer may write.

The receiver's `KvTransfer.grant(peer, blocks)` checks that each block is held and writable
(not free, not in its prefix cache), takes one reference on each (so none can be freed and
reused before the bytes land) and returns a ticket (bytes) for the sender, handed over out
of band like metadata. The sender's `send(..., grant=ticket)` refuses, before anything is
sent, a ticket of another receiver and any destination block the grant does not name, and
prefixes its notification with `GRANT_MAGIC`, the grant id and a NUL. The receiver's
`notifications()` checks each such notification against its grants: the grant must be open
and made for that peer; then its references are dropped and the caller's message is
delivered. A receiver made with `require_grants=True` states it in its metadata (senders
then refuse a send without a grant) and treats a plain notification as a violation. A
violation raises `GrantViolation` naming the peer and the grant (other messages stay queued).

Grants protect against mistakes of a trusted peer (a stale block list, a race with the
receiver's own frees). They cannot stop a hostile peer: NIXL registers whole pools (see
the README's trust model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .transfer_errors import TransferError

GRANT_MAGIC = b"pagedkv-grant\x00"
"""The first bytes of a grant ticket, and of a notification of a granted send."""

MAX_TICKET_BYTES = 1 << 22
"""A grant ticket is at most this long (about 400,000 block ids)."""


class GrantViolation(TransferError):
    """A notification arrived for a grant that is not open, of another peer, or without a
    grant where one is required: the peer wrote blocks the receiver did not grant it."""


@dataclass(frozen=True)
class Grant:
    """One open grant: its id, the peer it names and the blocks it lets that peer write."""

    grant_id: int
    peer: str
    blocks: tuple


def ticket(receiver: str, grant: Grant) -> bytes:
    """The bytes the sender's `send(..., grant=)` takes."""
    body = {"receiver": receiver, "grant": grant.grant_id, "peer": grant.peer, "blocks": list(grant.blocks)}
    return GRANT_MAGIC + json.dumps(body).encode()


def parse_ticket(blob: object) -> dict:
    """The body of a grant ticket; TypeError for non-bytes, ValueError naming what is wrong."""
    if not isinstance(blob, (bytes, bytearray)):
        raise TypeError(f"grant must be a ticket from KvTransfer.grant() (bytes), got {type(blob).__name__}")
    if len(blob) > MAX_TICKET_BYTES or not bytes(blob).startswith(GRANT_MAGIC):
        raise ValueError(f"grant is not a KvTransfer.grant() ticket (starts {bytes(blob[:20])!r}, {len(blob)} bytes)")
    try:
        body = json.loads(bytes(blob[len(GRANT_MAGIC):]))
    except (ValueError, RecursionError):
        body = None
    if (type(body) is not dict or type(body.get("receiver")) is not str or type(body.get("peer")) is not str
            or type(body.get("grant")) is not int or type(body.get("blocks")) is not list
            or any(type(b) is not int for b in body["blocks"])):
        raise ValueError("grant ticket is damaged: it lacks receiver, peer, grant or blocks")
    return body


def notify_prefix(grant_id: int) -> bytes:
    """What a granted send puts before the caller's notify message."""
    return GRANT_MAGIC + str(grant_id).encode() + b"\x00"


def split_notify(message: bytes) -> tuple[int | None, bytes]:
    """(grant id, the caller's message) of a notification; (None, message) without a grant
    prefix; (-1, message) for a prefix that does not parse."""
    if not message.startswith(GRANT_MAGIC):
        return None, message
    rest = message[len(GRANT_MAGIC):]
    number, sep, user = rest.partition(b"\x00")
    if not sep or not number.isdigit() or len(number) > 20:
        return -1, message
    return int(number), user


class GrantTable:
    """The receiver's open grants, by id."""

    def __init__(self) -> None:
        self._grants: dict[int, Grant] = {}
        self._next = 1

    def open(self, peer: str, blocks: list[int]) -> Grant:
        """Record a new grant."""
        grant = Grant(self._next, peer, tuple(blocks))
        self._next += 1
        self._grants[grant.grant_id] = grant
        return grant

    def get(self, grant_id: int) -> Grant | None:
        """The open grant of that id, or None."""
        return self._grants.get(grant_id)

    def close(self, grant_id: int) -> Grant | None:
        """Forget a grant; the grant, or None if it was not open."""
        return self._grants.pop(grant_id, None)

    def open_ids(self) -> list[int]:
        """The ids of the open grants, oldest first."""
        return list(self._grants)


class GrantMode:
    """The grant half of `KvTransfer` (a mixin: `KvTransfer` sets `_cache`, `_grants`,
    `_num_blocks`, `name` and `_check_open`)."""

    _grants: GrantTable
    name: str

    def grant(self, peer: str, blocks) -> bytes:
        """Let `peer` (an agent name) write `blocks` of this cache in one `send`: each must be
        held here and writable (not free, not in the prefix cache), and each gets one more
        reference until the send's notification arrives (or `revoke`, or `close`). Returns
        the ticket for the sender's `send(..., grant=ticket)`. Refused naming the block or
        the peer, with nothing held."""
        from .pull_mode import blocks_of

        self._check_open()
        if type(peer) is not str or not peer:
            raise TypeError(f"peer must be the sender's agent name (a non-empty str), got {peer!r:.60}")
        dst = blocks_of(blocks, self._num_blocks, "blocks", "this cache")
        if not dst:
            raise ValueError("blocks is empty: nothing to grant")
        if len(set(dst)) != len(dst):
            raise ValueError(f"blocks lists a block twice: {dst}")
        self._cache.allocator().check_writable(dst)  # free or prefix-cached: refused naming it
        self._cache.inc_refs(dst)
        return ticket(self.name, self._grants.open(peer, dst))

    def revoke(self, grant) -> bool:
        """Close a grant (its ticket, or id) before its send arrived: its references are
        dropped; a later notification of it is a GrantViolation. False if it was not open."""
        self._check_open()
        grant_id = parse_ticket(grant)["grant"] if isinstance(grant, (bytes, bytearray)) else grant
        closed = self._grants.close(grant_id) if type(grant_id) is int else None
        if closed is None:
            return False
        self._cache.free_blocks(list(closed.blocks))
        return True

    def open_grants(self) -> dict[int, tuple[str, list[int]]]:
        """The open grants: id -> (peer, blocks)."""
        return {i: (g.peer, list(g.blocks)) for i in self._grants.open_ids() if (g := self._grants.get(i))}

    def _granted(self, peer: str, message: bytes, required: bool) -> tuple[bytes | None, str | None]:
        """(the caller's message, None) for a notification its grant allows, closing the
        grant; (None, why) for a violation."""
        grant_id, user = split_notify(message)
        if grant_id is None:
            return (None, f"peer {peer!r} sent a notification without a grant; this receiver requires grants") \
                if required else (message, None)
        grant = self._grants.get(grant_id)
        if grant is None or grant.peer != peer:
            what = "no open grant" if grant is None else f"a grant made for {grant.peer!r}"
            return None, f"peer {peer!r} notified a transfer under grant {grant_id}, which is {what}"
        self._grants.close(grant_id)
        self._cache.free_blocks(list(grant.blocks))
        return user, None

    def _close_grants(self) -> None:
        for grant_id in self._grants.open_ids():
            grant = self._grants.close(grant_id)
            if grant is not None and not self._cache.allocator().released():
                self._cache.free_blocks(list(grant.blocks))
