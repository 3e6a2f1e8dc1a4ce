"""One thread at a time: the cheap check that turns concurrent entry into an error.

A `PrefixCache` and the `SequenceTable`s built on it share one `ThreadGuard`; every public
method enters it with a non-blocking acquire, so a second thread entering while the first
is inside raises `ConcurrentUseError` before anything changes, instead of corrupting the
tree. The same thread may re-enter (a table calling its prefix cache, an event consumer
calling back), and `depth` says how deep it is.
"""

from __future__ import annotations

import functools
import threading

from ..errors import KvCacheError


class ConcurrentUseError(KvCacheError):
    """A thread entered a PrefixCache or SequenceTable while another thread was inside it;
    nothing was changed by the refused call."""


class ThreadGuard:
    """A re-entrant owner check: `enter()` succeeds for the thread inside (or when nobody
    is) and raises ConcurrentUseError otherwise; every `enter()` is paired with `exit()`.

    The claim is one atomic `list.pop()` of `token` (a list holding one item while the
    guard is free), cheaper than a lock; `owner` is the thread inside and `depth` how deep."""

    __slots__ = ("token", "owner", "depth", "name", "lent")

    def __init__(self, name: str):
        self.token = [True]
        self.owner: int | None = None
        self.depth = 0
        self.name = name
        self.lent = False  # True while the outermost entry is a guarded cache call (`guarded_call`)

    def enter(self) -> None:
        """Claim the guard for this thread, or raise ConcurrentUseError naming the owner."""
        token = self.token
        if token:  # looks free: claim it (another thread may still win the pop)
            try:
                token.pop()
            except IndexError:
                pass
            else:
                self.owner = threading.get_ident()
                self.depth += 1
                return
        if self.owner != threading.get_ident():  # only the thread inside ever sets its own id here
            raise self.busy()
        self.depth += 1

    def exit(self) -> None:
        """Undo one `enter()`."""
        self.depth -= 1
        if not self.depth:
            self.owner = None
            self.token.append(True)

    def inside(self) -> bool:
        """True while some thread is inside."""
        return not self.token

    def only_lent(self) -> bool:
        """True while the only entry is one `guarded_call` (a PagedKvCache method called from
        outside its prefix cache and tables): events may be delivered from within it, as
        nothing further out will deliver them."""
        return self.lent and self.depth == 1

    def busy(self) -> ConcurrentUseError:
        """The error for a refused entry."""
        return ConcurrentUseError(
            f"{self.name} is in use by another thread: use it (and its PrefixCache and "
            "SequenceTables) from one thread at a time, or serialise the calls with a lock"
        )


def guarded(method):
    """Decorate a method of an object holding a `ThreadGuard` as `_guard`: the method runs
    with the guard entered (ConcurrentUseError, nothing changed, when another thread is
    inside), then `self._deliver()` runs outside it (events the call queued)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        guard = self._guard
        guard.enter()
        try:
            result = method(self, *args, **kwargs)
        finally:
            guard.exit()
        self._deliver()
        return result

    return run


def guarded_call(guard: ThreadGuard, fn, pending=None, deliver=None):
    """`fn` wrapped to run with `guard` entered: ConcurrentUseError, nothing changed, when
    another thread is inside; the thread inside re-enters. When `pending` (a queue of
    events) is not empty once the outermost entry has exited, `deliver()` runs. The claim
    is inline (one `list.pop()`), as `SequenceTable.append` takes it: a wrapped allocator
    call costs a second Python frame."""
    token = guard.token
    get_ident = threading.get_ident

    def call(*args, **kwargs):
        try:
            token.pop()
        except IndexError:
            if guard.owner != get_ident():  # only the thread inside ever sets its own id here
                raise guard.busy() from None
            guard.depth += 1  # this thread re-entering
            try:
                return fn(*args, **kwargs)
            finally:
                guard.depth -= 1
        guard.owner = get_ident()  # a full claim: the call may come back in (an eviction)
        guard.depth = 1
        guard.lent = True
        try:
            result = fn(*args, **kwargs)
        finally:
            guard.lent = False
            guard.depth = 0
            guard.owner = None
            token.append(True)
        if pending:
            deliver()
        return result

    call.__wrapped__ = fn
    call.__doc__ = getattr(fn, "__doc__", None)
    return call
