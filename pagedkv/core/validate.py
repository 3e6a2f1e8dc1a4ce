"""The argument checks every module shares: ints (Python or numpy, never bool) as indices
and counts, with errors that name the argument and the bad value."""

from __future__ import annotations

import array
import operator
import sys

import numpy as np


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


MAX_TOKEN_ID = 2**63 - 1
"""The largest token id (ids are stored and hashed as int64)."""


def token_ids(values: object, what: str = "tokens") -> list[int]:
    """`values` as a new list of token ids: ints (Python or numpy, never bool) in
    [0, 2**63), from a list, tuple or other sized iterable, or a 1-D integer numpy array.
    TypeError for a non-sequence (None, a str or bytes included) or a non-int entry,
    ValueError for an id out of range; each names `what`, the position and the value."""
    if type(values) is list:
        return list(checked_token_ids(values, what))
    return checked_token_ids(list(values) if type(values) is tuple else _token_sequence(values, what), what)


def token_ids_and_bytes(values: object, what: str = "tokens", copy: bool = True) -> tuple[list[int], bytes]:
    """`token_ids(values, what)` and their int64 little-endian bytes, in one pass: a 1-D
    integer numpy array is checked vectorised (one min and max, not an entry at a time),
    a list of plain ints at C speed (returned itself with `copy=False`, for a caller that
    keeps nothing); anything else, or a bad entry, goes through `token_ids`, which raises
    naming it."""
    if type(values) is list:
        data = int64_bytes_of_ids(values)
        if data is not None:
            return (list(values) if copy else values), data
    elif isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        if values.size == 0:
            return [], b""
        if int(values.min()) >= 0 and int(values.max()) <= MAX_TOKEN_ID:
            return values.tolist(), values.astype("<i8", copy=False).tobytes()
    tokens = token_ids(values, what)
    return tokens, int64_bytes_of_ids(tokens)  # type: ignore[return-value] - valid ids always pack


def checked_token_ids(values: list, what: str) -> list[int]:
    """`token_ids` of a list, returning `values` itself when every entry already is a
    Python int in range (checked at C speed), else a corrected new list or the error."""
    if int64_bytes_of_ids(values) is not None:
        return values
    out = list(values)
    for i, t in enumerate(out):
        if type(t) is not int:
            if isinstance(t, (bool, float)) or not (isinstance(t, int) or hasattr(t, "__index__")):
                raise TypeError(f"{what}[{i}] must be an int token id, got {t!r}")
            out[i] = t = operator.index(t)
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"{what}[{i}] is {t}: token ids must lie in [0, 2**63)")
    return out


def int64_bytes_of_ids(values: list) -> bytes | None:
    """The int64 little-endian bytes of `values` when it is a list of Python ints in
    [0, 2**63) (checked at C speed), else None (the caller then checks entry by entry)."""
    if not values:
        return b""
    if operator.countOf(map(type, values), int) != len(values):  # no bool, no numpy int
        return None
    try:
        wide = array.array("Q", values)  # refuses a negative id; much faster to build than "q"
    except OverflowError:
        return None
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        wide.byteswap()
    data = wide.tobytes()
    if not data[7::8].isascii():  # an id's top byte >= 0x80: past 2**63 - 1
        return None
    return data


def step_arguments(n_tokens: object, ids: object) -> tuple[int, list[int] | None]:
    """An append step's `(n_tokens, token ids)`, checked: the ids (None, or valid token ids
    as `token_ids` returns them, named "token_ids") and `n_tokens` as a non-negative int,
    defaulting to their count (else 1); ValueError naming both when they disagree."""
    if ids is not None:
        ids = token_ids(ids, "token_ids")
        if n_tokens is None:
            n_tokens = len(ids)
        elif n_tokens != len(ids):
            raise ValueError(f"n_tokens is {n_tokens!r} but {len(ids)} token ids were given")
    elif n_tokens is None:
        n_tokens = 1
    if type(n_tokens) is not int or n_tokens < 0:  # type: ignore[operator]
        n_tokens = non_negative_int(n_tokens, "n_tokens")
    return n_tokens, ids  # type: ignore[return-value]


def _token_sequence(values: object, what: str) -> list:
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not (values.size == 0 or np.issubdtype(values.dtype, np.integer)):
            raise TypeError(f"{what} must be a 1-D integer array, got dtype {values.dtype} of shape {values.shape}")
        return values.tolist()
    if values is None or isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__len__"):
        raise TypeError(f"{what} must be a sequence of int token ids, got {type(values).__name__} {values!r:.80}")
    return list(values)


def block_index(value: object, num_blocks: int) -> int:
    """`value` as an int block index in [0, num_blocks); TypeError for a non-int (a bool
    included), IndexError naming the index and the cache size otherwise."""
    if type(value) is not int:
        value = as_int(value, "block index")
    if not 0 <= value < num_blocks:  # type: ignore[operator]
        raise IndexError(f"block {value} out of range for a cache of {num_blocks} blocks")
    return value  # type: ignore[return-value]


def block_list(blocks: object, num_blocks: int, what: str = "blocks") -> list[int]:
    """`blocks` (an iterable of int indices, or a 1-D integer numpy array) as a new list of
    Python ints, each in [0, num_blocks); the first bad entry is named: TypeError for None,
    a str or a non-int entry, IndexError for an index out of range. Checked at C speed when
    every entry is a plain int."""
    if isinstance(blocks, np.ndarray):
        if blocks.ndim != 1 or not (blocks.size == 0 or np.issubdtype(blocks.dtype, np.integer)):
            raise TypeError(f"{what} must be a 1-D integer array, got dtype {blocks.dtype} of shape {blocks.shape}")
        out = blocks.tolist()
    else:
        if blocks is None or isinstance(blocks, (str, bytes, bytearray)) or not hasattr(blocks, "__iter__"):
            raise TypeError(f"{what} must be a sequence of int block indices, got {type(blocks).__name__} {blocks!r:.80}")
        out = list(blocks)  # type: ignore[call-overload]
    if out and (set(map(type, out)) != {int} or min(out) < 0 or max(out) >= num_blocks):
        out = [block_index(b, num_blocks) for b in out]
    return out


def seconds(value: object, what: str = "timeout", allow_none: bool = False) -> float | None:
    """`value` as a finite number of seconds >= 0 (or None when `allow_none`); ValueError
    naming `what` and the value otherwise (NaN, infinities and bools included)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        extra = " or None" if allow_none else ""
        raise ValueError(f"{what} must be a finite number of seconds >= 0{extra}, got {value!r}")
    return float(value)
