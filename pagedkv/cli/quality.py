"""`pagedkv quality`: the bits and accuracy table of every storage format (pagedkv.quality)."""

from __future__ import annotations

import argparse
import sys

from ..kv.quality import (CHUNK_ELEMENTS, describe, format_row, format_tier_table, quality_rows,
                          table_head, tier_table)
from .args import UsageError, int_in, non_negative_int, positive_int
from .console import Progress

MAX_TOKENS = 10_000_000
"""--tokens may be at most this. The work streams over the tokens in chunks of
`pagedkv.kv.quality.CHUNK_ELEMENTS` values (`chunk_tokens(heads, head_dim)` tokens), so
memory is bounded by the chunk whatever the token count; time grows with the tokens (each
format's pass regenerates the chunks), so the bound only stops a typo from running for days."""


def run(args: argparse.Namespace) -> int:
    """Print the quality table for the sizes in `args`, with a progress line on stderr when
    it is a terminal or `--progress` is given; UsageError for a head_dim the grouped formats
    cannot store or a token's rows larger than a chunk."""
    if args.head_dim % 16:
        raise UsageError(f"--head-dim {args.head_dim} is not a multiple of 16 (the grouped formats need it)")
    row = args.heads * args.head_dim
    if row > CHUNK_ELEMENTS:
        raise UsageError(f"--heads {args.heads} x --head-dim {args.head_dim} is {row:,} values a token, over the "
                         f"{CHUNK_ELEMENTS:,} of one chunk of work")
    progress = None
    if args.progress or sys.stderr.isatty():
        progress = Progress(sys.stderr, in_place=sys.stderr.isatty(), command="quality")
    print(describe(args.tokens, args.heads, args.head_dim, args.seed))
    sys.stdout.flush()
    if args.tier:
        table = tier_table(args.tokens, args.heads, args.head_dim, args.seed, progress=progress)
        if progress is not None:
            progress.clear()
        print("the error a tier format adds: device values through HostTier(format=tier) and back, against the "
              "device values (ratio: device bytes / tier bytes)")
        print(format_tier_table(table))
        return 0
    for line in table_head():
        print(line)
    sys.stdout.flush()
    for result in quality_rows(args.tokens, args.heads, args.head_dim, args.seed, progress=progress):
        if progress is not None:
            progress.clear()
        print(format_row(result))  # each format as soon as it is measured
        sys.stdout.flush()
    return 0


def register(subparsers) -> None:
    """Add the `quality` subcommand."""
    parser = subparsers.add_parser("quality", help="bits per element and accuracy of every format",
                                   description="Bits per element and accuracy of every storage format on seeded "
                                               "synthetic KV shaped like a real model's.")
    parser.add_argument("--tokens", type=int_in(2, MAX_TOKENS, " (attention over one token has nothing to compare)"),
                        default=512, help=f"tokens of synthetic KV, from 2 to {MAX_TOKENS:,} (default 512); "
                                          "streamed in chunks, memory does not grow with it")
    parser.add_argument("--heads", type=positive_int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="head size, a multiple of 16 (default 128)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument("--tier", action="store_true",
                        help="the error each tier pairing adds (bf16 and fp8 devices, every smaller tier format)")
    parser.add_argument("--progress", action="store_true",
                        help="a progress line per chunk on stderr even when it is not a terminal (on a terminal "
                             "it is always shown, in place)")
    parser.set_defaults(func=run)
