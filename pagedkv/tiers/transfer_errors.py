"""The errors of KV transfers (`KvTransfer`, its peers, pull leases): every one a `PagedKvError`."""

from __future__ import annotations

from ..errors import PagedKvError


class NixlUnavailable(PagedKvError, ImportError):
    """NIXL's Python API cannot be imported; the message says how to install it."""


class TransferError(PagedKvError, RuntimeError):
    """A KV transfer was refused or failed; the message names the peer and what went wrong."""


class LayoutMismatch(TransferError, ValueError):
    """A peer's cache layout differs from this one; the message lists every difference."""


class UnknownPeer(TransferError, LookupError):
    """A peer name that `connect` never returned (or one already disconnected)."""


class TransferTimeout(TransferError, TimeoutError):
    """A wait ran past its timeout; the transfer (if any) is still in flight and may be waited on again."""


class LeaseExpired(TransferError):
    """A pull's lease had expired (or was released) before the read finished: the sender may
    have reused the blocks, so the destination blocks hold undefined bytes."""


class PeerRefused(TransferError, PermissionError):
    """`connect` refused a peer that the allow-list does not name or whose metadata lacks the
    shared token's tag; nothing was loaded."""

