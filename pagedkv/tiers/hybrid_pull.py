"""The pull half of `HybridKvTransfer` (a mixin; `HybridKvTransfer` sets `_parts`, `_cache`,
`name`, `_peer`, `_groups_of`, `_next_frame` and `_handle`): a sequence's blocks of every
group and its state slots (live slot, checkpoints) exported under one lease per group,
read by the receiver into what it allocated.

`export({g: ids}, ttl)` opens a lease in each named group's KvTransfer (each holding a
reference on its blocks or slots until the puller completes it, it expires, or `close`)
and bundles the group tickets into one (pagedkv.tiers.hybrid_wire); a refused group undoes
the leases opened before it. `pull(peer, ticket, {g: dst})` runs every group's checks
(`KvTransfer.checked_pull`: the deadline, the lists, the TP ranks) before any read is
posted, then one pull per group; each carries the send frame, so the exporter's
`notifications()` gives `(puller, notify)` once every group's read is complete and checked.
An expired lease frees that group's blocks (every group expires at the same deadline), and
a read finishing after it fails with `LeaseExpired` from the handle.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..core.log import get_logger
from . import hybrid_wire
from . import leases as pull_leases

_log = get_logger("transfer")


def agent_name(name: str, g: int) -> str:
    """The agent name of group `g` of the hybrid transfer `name`."""
    return f"{name}#g{g}"


def prefixed(g: int, err: BaseException) -> BaseException:
    """`err` again (its type) with `group g: ` before its message."""
    try:
        return type(err)(f"group {g}: {err}")
    except Exception:  # noqa: BLE001 - an error type that takes other arguments stays as it is
        return err


class HybridPullMode:
    """Export under leases and pull with NIXL reads, every group at once (module docstring)."""

    _parts: list
    name: str

    def export(self, blocks: Mapping[int, Any], ttl: float) -> bytes:
        """Hold `blocks[g]` (group g's blocks, or a state group's slots; each held) under a
        lease per group for `ttl` seconds and return the one ticket a peer's `pull` takes.
        The caller may free its own references at once. A group's refusal (ValueError /
        IndexError naming the group: an empty, repeated or free entry, a bad ttl) releases
        the leases already opened: nothing stays held."""
        groups = self._groups_of(blocks, "blocks")
        tickets: dict[int, bytes] = {}
        try:
            for g in groups:
                try:
                    tickets[g] = self._parts[g].export(blocks[g], ttl)
                except Exception as err:
                    raise prefixed(g, err) from err
        except BaseException:
            for g, ticket in tickets.items():
                self._parts[g]._release_lease(pull_leases.parse_ticket(ticket)["lease"], "export refused")
            raise
        return hybrid_wire.bundle(hybrid_wire.LEASE_MAGIC, {"sender": self.name}, tickets, pull_leases.TICKET_MAGIC)

    def open_leases(self) -> dict[int, dict[int, list[int]]]:
        """{group: {lease id: blocks or slots}} of every group's open leases."""
        return {g: part.open_leases() for g, part in enumerate(self._parts)}

    def expire_leases(self) -> int:
        """Release every group's leases past their deadline (`notifications()` does this
        too); returns how many, over every group."""
        return sum(part.expire_leases() for part in self._parts)

    def pull(self, peer: str, ticket: bytes, dst: Mapping[int, Any], notify: bytes = b"") -> Any:
        """Read the peer's export `ticket` into `dst[g]` (this cache's blocks or slots, each
        held) for every group the ticket names, split or gathered by head as `send` is;
        returns the handle to wait on (LeaseExpired from it when a group's lease was
        released before its read finished: its destination holds undefined bytes). Every
        group's checks before anything is read: UnknownPeer, a ticket of another sender, a
        `dst` naming other groups than the ticket, then each group's `checked_pull`
        (LeaseExpired for a deadline already past, the lists, the TP ranks: an error naming
        the group)."""
        self._peer(peer)
        head, tickets = hybrid_wire.unbundle(ticket, hybrid_wire.LEASE_MAGIC, pull_leases.TICKET_MAGIC,
                                             "HybridKvTransfer.export()", {"sender": str})
        if head["sender"] != peer:
            raise ValueError(f"the ticket is from {head['sender']!r}, not peer {peer!r}")
        groups = self._groups_of(dst, "dst")
        if groups != sorted(tickets):
            raise ValueError(f"the ticket holds groups {sorted(tickets)} but dst names {groups}")
        if not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        for g in groups:
            try:
                self._parts[g].checked_pull(agent_name(peer, g), tickets[g], dst[g])
            except Exception as err:
                raise prefixed(g, err) from err
        message = self._next_frame(len(groups), notify)
        handles: dict = {}
        for g in groups:
            try:
                handles[g] = self._parts[g].pull(agent_name(peer, g), tickets[g], dst[g], message)
            except BaseException:
                self._settle(handles, peer)
                raise
        _log.debug("hybrid_pull_posted", name=self.name, peer=peer, groups=groups)
        return self._handle(handles)
