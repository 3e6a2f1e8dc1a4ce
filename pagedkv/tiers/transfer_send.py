"""The send path of `KvTransfer`: `checked_send` (every check of a send, nothing sent),
`send` (one NIXL WRITE request), the descriptors of a peer's plans (shared with the pull
path), the check that a plan moves anything, and `TransferHandle` (one send in flight) with
the request polling and release it calls.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..core.log import get_logger
from ..core.validate import seconds
from . import head_plan
from .pull_mode import blocks_of as _blocks
from .transfer_errors import TransferError, TransferTimeout
from .transfer_grants import notify_prefix, parse_ticket
from .transfer_peers import _Peer

_log = get_logger("transfer")


class TransferHandle:
    """One `send` in flight. `wait(timeout)` blocks until its bytes are written at the peer;
    `done()` polls. Once complete (or failed) the NIXL request is released."""

    def __init__(self, owner: "KvTransfer", request: Any, peer: str, blocks: int, nbytes: int, descriptors: int):
        self._owner = owner
        self._request = request
        self.peer = peer
        """The peer the blocks go to."""
        self.blocks = blocks
        """How many blocks this transfer writes."""
        self.nbytes = nbytes
        """How many bytes this transfer writes (every layer, both sides)."""
        self.descriptors = descriptors
        """How many NIXL descriptors the request has: one per pool per run of consecutive pairs."""
        self._state = "PROC"
        self._reason = "NIXL state ERR"

    def done(self) -> bool:
        """True once every byte is written at the peer; TransferError if the transfer failed."""
        if self._state == "PROC":
            try:
                self._state = self._owner._poll(self._request)
            except TransferError:
                raise
            except Exception as err:  # noqa: BLE001 - NIXL raises its own classes for a lost peer
                self._state, self._reason = "ERR", f"{type(err).__name__}: {err}"
            if self._state != "PROC":
                self._finish()
        if self._state == "ERR":
            raise TransferError(
                f"transfer of {self.blocks} blocks ({self.nbytes} bytes) to peer {self.peer!r} failed: {self._reason}"
            )
        return self._state == "DONE"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer is complete. TransferTimeout, naming the peer, the
        blocks and the timeout, when it is not complete after `timeout` seconds (None waits
        for ever); the transfer stays in flight and `wait` may be called again. TransferError
        if it failed."""
        timeout = seconds(timeout, "timeout", allow_none=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-5
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferTimeout(
                    f"transfer of {self.blocks} blocks ({self.nbytes} bytes) to peer {self.peer!r} "
                    f"not complete after {timeout} s (still in flight; wait again or close)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _finish(self) -> None:
        self._owner._release_request(self._request)
        self._request = None



class SendMode:
    """Mixed into `KvTransfer` (it sets `name`, `_agent`, `_cache`, `_num_blocks`,
    `_mem_type`, `_device_id`, `_layout`, `_state`, `_requests`, and defines `_check_open`;
    `_peer` comes from `PeerConnections`)."""

    def checked_send(self, peer: str, src_blocks: Any, dst_blocks: Any, notify: bytes = b"",
                     grant: bytes | None = None) -> tuple:
        """(peer, src, dst, notify as sent) of a `send` after every one of its checks, nothing
        sent: for a caller that must refuse a send of several agents before any of them posts."""
        self._check_open()
        info = self._peer(peer)
        src = _blocks(src_blocks, self._num_blocks, "src_blocks", "this cache")
        dst = _blocks(dst_blocks, info.num_blocks, "dst_blocks", f"peer {info.name!r}")
        if len(src) != len(dst):
            raise ValueError(f"src_blocks has {len(src)} blocks but dst_blocks has {len(dst)}")
        if not src:
            raise ValueError("src_blocks is empty: nothing to send")
        if len(set(dst)) != len(dst):
            seen: set[int] = set()
            repeated = next(b for b in dst if b in seen or seen.add(b))  # type: ignore[func-returns-value]
            raise ValueError(f"destination block {repeated} appears twice in dst_blocks")
        free = next((b for b in src if self._cache.ref_count(b) == 0), None)
        if free is not None:
            raise ValueError(f"source block {free} is free (send only blocks the cache holds)")
        if not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        if grant is not None:
            body = parse_ticket(grant)
            if body["receiver"] != info.name or body["peer"] != self.name:
                raise ValueError(f"the grant is {body['receiver']!r}'s for {body['peer']!r}, not peer "
                                 f"{info.name!r}'s for {self.name!r}")
            allowed = set(body["blocks"])
            outside = next((b for b in dst if b not in allowed), None)
            if outside is not None:
                raise ValueError(f"destination block {outside} is not in peer {info.name!r}'s grant "
                                 f"{body['grant']} (blocks {body['blocks'][:8]}{'...' if len(allowed) > 8 else ''})")
            notify = notify_prefix(body["grant"]) + bytes(notify)
        elif info.info.get("grants") is True:
            raise ValueError(f"peer {info.name!r} requires a grant for every send: pass grant=<its grant ticket>")
        self._check_moves(info, info.send_plans)
        return info, src, dst, notify

    def send(self, peer: str, src_blocks: Any, dst_blocks: Any, notify: bytes = b"", grant: bytes | None = None) -> TransferHandle:
        """Write every layer's K and V of `src_blocks` (this cache's, each allocated) into
        the peer's `dst_blocks` (the i-th into the i-th), in one NIXL request whose
        descriptor list has one entry per layer, side and run of consecutive pairs; `notify`
        reaches the peer's `notifications()` once the bytes have landed. Returns the handle
        to wait on. Checked before anything is sent: UnknownPeer, a block out of range on
        either side (IndexError naming it and the side's size), a free source block, lists of
        different or zero length, a repeated destination (ValueError naming it), a notify
        that is not bytes. Work the caller enqueued on the source blocks must be complete.

        `grant` is the receiver's ticket (`grant`) for these destination blocks: refused,
        before anything is sent, when it is another receiver's or for another sender, or when
        a destination block is not in it (ValueError naming the block); its id travels with
        the notification, which the receiver checks. A receiver made with require_grants=True
        (its metadata says so) refuses a send without one here."""
        info, src, dst, notify = self.checked_send(peer, src_blocks, dst_blocks, notify, grant)
        local, remote = self._descriptors(info, info.send_plans, src, dst)
        nixl_local = self._agent.get_xfer_descs(local, self._mem_type)
        nixl_remote = self._agent.get_xfer_descs(remote, info.mem_type)
        try:
            request = self._agent.initialize_xfer("WRITE", nixl_local, nixl_remote, info.name, bytes(notify))
        except Exception as err:
            raise TransferError(f"preparing {len(src)} blocks for peer {info.name!r} failed: {type(err).__name__}: {err}") from err
        self._requests[id(request)] = request
        try:
            state = self._agent.transfer(request)
        except Exception as err:
            self._release_request(request)
            raise TransferError(f"posting {len(src)} blocks to peer {info.name!r} failed: {type(err).__name__}: {err}") from err
        handle = TransferHandle(self, request, info.name, len(src), int(local[:, 1].sum()), len(local))
        if state == "ERR":
            self._release_request(request)
            raise TransferError(f"posting {len(src)} blocks to peer {info.name!r} failed (NIXL state ERR)")
        if state == "DONE":
            handle._state = "DONE"
            handle._finish()
        _log.debug("kv_transfer_sent", name=self.name, peer=info.name, blocks=len(src),
                   descriptors=len(local), bytes=handle.nbytes, state=state)
        return handle

    def _descriptors(self, peer: _Peer, plans: tuple, local_blocks: list[int],
                     remote_blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) Nx3 uint64 arrays of (address, bytes, device): per pool pair and
        block pair, the byte runs of the heads both sides hold (`head_plan`), consecutive
        whole blocks merged. ValueError when nothing moves (`_check_moves`)."""
        if plans is peer.send_plans:
            src_rows, dst_rows = head_plan.descriptors(list(plans), local_blocks, remote_blocks)
            local_rows, remote_rows = src_rows, dst_rows
        else:
            src_rows, dst_rows = head_plan.descriptors(list(plans), remote_blocks, local_blocks)
            local_rows, remote_rows = dst_rows, src_rows
        if local_rows.shape[0] == 0:
            self._check_moves(peer, plans)
        local = np.empty((local_rows.shape[0], 3), dtype=np.uint64)
        remote = np.empty_like(local)
        local[:, :2], remote[:, :2] = local_rows, remote_rows
        local[:, 2], remote[:, 2] = self._device_id, peer.device_id
        return local, remote

    def _check_moves(self, peer: _Peer, plans: tuple) -> None:
        """ValueError when `plans` (a peer's send or pull plans) move nothing: the two
        caches share no head (naming both ranks' layer 0 head ranges), or, for a state group,
        this pair of ranks is not the one whose replicated slots move (naming the rank that
        sends them)."""
        if any(plan[4].shape[0] for plan in plans):
            return
        sending = plans is peer.send_plans
        mine, theirs = (self._layout["tp_rank"], self._layout["tp_size"]), (peer.tp_rank, peer.tp_size)
        if self._state:
            to, frm = (theirs, mine) if sending else (mine, theirs)
            raise ValueError(
                f"state slots are replicated across TP ranks and TP rank {to[0]} of {to[1]} takes them from TP rank "
                f"{head_plan.replica_sender(to[0], frm[1], to[1])} of {frm[1]}, not rank {frm[0]} "
                f"({'this cache' if sending else f'peer {peer.name!r}'}): nothing to move")
        here, there = self._layout["layers"][0], peer.info["layout"]["layers"][0]
        raise ValueError(
            f"peer {peer.name!r} (TP rank {peer.tp_rank} of {peer.tp_size}, layer 0 heads "
            f"[{there['head_start']}, {there['head_start'] + there['num_kv_heads']})) shares no head with this "
            f"cache (TP rank {mine[0]} of {mine[1]}, layer 0 heads "
            f"[{here['head_start']}, {here['head_start'] + here['num_kv_heads']})): nothing to move"
        )

    def _poll(self, request: Any) -> str:
        self._check_open()
        return self._agent.check_xfer_state(request)

    def _release_request(self, request: Any) -> None:
        if self._requests.pop(id(request), None) is None:
            return
        try:
            self._agent.release_xfer_handle(request)
        except Exception as err:  # noqa: BLE001 - a release that fails must not hide the result
            _log.warning("kv_transfer_release_failed", name=self.name, error=f"{type(err).__name__}: {err}")
