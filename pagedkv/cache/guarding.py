"""What a cache and a hybrid cache's state group share about being shared: the prefix
cache's thread guard lent to their mutating calls, and the holders (an open KvTransfer)
that must let go before a release."""

from __future__ import annotations

from ..core.guard import ThreadGuard, guarded_call


class GuardedCalls:
    """Mixin: `_take_guard` installs guarded versions (instance attributes) of the calls that
    change the object, `_drop_guard` puts the plain ones back. `_GUARD_BOUND` names the
    allocator's bound methods the object exposes (re-bound from `self._allocator`),
    `_GUARD_METHODS` the class's own methods."""

    _GUARD_BOUND: tuple = ()
    _GUARD_METHODS: tuple = ()
    _guard: ThreadGuard | None = None

    def _take_guard(self, guard: ThreadGuard, pending, deliver) -> None:
        """Every mutating call enters `guard` (ConcurrentUseError from a second thread while
        another is inside, nothing changed); `deliver()` runs after an outermost call that
        left events in `pending`."""
        self._guard = guard
        for name in self._GUARD_BOUND:
            setattr(self, name, guarded_call(guard, getattr(self._allocator, name), pending, deliver))
        for name in self._GUARD_METHODS:
            setattr(self, name, guarded_call(guard, getattr(type(self), name).__get__(self), pending, deliver))

    def _drop_guard(self) -> None:
        """Back to the unguarded calls (a no-op without a guard)."""
        if self._guard is None:
            return
        self._guard = None
        for name in self._GUARD_BOUND:
            setattr(self, name, getattr(self._allocator, name))
        for name in self._GUARD_METHODS:
            self.__dict__.pop(name, None)


class PoolHolders:
    """Mixin over a `_holders` dict (id(holder) -> label) the subclass makes: what uses the
    pools and must `let_go` before they are released."""

    _holders: dict

    def hold(self, holder: object, label: str) -> None:
        """Record `holder` (named `label`) as using the pools: a release is refused until
        `let_go(holder)`."""
        self._holders[id(holder)] = label

    def let_go(self, holder: object) -> None:
        """Undo `hold` (a no-op for a holder not recorded)."""
        self._holders.pop(id(holder), None)

    def holders(self) -> list[str]:
        """The labels of the holders recorded by `hold` (what must close before a release)."""
        return list(self._holders.values())
