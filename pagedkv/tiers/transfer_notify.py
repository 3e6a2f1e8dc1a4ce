"""The notifications of `KvTransfer`: `notifications` (messages that arrived, a puller's
lease completions handled, grants checked, expired leases released), `wait_notifications`
and `poll_notifications`, the polling both it and `HybridKvTransfer` wait with.
"""

from __future__ import annotations

import time
from typing import Callable

from ..core.log import get_logger
from ..core.validate import seconds
from . import leases as pull_leases
from .transfer_errors import TransferTimeout
from .transfer_grants import GrantViolation

_log = get_logger("transfer")


def poll_notifications(fetch: Callable[[], list], timeout: object, what: str) -> list:
    """`fetch()` polled (backing off from 10 us to 1 ms) until it returns a non-empty list;
    TransferTimeout "`what` arrived within `timeout` s" past `timeout` seconds (a finite
    number >= 0: ValueError for NaN, an infinity or a bool)."""
    timeout = seconds(timeout, "timeout")
    deadline, pause = time.monotonic() + timeout, 1e-5
    while True:
        got = fetch()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{what} arrived within {timeout} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)



class Notifications:
    """Mixed into `KvTransfer` (it sets `name`, `_agent`, `_inbox`, `_require_grants`, and
    defines `_check_open`; `_granted` comes from `GrantMode`, `_lease_done` and
    `expire_leases` from `PullMode`)."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Every (peer name, message) that arrived since the last call, oldest first per peer.
        A puller's completion of a lease is handled here (the lease's blocks are freed, no
        message is returned), and expired leases are released (`expire_leases`)."""
        self._check_open()
        violations = []
        for peer, messages in self._agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            for message in map(bytes, messages):
                if message.startswith(pull_leases.DONE_MAGIC):
                    self._lease_done(peer, message[len(pull_leases.DONE_MAGIC):])
                    continue
                user, why = self._granted(peer, message, self._require_grants)
                if why is None:
                    self._inbox.append((peer, user))
                else:
                    violations.append(why)
                    _log.warning("kv_transfer_grant_violation", name=self.name, peer=peer, why=why)
        self.expire_leases()
        if violations:
            raise GrantViolation("; ".join(violations) + " (the other notifications stay queued)")
        out, self._inbox = self._inbox, []
        return out

    def wait_notifications(self, timeout: float) -> list[tuple[str, bytes]]:
        """`notifications()` once at least one has arrived; TransferTimeout naming the
        timeout when none arrives within `timeout` seconds (a finite number >= 0: ValueError
        for NaN or an infinity)."""
        return poll_notifications(self.notifications, timeout, f"{self.name!r}: no notification")
