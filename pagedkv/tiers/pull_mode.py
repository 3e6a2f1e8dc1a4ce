"""The pull half of `KvTransfer` (pagedkv.tiers.leases tells the protocol): `export` on the
sender, `pull` on the receiver, lease expiry and completion. A mixin: `KvTransfer` sets every
attribute it reads (`_cache`, `_agent`, `_leases`, `_peers`, ...)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.log import get_logger
from ..core.validate import block_list
from . import leases as pull_leases
from .transfer_errors import LeaseExpired, TransferError

_log = get_logger("transfer")


def blocks_of(blocks: object, num_blocks: int, what: str, whose: str) -> list[int]:
    """`validate.block_list`, with the argument and the cache it indexes named in an IndexError."""
    try:
        return block_list(blocks, num_blocks, what)
    except IndexError as err:
        raise IndexError(f"{what}: {err} ({whose})") from None


class PullMode:
    """Export under leases and pull with NIXL reads (see pagedkv.tiers.leases)."""

    _cache: Any
    _agent: Any
    _leases: pull_leases.LeaseTable
    _num_blocks: int
    _mem_type: str
    _requests: dict
    name: str

    def export(self, blocks: Any, ttl: float) -> bytes:
        """Hold `blocks` (this cache's, each allocated) under a lease for `ttl` seconds and
        return the ticket a receiver's `pull` takes (bytes, handed over out of band). Each
        block gets one more reference, dropped when the puller reports completion, when
        the lease expires (`expire_leases`, run by `notifications()`) or at `close()`; the
        caller may free its own references at once. ValueError for an empty list, a
        repeated or free block or a ttl that is not a positive number, with nothing held."""
        self._check_open()
        src = blocks_of(blocks, self._num_blocks, "blocks", "this cache")
        if not src:
            raise ValueError("blocks is empty: nothing to export")
        if len(set(src)) != len(src):
            raise ValueError(f"blocks lists a block twice: {src}")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ValueError(f"ttl must be a number of seconds > 0, got {ttl!r}")
        free = next((b for b in src if self._cache.ref_count(b) == 0), None)
        if free is not None:
            raise ValueError(f"block {free} is free (export only blocks the cache holds)")
        lease = self._leases.open(src, float(ttl))
        self._cache.inc_refs(src)
        _log.debug("kv_lease_opened", name=self.name, lease=lease.lease_id, blocks=len(src), ttl=ttl)
        return pull_leases.ticket(self.name, lease)

    def open_leases(self) -> dict[int, list[int]]:
        """The open leases: lease id -> the blocks it holds."""
        return {i: list(self._leases._leases[i].blocks) for i in self._leases.open_ids()}

    def expire_leases(self) -> int:
        """Release every lease whose deadline has passed (its word cleared, then its blocks'
        references dropped); returns how many."""
        self._check_open()
        expired = self._leases.expired()
        for lease_id in expired:
            self._release_lease(lease_id, "expired")
        return len(expired)

    def _release_lease(self, lease_id: int, why: str) -> None:
        lease = self._leases.close(lease_id)
        if lease is not None:
            self._cache.free_blocks(list(lease.blocks))
            _log.debug("kv_lease_released", name=self.name, lease=lease_id, blocks=len(lease.blocks), why=why)

    def _lease_done(self, peer: str, payload: bytes) -> None:
        try:
            lease_id = int(payload.decode())
        except ValueError:
            _log.warning("kv_lease_done_unreadable", name=self.name, peer=peer, payload=payload[:32].hex())
            return
        self._release_lease(lease_id, f"pulled by {peer}")

    def checked_pull(self, peer: str, ticket: bytes, dst_blocks: Any, notify: bytes = b"") -> tuple:
        """(peer, ticket body, src, dst, notify) of a `pull` after every one of its checks,
        nothing read: for a caller that must refuse a pull of several agents before any of
        them posts."""
        self._check_open()
        info = self._peer(peer)
        body = pull_leases.parse_ticket(ticket)
        if body["sender"] != info.name:
            raise ValueError(f"the ticket is from {body['sender']!r}, not peer {info.name!r}")
        if self._leases.clock() >= body["deadline"]:
            raise LeaseExpired(f"lease {body['lease']} of peer {info.name!r} expired at {body['deadline']:.3f} "
                               f"(now {self._leases.clock():.3f}): nothing was read")
        src = blocks_of(body["blocks"], info.num_blocks, "ticket blocks", f"peer {info.name!r}")
        dst = blocks_of(dst_blocks, self._num_blocks, "dst_blocks", "this cache")
        if len(src) != len(dst):
            raise ValueError(f"the ticket holds {len(src)} blocks but dst_blocks has {len(dst)}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"dst_blocks lists a block twice: {dst}")
        held = next((b for b in dst if self._cache.ref_count(b) == 0), None)
        if held is not None:
            raise ValueError(f"destination block {held} is free (allocate the blocks to read into)")
        if not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        self._check_moves(info, info.pull_plans)
        return info, body, src, dst, bytes(notify)

    def pull(self, peer: str, ticket: bytes, dst_blocks: Any, notify: bytes = b"") -> pull_leases.PullHandle:
        """Read the blocks of the peer's export `ticket` into this cache's `dst_blocks` (the
        i-th into the i-th, each allocated here) with NIXL reads, split or gathered by head
        as `send` is; once the read is complete and the lease checked still open, the peer
        is told (it frees the blocks) and `notify`, if any, reaches its `notifications()`.
        Returns the handle to wait on. Checked before anything is read (`checked_pull`):
        UnknownPeer, a ticket of another sender, LeaseExpired for a deadline already past,
        the block lists as in `send`, a pair of ranks with nothing to move."""
        info, body, src, dst, notify = self.checked_pull(peer, ticket, dst_blocks, notify)
        local, remote = self._descriptors(info, info.pull_plans, dst, src)
        scratch = self._leases.take_scratch()  # before the read: with none free, nothing is posted
        try:
            request = self._post_read((local, remote), info.name, self._mem_type, info.mem_type)
        except BaseException:
            self._leases.give_scratch(scratch)
            raise
        word = (np.array([[self._leases.address() + 8 * scratch, 8, 0]], dtype=np.uint64),
                np.array([[int(info.info["leases"]) + 8 * body["slot"], 8, 0]], dtype=np.uint64))
        _log.debug("kv_pull_posted", name=self.name, peer=info.name, lease=body["lease"], blocks=len(src),
                   descriptors=len(local))
        return pull_leases.PullHandle(self, info.name, body, request, word, scratch, int(local[:, 1].sum()),
                                      len(local), notify)

    def _post_read(self, descs: tuple, peer: str, local_mem: str, remote_mem: str | None = None) -> Any:
        """One NIXL READ of `descs` (local, remote rows) from `peer`, posted; TransferError if refused."""
        self._check_open()
        local, remote = descs
        try:
            request = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, local_mem),
                                                  self._agent.get_xfer_descs(remote, remote_mem or local_mem), peer, b"")
        except Exception as err:
            raise TransferError(f"preparing a read from peer {peer!r} failed: {type(err).__name__}: {err}") from err
        self._requests[id(request)] = request
        try:
            state = self._agent.transfer(request)
        except Exception as err:
            self._release_request(request)
            raise TransferError(f"posting a read from peer {peer!r} failed: {type(err).__name__}: {err}") from err
        if state == "ERR":
            self._release_request(request)
            raise TransferError(f"posting a read from peer {peer!r} failed (NIXL state ERR)")
        return request

    def _pull_poll(self, request: Any, peer: str) -> str:
        try:
            return self._poll(request)
        except TransferError:
            raise
        except Exception as err:  # noqa: BLE001 - NIXL raises its own classes for a lost peer
            return f"{type(err).__name__}: {err}"

    def _notify_done(self, peer: str, lease_id: int, notify: bytes) -> None:
        try:
            self._agent.send_notif(peer, pull_leases.DONE_MAGIC + str(lease_id).encode())
            if notify:
                self._agent.send_notif(peer, notify)
        except Exception as err:  # noqa: BLE001 - the blocks are read; the lease will expire
            _log.warning("kv_pull_notify_failed", name=self.name, peer=peer, lease=lease_id,
                         error=f"{type(err).__name__}: {err}")

