"""Timing for the bench sections: the best of several wall-clock runs, and the timed loops
several sections share."""

from __future__ import annotations

import contextlib
import logging
import time

import structlog


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


@contextlib.contextmanager
def warnings_only():
    """structlog at warnings and up while measuring (a reference checkout logs info on
    stdout unless configured), the process's configuration put back after."""
    was_configured, saved = structlog.is_configured(), structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        if was_configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()
