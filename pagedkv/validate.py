"""The argument checks every module shares: ints (Python or numpy, never bool) as indices
and counts, with errors that name the argument and the bad value."""

from __future__ import annotations

import operator


def as_int(value: object, what: str) -> int:
    """`value` as a Python int (numpy integers accepted); TypeError naming `what` for a
    bool, a float or anything else that is not an integer."""
    if type(value) is int:
        return value  # type: ignore[return-value]
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None


def positive_int(value: object, what: str) -> int:
    """`value` as an int > 0; ValueError naming `what` otherwise (a non-int included)."""
    try:
        number = as_int(value, what)
    except TypeError:
        number = None
    if number is None or number <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return number


def non_negative_int(value: object, what: str) -> int:
    """`value` as an int >= 0; ValueError naming `what` otherwise (a non-int included)."""
    try:
        number = as_int(value, what)
    except TypeError:
        number = None
    if number is None or number < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return number


def index_in_range(value: object, size: int, what: str, of: str) -> int:
    """`value` as an int in [0, size); TypeError for a non-int, IndexError naming `what`,
    the value and `of` (the container) otherwise; a negative index never wraps."""
    index = as_int(value, f"{what} index")
    if not 0 <= index < size:
        raise IndexError(f"{what} {index} out of range for {of}")
    return index
