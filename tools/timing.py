"""Timing for the bench sections: the best of several wall-clock runs."""

from __future__ import annotations

import time


def best_of(fn, repeats: int) -> float:
    """Best wall time of `repeats` calls of `fn` (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
