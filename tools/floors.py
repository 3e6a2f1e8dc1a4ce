"""Floors of tools/bench.py: a measured figure against the bound it must meet.

A section calls `floor(label, value, minimum)` (value must be at least minimum: a speedup)
or `ceiling(label, value, maximum)` (at most maximum: a slowdown ratio); each prints one
line ending `ok` or `MISSED` and returns whether the bound held. `missed()` lists the
labels missed since the last `reset()`; `tools/bench.py --strict` exits 1 when it is not
empty.
"""

from __future__ import annotations

_missed: list[str] = []


def _check(label: str, value: float, bound: float, holds: bool, relation: str) -> bool:
    if not holds:
        _missed.append(label)
    kind = "floor" if relation == ">=" else "ceiling"
    print(f"  {kind:<7} {label}: {value:.2f}x, needs {relation} {bound:g}x  {'ok' if holds else 'MISSED'}")
    return holds


def floor(label: str, value: float, minimum: float) -> bool:
    """Record and print whether `value` (a ratio, higher is better) is at least `minimum`."""
    return _check(label, value, minimum, value >= minimum, ">=")


def ceiling(label: str, value: float, maximum: float) -> bool:
    """Record and print whether `value` (a ratio, lower is better) is at most `maximum`."""
    return _check(label, value, maximum, value <= maximum, "<=")


def missed() -> list[str]:
    """Labels of the bounds missed since the last reset, in the order they were checked."""
    return list(_missed)


def reset() -> None:
    """Forget every missed bound (tools/bench.py calls it before running its sections)."""
    _missed.clear()
