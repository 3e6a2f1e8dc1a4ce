"""`pagedkv quality`: the bits and accuracy table of every storage format (pagedkv.quality)."""

from __future__ import annotations

import argparse
import sys

from ..kv.quality import describe, format_row, format_tier_table, quality_rows, table_head, tier_table
from .args import UsageError, int_in, non_negative_int, positive_int

MAX_ELEMENTS = 1 << 22
"""tokens x heads x head_dim may be at most this (8x the default): the table keeps every
format's decoded copy in memory (about 110 bytes per element; 100,000 tokens of the default
shape took 11 GB and 750 s)."""


def run(args: argparse.Namespace) -> int:
    """Print the quality table for the sizes in `args`; UsageError for a head_dim the grouped
    formats cannot store."""
    if args.head_dim % 16:
        raise UsageError(f"--head-dim {args.head_dim} is not a multiple of 16 (the grouped formats need it)")
    elements = args.tokens * args.heads * args.head_dim
    if elements > MAX_ELEMENTS:
        raise UsageError(f"--tokens {args.tokens} x --heads {args.heads} x --head-dim {args.head_dim} is "
                         f"{elements:,} values, over the bound of {MAX_ELEMENTS:,} (every format's copy is kept "
                         "in memory); use fewer tokens")
    print(describe(args.tokens, args.heads, args.head_dim, args.seed))
    if args.tier:
        print("the error a tier format adds: device values through HostTier(format=tier) and back, against the "
              "device values (ratio: device bytes / tier bytes)")
        print(format_tier_table(tier_table(args.tokens, args.heads, args.head_dim, args.seed)))
        return 0
    for line in table_head():
        print(line)
    for row in quality_rows(args.tokens, args.heads, args.head_dim, args.seed):
        print(format_row(row))  # each format as soon as it is measured
        sys.stdout.flush()
    return 0


def register(subparsers) -> None:
    """Add the `quality` subcommand."""
    parser = subparsers.add_parser("quality", help="bits per element and accuracy of every format",
                                   description="Bits per element and accuracy of every storage format on seeded "
                                               "synthetic KV shaped like a real model's.")
    parser.add_argument("--tokens", type=int_in(2, MAX_ELEMENTS, " (attention over one token has nothing to compare)"),
                        default=512, help="tokens of synthetic KV, at least 2 (default 512)")
    parser.add_argument("--heads", type=positive_int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="head size, a multiple of 16 (default 128)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument("--tier", action="store_true",
                        help="the error each tier pairing adds (bf16 and fp8 devices, every smaller tier format)")
    parser.set_defaults(func=run)
