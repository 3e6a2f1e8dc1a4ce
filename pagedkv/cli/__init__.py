"""pagedkv.cli: the `pagedkv` command line (`python -m pagedkv`, or the `pagedkv` script): plan, demo, quality.

Each subcommand lives in its own module with `register(subparsers)`, which adds its parser
and sets `func(args) -> int` (the exit status). Results go to stdout, pagedkv's events to
stderr (`--log-level`, default warning). A bad argument is one line on stderr and exit
status 2; a closed stdout (`pagedkv demo | head -1`) ends the command quietly; an output
that cannot be written (`> /dev/full`) is one line on stderr and exit status 1.

May import: every other part: `pagedkv.testing`, `pagedkv.events`, `pagedkv.sequences`, `pagedkv.tiers`, `pagedkv.groups`,
`pagedkv.cache`, `pagedkv.kv`, `pagedkv.interop`, `pagedkv.driver`, `pagedkv.backends`,
`pagedkv.codecs`, `pagedkv.core`, `pagedkv.errors`.
"""

from __future__ import annotations

import sys

import structlog

from ..core.log import LEVELS
from . import demo, plan, quality
from .args import USAGE_ERROR, Parser, UsageError, say_error
from .console import QuietClosedPipe, log_to_stderr


def build_parser() -> Parser:
    """The argument parser with every subcommand."""
    parser = Parser(prog="pagedkv", description="A paged KV cache for LLM engines.")
    parser.add_argument("--log-level", default="warning", choices=list(LEVELS),
                        help="lowest level of pagedkv events printed on stderr (default warning)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (plan, demo, quality):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; returns its exit
    status (2 for a bad argument, after one line on stderr). Unless the process configured
    structlog already, events go to stderr for the run and structlog is unconfigured after."""
    stdout = sys.stdout
    guard = QuietClosedPipe(stdout)
    sys.stdout = guard
    configured = False
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as stop:  # argparse: --help (0) or a usage error (2, already printed)
            return stop.code if isinstance(stop.code, int) else USAGE_ERROR
        configured = log_to_stderr(args.log_level)
        try:
            status = int(args.func(args) or 0)
        except UsageError as err:
            say_error(args.command, str(err))
            status = USAGE_ERROR
        guard.flush()
        if guard.failed is not None:
            say_error(args.command, f"cannot write the output: {guard.failed.strerror or guard.failed}")
            return 1
        return status
    finally:
        sys.stdout = stdout
        if configured:  # leave an embedding process as it was
            structlog.reset_defaults()
