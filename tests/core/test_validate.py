"""validate: the one token-id rule and the block-index checks every module shares."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import MAX_TOKEN_ID, token_ids
from pagedkv.core.validate import block_index, block_list


def test_token_ids_accepts_ints_in_range_and_returns_a_new_list():
    source = [0, 5, MAX_TOKEN_ID]
    out = token_ids(source, "prompt")
    assert out == [0, 5, 2**63 - 1] and out is not source
    assert token_ids((1, 2), "prompt") == [1, 2]
    assert token_ids([], "prompt") == []
    got = token_ids(np.array([3, 4], np.int32), "prompt")
    assert got == [3, 4] and all(type(t) is int for t in got)
    got = token_ids([np.int64(7), np.uint16(8)], "prompt")
    assert got == [7, 8] and all(type(t) is int for t in got)
    assert token_ids(np.zeros(0, np.float64), "prompt") == []  # an empty array has no bad entry


@pytest.mark.parametrize(
    "values, error, message",
    [
        (None, TypeError, "prompt must be a sequence of int token ids, got NoneType None"),
        ("ab", TypeError, "prompt must be a sequence of int token ids, got str 'ab'"),
        (b"ab", TypeError, "prompt must be a sequence of int token ids, got bytes b'ab'"),
        (7, TypeError, "prompt must be a sequence of int token ids, got int 7"),
        ([1, 2.0], TypeError, r"prompt\[1\] must be an int token id, got 2.0"),
        ([True], TypeError, r"prompt\[0\] must be an int token id, got True"),
        ([1, None], TypeError, r"prompt\[1\] must be an int token id, got None"),
        ([-1], ValueError, r"prompt\[0\] is -1: token ids must lie in \[0, 2\*\*63\)"),
        ([0, 2**63], ValueError, r"prompt\[1\] is 9223372036854775808: token ids must lie"),
        ([2**64], ValueError, r"prompt\[0\] is 18446744073709551616: token ids must lie"),
        (np.array([[1, 2]]), TypeError, r"prompt must be a 1-D integer array, got dtype int64 of shape \(1, 2\)"),
        (np.array([1.5]), TypeError, "prompt must be a 1-D integer array, got dtype float64"),
        (np.array([2**64 - 1], np.uint64), ValueError, r"prompt\[0\] is 18446744073709551615"),
    ],
)
def test_token_ids_names_the_bad_value(values, error, message):
    with pytest.raises(error, match=f"^{message}"):
        token_ids(values, "prompt")


def test_block_index_and_block_list():
    assert block_index(np.int64(3), 4) == 3
    with pytest.raises(IndexError, match="^block 4 out of range for a cache of 4 blocks$"):
        block_index(4, 4)
    with pytest.raises(IndexError, match="^block -1 out of range"):
        block_index(-1, 4)
    with pytest.raises(TypeError, match="^block index must be an int, got False$"):
        block_index(False, 4)
    assert block_list(np.array([2, 0]), 4) == [2, 0]
    assert block_list(range(3), 4) == [0, 1, 2]
    with pytest.raises(TypeError, match="^table must be a sequence of int block indices, got NoneType None$"):
        block_list(None, 4, "table")
    with pytest.raises(TypeError, match="^table must be a sequence of int block indices, got str 'ab'$"):
        block_list("ab", 4, "table")
    with pytest.raises(IndexError, match="^block 9 out of range for a cache of 4 blocks$"):
        block_list([1, 9], 4)
