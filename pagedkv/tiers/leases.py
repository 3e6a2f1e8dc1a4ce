"""Pull transfers: blocks a sender exports under a lease, read by the receiver when it is ready.

The sender's `KvTransfer.export(blocks, ttl)` takes a reference on each block and opens a
lease in its `LeaseTable`: a lease id (a nonzero u64) written into a slot of a small DRAM
table registered with NIXL, and a deadline (wall-clock seconds, `clock() + ttl`). The
returned ticket (bytes, handed over out of band) names the sender, the lease, its slot, the
blocks and the deadline. The receiver's `pull(peer, ticket, dst_blocks)` reads the blocks
with one NIXL READ, then reads the lease word with a second one: the word still holding
the lease id proves the sender had not released the blocks when the data read finished (a
sender clears the word before it frees the blocks). Then it notifies the sender, which frees
the blocks. A lease whose deadline passes is released by the sender (`expire_leases`, also
run by `notifications()`): the word is cleared, then the blocks are freed; a read that
finishes after that fails with `LeaseExpired` when it checks the word, and a pull started
after the deadline fails at once, reading nothing.

Deadlines are wall-clock (`time.time` unless a `clock` is given) because tickets cross
processes and machines; the word check, not the clocks, is what keeps a late read from
being taken for a good one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..core.validate import seconds
from .transfer_errors import LeaseExpired, TransferError, TransferTimeout

LEASE_SLOTS = 1024
"""How many leases one KvTransfer may hold open at once (and pulls it may have in flight)."""

TICKET_MAGIC = b"pagedkv-lease\x00"
"""The first bytes of every export ticket."""

DONE_MAGIC = b"pagedkv-lease-done\x00"
"""The notification a puller sends once its read is complete and checked (never delivered
to the sender's `notifications()`: the sender frees the lease's blocks on it)."""


@dataclass(frozen=True)
class Lease:
    """One open lease: its id, table slot, blocks (this cache's) and deadline."""

    lease_id: int
    slot: int
    blocks: tuple
    deadline: float


class LeaseTable:
    """The sender's open leases and the lease words (plus the puller's scratch words) as
    one uint64 array to register with NIXL: `words[:LEASE_SLOTS]` hold the lease ids,
    `words[LEASE_SLOTS:]` receive the words a pull reads back."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.words = np.zeros(2 * LEASE_SLOTS, dtype=np.uint64)
        self._free_slots = list(range(LEASE_SLOTS))[::-1]
        self._free_scratch = list(range(LEASE_SLOTS))[::-1]
        self._leases: dict[int, Lease] = {}
        self._next_id = int.from_bytes(os.urandom(6), "little") << 16 | 1  # never reused across restarts

    def address(self) -> int:
        """The host address of `words`."""
        return int(self.words.ctypes.data)

    def open(self, blocks: list[int], ttl: float) -> Lease:
        """A new lease on `blocks` expiring `ttl` seconds from now; TransferError when every slot is taken."""
        if not self._free_slots:
            raise TransferError(f"every one of the {LEASE_SLOTS} lease slots is taken (release or expire leases)")
        lease = Lease(self._next_id, self._free_slots.pop(), tuple(blocks), self.clock() + ttl)
        self._next_id += 1
        self.words[lease.slot] = lease.lease_id
        self._leases[lease.lease_id] = lease
        return lease

    def close(self, lease_id: int) -> Lease | None:
        """Forget a lease, its word cleared first; None when it is not open."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.words[lease.slot] = 0
            self._free_slots.append(lease.slot)
        return lease

    def expired(self) -> list[int]:
        """The ids of the open leases whose deadline has passed."""
        now = self.clock()
        return [i for i, lease in self._leases.items() if lease.deadline <= now]

    def open_ids(self) -> list[int]:
        """The ids of every open lease, oldest first."""
        return list(self._leases)

    def take_scratch(self) -> int:
        """A free scratch word index (into `words`) for one pull's lease check."""
        if not self._free_scratch:
            raise TransferError(f"{LEASE_SLOTS} pulls are already in flight")
        return LEASE_SLOTS + self._free_scratch.pop()

    def give_scratch(self, index: int) -> None:
        """Return a scratch word taken by `take_scratch`."""
        self.words[index] = 0
        self._free_scratch.append(index - LEASE_SLOTS)


def ticket(sender: str, lease: Lease) -> bytes:
    """The export ticket of `lease` (see the module docstring)."""
    body = {"sender": sender, "lease": lease.lease_id, "slot": lease.slot, "blocks": list(lease.blocks),
            "deadline": lease.deadline}
    return TICKET_MAGIC + json.dumps(body, sort_keys=True).encode()


def parse_ticket(blob: object) -> dict:
    """The fields of an export ticket; TypeError / ValueError naming what is wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"ticket must be bytes from KvTransfer.export(), got {type(blob).__name__}")
    blob = bytes(blob)
    if not blob.startswith(TICKET_MAGIC):
        raise ValueError(f"ticket is not a KvTransfer export ticket (starts {blob[:24]!r})")
    try:
        body = json.loads(blob[len(TICKET_MAGIC):])
        fields = {"sender": str, "lease": int, "slot": int, "blocks": list, "deadline": (int, float)}
        if not isinstance(body, dict) or any(not isinstance(body.get(k), t) for k, t in fields.items()):
            raise ValueError(f"it lacks one of {', '.join(fields)}")
        if not 0 <= body["slot"] < LEASE_SLOTS or not 0 < body["lease"] < 2**64:
            raise ValueError(f"slot {body['slot']} or lease {body['lease']} out of range")
    except ValueError as err:
        raise ValueError(f"ticket is broken: {err}") from None
    return body


class PullHandle:
    """One `pull` in flight: the data read, then the lease word read, then the sender told.
    `done()` polls (LeaseExpired when the word no longer holds the lease: the destination
    blocks hold undefined bytes; TransferError for a failed read), `wait(timeout)` blocks."""

    def __init__(self, owner: Any, peer: str, body: dict, request: Any, word_descs: tuple, scratch: int,
                 nbytes: int, descriptors: int, notify: bytes):
        self._owner, self._request, self._word_descs, self._scratch = owner, request, word_descs, scratch
        self._body, self._notify = body, notify
        self.peer = peer
        """The sender the blocks are read from."""
        self.blocks = len(body["blocks"])
        """How many blocks this pull reads."""
        self.nbytes = nbytes
        """How many bytes the data read moves (every layer, both sides)."""
        self.descriptors = descriptors
        """How many NIXL descriptors the data read has."""
        self._phase = "data"
        self._error: TransferError | None = None

    def done(self) -> bool:
        """True once the read is complete, checked and the sender notified."""
        while self._phase in ("data", "word") and self._error is None:
            state = self._owner._pull_poll(self._request, self.peer)
            if state == "PROC":
                return False
            self._owner._release_request(self._request)
            self._request = None
            if state != "DONE":
                self._fail(TransferError(f"pull of {self.blocks} blocks from peer {self.peer!r} failed: {state}"))
            elif self._phase == "data":
                self._phase = "word"
                try:
                    self._request = self._owner._post_read(self._word_descs, self.peer, "DRAM")
                except TransferError as err:
                    self._fail(err)
            else:
                self._check_word()
        if self._error is not None:
            raise self._error
        return True

    def _check_word(self) -> None:
        word = int(self._owner._leases.words[self._scratch])
        self._owner._leases.give_scratch(self._scratch)
        self._scratch = None
        if word != self._body["lease"]:
            self._error = LeaseExpired(
                f"lease {self._body['lease']} of peer {self.peer!r} was released before the read of "
                f"{self.blocks} blocks finished (deadline {self._body['deadline']:.3f}): the destination "
                f"blocks hold undefined bytes")
            return
        self._owner._notify_done(self.peer, self._body["lease"], self._notify)
        self._phase = "done"

    def _fail(self, error: TransferError) -> None:
        if self._scratch is not None:
            self._owner._leases.give_scratch(self._scratch)
            self._scratch = None
        self._error = error

    def wait(self, timeout: float | None = None) -> None:
        """Block until `done()`; TransferTimeout after `timeout` seconds (still in flight).
        ValueError for a timeout that is not a finite number >= 0 or None."""
        timeout = seconds(timeout, "timeout", allow_none=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-5
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferTimeout(f"pull of {self.blocks} blocks from peer {self.peer!r} not complete "
                                      f"after {timeout} s (still in flight; wait again or close)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
