"""One thread at a time: the cheap check that turns concurrent entry into an error.

A `PrefixCache` and the `SequenceTable`s built on it share one `ThreadGuard`; every public
method enters it with a non-blocking acquire, so a second thread entering while the first
is inside raises `ConcurrentUseError` before anything changes, instead of corrupting the
tree. The same thread may re-enter (a table calling its prefix cache, an event consumer
calling back), and `depth` says how deep it is.
"""

from __future__ import annotations

import threading

from .errors import KvCacheError


class ConcurrentUseError(KvCacheError):
    """A thread entered a PrefixCache or SequenceTable while another thread was inside it;
    nothing was changed by the refused call."""


class ThreadGuard:
    """A re-entrant owner check: `enter()` succeeds for the thread inside (or when nobody
    is) and raises ConcurrentUseError otherwise; every `enter()` is paired with `exit()`."""

    __slots__ = ("lock", "depth", "owner")

    def __init__(self, owner: str):
        self.lock = threading.RLock()
        self.depth = 0
        self.owner = owner

    def enter(self) -> None:
        """Claim the guard for this thread, or raise ConcurrentUseError naming the owner."""
        if not self.lock.acquire(False):
            raise self.busy()
        self.depth += 1

    def exit(self) -> None:
        """Undo one `enter()`."""
        self.depth -= 1
        self.lock.release()

    def busy(self) -> ConcurrentUseError:
        """The error for a refused entry."""
        return ConcurrentUseError(
            f"{self.owner} is in use by another thread: use it (and its PrefixCache and "
            "SequenceTables) from one thread at a time, or serialise the calls with a lock"
        )
