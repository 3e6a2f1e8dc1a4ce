"""Sliding-window arithmetic: which blocks of a sequence intersect its last `window` tokens."""

from __future__ import annotations


def first_live_block(num_tokens: int, window: int, block_size: int) -> int:
    """Index of the oldest block that intersects the last `window` tokens of a sequence of
    `num_tokens`: every block before it lies wholly before position `num_tokens - window`."""
    return max(0, num_tokens - window) // block_size


def max_live_blocks(window: int, block_size: int) -> int:
    """The most blocks a sliding group holds for one sequence, whatever its length:
    `ceil(window / block_size) + 1`."""
    return -(-window // block_size) + 1


def window_blocks_for_match(p: int, window: int, block_size: int) -> range:
    """Block indices a sliding group needs to resume a sequence at position `p` (a multiple
    of `block_size`): those covering `[p - window, p)`."""
    return range(max(0, p - window) // block_size, p // block_size)
