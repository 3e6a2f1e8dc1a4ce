"""The ranges of one batched copy (`copy_batch_async`), checked before anything is enqueued.

`as_ranges` turns the three sequences into uint64 arrays (equal lengths, integers,
no negative value). `AddressTable` holds the live spans a batch may touch (device
allocations and swap memories, sorted, non-overlapping), each with the offset that turns
its addresses into device addresses (0 for device memory; device pointer minus host
address for mapped host memory); `locate` finds the span of every range at once and
raises IndexError for the first range outside all of them. `check_overlaps` refuses
destinations that overlap each other or any source. Pure numpy: no driver call.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

_U64_MAX = 2**64 - 1


def _column(values: Any, what: str) -> np.ndarray:
    # a list mixing Python ints and numpy uint64 would become float64 in np.asarray:
    # anything but an integer ndarray is read value by value
    arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"copy_batch_async {what} must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.uint64)
    if arr.dtype.kind == "O":
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in arr.tolist()):
            raise TypeError(f"copy_batch_async {what} must hold ints")
        ints = [int(v) for v in arr.tolist()]
        bad = next((i for i, v in enumerate(ints) if v < 0 or v > _U64_MAX), None)
        if bad is not None:
            problem = "is negative" if ints[bad] < 0 else "is not a 64-bit unsigned value"
            raise ValueError(f"copy_batch_async {what}[{bad}] = {ints[bad]} {problem}")
        return np.asarray(ints, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"copy_batch_async {what} must hold ints, got dtype {arr.dtype}")
    if arr.dtype.kind == "i":
        negative = np.flatnonzero(arr < 0)
        if negative.size:
            i = int(negative[0])
            raise ValueError(f"copy_batch_async {what}[{i}] = {int(arr[i])} is negative")
    return arr.astype(np.uint64)


def as_ranges(
    dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(dsts, srcs, sizes, index) as uint64 arrays of one length, ranges of 0 bytes left out
    (they copy nothing; `index` holds each kept range's position in the arguments); ValueError for unequal lengths, a negative value or one past 64 bits,
    TypeError for non-integers, IndexError for a range whose end wraps past 2**64."""
    d, s, n = _column(dsts, "dsts"), _column(srcs, "srcs"), _column(sizes, "sizes")
    if not d.size == s.size == n.size:
        raise ValueError(f"copy_batch_async needs equal lengths: {d.size} dsts, {s.size} srcs, {n.size} sizes")
    # an end past 2**64 wraps: refuse it as a range outside memory
    wraps = np.flatnonzero((d + n < d) | (s + n < s))
    if wraps.size:
        i = int(wraps[0])
        raise IndexError(f"copy_batch_async range {i}: {int(n[i])} bytes run past the end of the address space")
    index = np.flatnonzero(n > 0)
    return d[index], s[index], n[index], index


class AddressTable:
    """Sorted, non-overlapping spans `(base, nbytes, device_offset, is_host)` a batch may
    touch: `device_offset` turns a span's address into the device's address of the same
    byte, `is_host` marks host memory."""

    def __init__(self, spans: Sequence[tuple[int, int, int, bool]]):
        spans = sorted(spans)
        self.bases = np.asarray([b for b, _, _, _ in spans], dtype=np.uint64)
        self.ends = np.asarray([b + n for b, n, _, _ in spans], dtype=np.uint64)
        self.offsets = np.asarray([o for _, _, o, _ in spans], dtype=np.int64)
        self.is_host = np.asarray([h for _, _, _, h in spans], dtype=bool)

    def device_addresses(self, addresses: np.ndarray, spans: np.ndarray) -> np.ndarray:
        """The device's addresses of `addresses`, which lie in spans `spans` (from `locate`)."""
        return (addresses.astype(np.int64) + self.offsets[spans]).astype(np.uint64)

    def locate(self, addresses: np.ndarray, sizes: np.ndarray, index: np.ndarray, what: str) -> np.ndarray:
        """Index of the span holding each `[address, address + size)`; IndexError naming the
        first range (its position `index[i]` in the arguments, `what` and the address) that
        lies in none."""
        if self.bases.size == 0:
            inside = np.zeros(addresses.size, dtype=bool)
            at = np.zeros(addresses.size, dtype=np.int64)
        else:
            at = np.searchsorted(self.bases, addresses, side="right").astype(np.int64) - 1
            safe = np.maximum(at, 0)
            inside = (at >= 0) & (addresses + sizes <= self.ends[safe]) & (addresses < self.ends[safe])
            at = safe
        outside = np.flatnonzero(~inside)
        if outside.size:
            i = int(outside[0])
            raise IndexError(
                f"copy_batch_async range {int(index[i])}: {what} 0x{int(addresses[i]):x} + {int(sizes[i])} bytes is not "
                "inside one live device allocation or swap memory of this backend"
            )
        return at


def check_overlaps(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, index: np.ndarray) -> None:
    """ValueError when two destination ranges overlap, or a destination overlaps a source
    (of any range: the copies of a batch run in no particular order); ranges are named by
    their positions `index` in the arguments."""
    if dsts.size == 0:
        return
    order = np.argsort(dsts, kind="stable")
    starts, ends = dsts[order], dsts[order] + sizes[order]
    clash = np.flatnonzero(starts[1:] < ends[:-1])
    if clash.size:
        a, b = int(order[clash[0]]), int(order[clash[0] + 1])
        ia, ib = sorted((int(index[a]), int(index[b])))
        raise ValueError(
            f"copy_batch_async destinations of ranges {ia} and {ib} overlap "
            f"(at 0x{int(dsts[b]):x})"
        )
    by_src = np.argsort(srcs, kind="stable")
    src_starts = srcs[by_src]
    src_max_end = np.maximum.accumulate(srcs[by_src] + sizes[by_src])
    # a source starting before a destination's end and ending after its start overlaps it
    before = np.searchsorted(src_starts, dsts + sizes, side="left")
    hits = np.flatnonzero((before > 0) & (src_max_end[np.maximum(before, 1) - 1] > dsts))
    if hits.size:
        i = int(hits[0])
        for j in by_src[: int(before[i])].tolist():
            if int(srcs[j]) + int(sizes[j]) > int(dsts[i]):
                raise ValueError(
                    f"copy_batch_async destination of range {int(index[i])} (0x{int(dsts[i]):x}, {int(sizes[i])} bytes) "
                    f"overlaps the source of range {int(index[j])} (0x{int(srcs[j]):x}, {int(sizes[j])} bytes)"
                )
