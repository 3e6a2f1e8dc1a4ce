"""Bench section `quality`: bits per element and accuracy of every format (`pagedkv quality`'s table).

Accuracy, not speed: each format against BF16 on the same seeded synthetic KV, so the
rows compare side by side in one run. `--quick` uses 128 tokens instead of 512.
"""

from __future__ import annotations

import argparse

from pagedkv.kv.quality import describe, format_table, quality_table


def run(args: argparse.Namespace) -> None:
    """Print the quality table (512 tokens x 8 heads x 128, seed 0; 128 tokens with --quick)."""
    tokens = 128 if getattr(args, "quick", False) else 512
    print(describe(tokens, 8, 128, 0))
    print(format_table(quality_table(tokens, 8, 128, 0)))
