"""Argument handling shared by the subcommands: one-line usage errors with exit status 2."""

from __future__ import annotations

import argparse
import sys

from ..errors import PagedKvError

USAGE_ERROR = 2
"""The exit status of a command line refused for a bad argument."""


class UsageError(PagedKvError):
    """A bad argument found after parsing (a value the parser cannot judge alone); the command
    line prints `pagedkv <command>: <message>` on stderr and exits with USAGE_ERROR."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, `<prog>: <message>`, then
    exit status 2 (argparse's own status for a usage error)."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: a decimal integer of at least 1; ArgumentTypeError naming the text otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def int_in(low: int, high: int, why: str = ""):
    """argparse type: a decimal integer in [low, high]; ArgumentTypeError naming the text
    and the range (and `why`) otherwise."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low:,} to {high:,}{why}, got {text!r}")
        return value

    convert.__name__ = "integer"
    return convert


def non_negative_int(text: str) -> int:
    """argparse type: a decimal integer of at least 0; ArgumentTypeError naming the text otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def converted(parse, what: str):
    """argparse type from `parse(text)`, which raises ValueError with a message naming the
    text: the message is kept (argparse would replace it with "invalid value")."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = what
    return convert


def say_error(command: str, message: str) -> None:
    """Print `pagedkv <command>: <message>` on stderr."""
    print(f"pagedkv {command}: {message}", file=sys.stderr)
