"""The range checks of copy_batch_async (pagedkv.driver.batch_ranges), on the CPU with no
driver: parsing, the span lookup and the overlap rules against a brute-force model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.backends.batch_ranges import AddressTable, as_ranges, check_overlaps


def test_as_ranges_accepts_ints_and_numpy_and_drops_empty_ranges():
    d, s, n, index = as_ranges([10, np.uint64(2**63 + 5), 30], np.array([1, 2, 3], np.int64), [4, 0, 6])
    assert d.dtype == s.dtype == n.dtype == np.uint64
    assert d.tolist() == [10, 30] and s.tolist() == [1, 3] and n.tolist() == [4, 6] and index.tolist() == [0, 2]
    empty = as_ranges([], [], [])
    assert [a.size for a in empty] == [0, 0, 0, 0]


@pytest.mark.parametrize(
    "args,kind,text",
    [
        (([1, 2], [1], [1, 1]), ValueError, "equal lengths: 2 dsts, 1 srcs, 2 sizes"),
        (([1], [2], [-3]), ValueError, "sizes[0] = -3 is negative"),
        (([1, -1], [2, 2], [1, 1]), ValueError, "dsts[1] = -1 is negative"),
        (([1], [2**64], [1]), ValueError, "srcs[0] = 18446744073709551616 is not a 64-bit unsigned value"),
        (([1.5], [2], [1]), TypeError, "dsts must hold ints"),
        (([True], [2], [1]), TypeError, "dsts must hold ints"),
        (([[1]], [[2]], [[1]]), ValueError, "1-D sequence"),
        (([2**64 - 4], [0], [8]), IndexError, "range 0: 8 bytes run past the end of the address space"),
    ],
)
def test_as_ranges_refuses_bad_values_naming_them(args, kind, text):
    with pytest.raises(kind, match=text.replace("[", r"\[").replace("]", r"\]")):
        as_ranges(*args)


def test_locate_finds_spans_and_names_the_first_range_outside():
    table = AddressTable([(5000, 100, 0, False), (1000, 1000, 7, True)])
    spans = table.locate(np.array([1000, 1999, 5000, 5050], np.uint64), np.array([1000, 1, 100, 50], np.uint64),
                         np.arange(4), "source")
    assert spans.tolist() == [0, 0, 1, 1]
    assert table.is_host[spans].tolist() == [True, True, False, False]
    assert table.device_addresses(np.array([1000, 5000], np.uint64), np.array([0, 1])).tolist() == [1007, 5000]
    for address, size in ((999, 1), (1999, 2), (2000, 1), (5099, 2), (0, 1), (6000, 1), (1500, 4000)):
        with pytest.raises(IndexError, match=f"range 7: destination 0x{address:x} \\+ {size} bytes is not inside"):
            table.locate(np.array([1000, address], np.uint64), np.array([1, size], np.uint64), np.array([3, 7]), "destination")
    with pytest.raises(IndexError, match="range 0"):
        AddressTable([]).locate(np.array([1], np.uint64), np.array([1], np.uint64), np.arange(1), "source")


def _overlap(a0, a1, b0, b1):
    return a0 < b1 and b0 < a1


ranges = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(1, 40)), max_size=12)


@given(ranges)
def test_check_overlaps_agrees_with_brute_force(rs):
    d = np.array([r[0] for r in rs], np.uint64)
    s = np.array([r[1] for r in rs], np.uint64)
    n = np.array([r[2] for r in rs], np.uint64)
    dst_clash = any(_overlap(rs[i][0], rs[i][0] + rs[i][2], rs[j][0], rs[j][0] + rs[j][2])
                    for i in range(len(rs)) for j in range(i + 1, len(rs)))
    src_clash = any(_overlap(rs[i][0], rs[i][0] + rs[i][2], rs[j][1], rs[j][1] + rs[j][2])
                    for i in range(len(rs)) for j in range(len(rs)))
    if dst_clash or src_clash:
        with pytest.raises(ValueError, match="overlap"):
            check_overlaps(d, s, n, np.arange(len(rs)))
    else:
        check_overlaps(d, s, n, np.arange(len(rs)))


def test_check_overlaps_names_the_ranges_by_their_argument_positions():
    index = np.array([2, 5, 9])
    with pytest.raises(ValueError, match="destinations of ranges 2 and 9 overlap"):
        check_overlaps(np.array([100, 300, 105], np.uint64), np.array([0, 0, 0], np.uint64),
                       np.array([10, 10, 10], np.uint64), index)
    with pytest.raises(ValueError, match=r"destination of range 5 \(0x12c, 10 bytes\) overlaps the source of range 2 \(0x12b, 10 bytes\)"):
        check_overlaps(np.array([100, 300, 500], np.uint64), np.array([299, 0, 0], np.uint64),
                       np.array([10, 10, 10], np.uint64), index)
    # touching ranges do not overlap; sources may overlap each other
    check_overlaps(np.array([100, 110], np.uint64), np.array([120, 120], np.uint64), np.array([10, 10], np.uint64), index[:2])
