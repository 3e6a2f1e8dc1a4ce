"""Timing for the bench sections: the best of several wall-clock runs, and the timed loops
several sections share."""

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


def alloc_free_pairs(owner, pairs: int):
    """A function running `pairs` single-block allocate+free pairs on `owner`'s
    `alloc_block` / `free_block` (bound once, as engine code would)."""

    def run() -> None:
        alloc, free = owner.alloc_block, owner.free_block
        for _ in range(pairs):
            free(alloc())

    return run
