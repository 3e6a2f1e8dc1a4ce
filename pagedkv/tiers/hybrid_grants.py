"""The grant half of `HybridKvTransfer` (a mixin; `HybridKvTransfer` sets `_parts`, `name`
and `_groups_of`): the receiver grants a sender the blocks and state slots of every group
one send may write, the sender refuses anything outside the grant before any group posts,
and each group's KvTransfer checks its notification against its part of the grant (see
pagedkv.tiers.transfer_grants; a violation is a `GrantViolation` from `notifications()`).

A hybrid grant is one `KvTransfer.grant` per group named (each taking a reference on its
blocks or slots until its part of the send arrives, `revoke`, or `close`), bundled into
one ticket (pagedkv.tiers.hybrid_wire). A send under it must name exactly its groups.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import hybrid_wire
from . import transfer_grants
from .hybrid_pull import agent_name, prefixed

_FIELDS = {"receiver": str, "peer": str}


def parse_grant(ticket: object) -> tuple[dict, dict[int, bytes]]:
    """({receiver, peer}, {g: group grant ticket}) of a `HybridKvTransfer.grant` ticket;
    TypeError / ValueError naming what is wrong."""
    return hybrid_wire.unbundle(ticket, hybrid_wire.GRANT_MAGIC, transfer_grants.GRANT_MAGIC,
                                "HybridKvTransfer.grant()", _FIELDS)


class HybridGrantMode:
    """Per-group write grants under one ticket (module docstring)."""

    _parts: list
    name: str

    def grant(self, peer: str, blocks: Mapping[int, Any]) -> bytes:
        """Let `peer` (a hybrid transfer's name) write `blocks[g]` of each named group (held
        here and writable: not free, not prefix-cached) in one `send`; returns the ticket for
        its `send(..., grant=ticket)`. A group's refusal (naming the group and the block)
        revokes the groups granted before it: nothing stays held."""
        if type(peer) is not str:
            raise TypeError(f"peer must be the sender's hybrid transfer name (a str), got {peer!r:.60}")
        if not peer or "#" in peer:
            raise ValueError(f"peer must be the sender's hybrid transfer name (non-empty, without '#'), got {peer!r:.60}")
        groups = self._groups_of(blocks, "blocks")
        tickets: dict[int, bytes] = {}
        try:
            for g in groups:
                try:
                    tickets[g] = self._parts[g].grant(agent_name(peer, g), blocks[g])
                except Exception as err:
                    raise prefixed(g, err) from err
        except BaseException:
            for g, ticket in tickets.items():
                self._parts[g].revoke(ticket)
            raise
        return hybrid_wire.bundle(hybrid_wire.GRANT_MAGIC, {"receiver": self.name, "peer": peer}, tickets,
                                  transfer_grants.GRANT_MAGIC)

    def revoke(self, ticket: bytes) -> bool:
        """Close every group's part of a grant before its send arrived (their references
        dropped; a later notification of it is a GrantViolation). False if none was open."""
        _, tickets = parse_grant(ticket)
        closed = False
        for g, part in sorted(tickets.items()):
            if 0 <= g < len(self._parts):
                closed = self._parts[g].revoke(part) or closed
        return closed

    def open_grants(self) -> dict[int, dict[int, tuple[str, list[int]]]]:
        """{group: {grant id: (peer agent, blocks or slots)}} of every group's open grants."""
        return {g: part.open_grants() for g, part in enumerate(self._parts)}

    def _grant_parts(self, peer: str, groups: list[int], grant: object) -> dict[int, bytes | None]:
        """{g: that group's grant ticket} for a send of `groups` to `peer` (every None without
        a grant); ValueError for another receiver's or sender's grant or other groups."""
        if grant is None:
            return {g: None for g in groups}
        head, tickets = parse_grant(grant)
        if head["receiver"] != peer or head["peer"] != self.name:
            raise ValueError(f"the grant is {head['receiver']!r}'s for {head['peer']!r}, not peer {peer!r}'s for "
                             f"{self.name!r}")
        if sorted(tickets) != groups:
            raise ValueError(f"the grant covers groups {sorted(tickets)} but the send names groups {groups}")
        return tickets
