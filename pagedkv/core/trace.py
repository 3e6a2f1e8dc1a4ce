"""Per-block reference-count history, kept only while METRALE_KV_TRACE is on."""

from __future__ import annotations

import collections
import os
import sys
from typing import NamedTuple

HISTORY_PER_BLOCK = 16
"""How many events each block keeps; older ones are dropped."""

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class TraceEvent(NamedTuple):
    """One refcount event: the operation, the count after it, and the caller's file:line."""

    op: str
    count: int
    where: str

    def __str__(self) -> str:
        return f"{self.op}->{self.count}@{self.where}"


def _caller() -> str:
    """file:line of the nearest frame outside the pagedkv package (the engine's call site)."""
    frame = sys._getframe(2)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class BlockTracer:
    """A bounded history of refcount events per block."""

    def __init__(self, history: int = HISTORY_PER_BLOCK):
        self._history = history
        self._events: dict[int, collections.deque] = {}

    def record(self, block: int, op: str, count: int) -> None:
        """Append `op` with the count after it and the caller's location to `block`'s history."""
        events = self._events.get(block)
        if events is None:
            events = self._events[block] = collections.deque(maxlen=self._history)
        events.append(TraceEvent(op, count, _caller()))

    def history(self, block: int) -> list[TraceEvent]:
        """The events kept for `block`, oldest first."""
        return list(self._events.get(block, ()))

    def clear(self) -> None:
        """Forget every history."""
        self._events.clear()
