"""The `pagedkv` command line (`python -m pagedkv`): plan, demo and the tools of later modules.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func(args) -> int` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import structlog

SUBCOMMAND_MODULES = (
    "pagedkv.plan",
    "pagedkv.demo",
    "pagedkv.quality",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand present in this installation."""
    parser = argparse.ArgumentParser(prog="pagedkv", description="A paged KV cache for LLM engines.")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="lowest structlog level printed (default info)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; returns its exit status."""
    args = build_parser().parse_args(argv)
    if not structlog.is_configured():
        level = getattr(logging, args.log_level.upper())
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
