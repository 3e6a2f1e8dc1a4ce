"""Conformance rules for the GpuBackend protocol itself: memory, copies, memsets,
streams, mem_info, the region table and the three block kernels.

Each rule gets a fresh backend, frees what it allocates, and compares against the host
reference: numpy for the bytes, HostBackend's reduction and `math.fsum` for the sums.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import ml_dtypes
import numpy as np

from ..backends.capabilities import CAPABILITIES, backend_supports
from ..backends.host import HostBackend, bf16_bytes_to_float64
from ..backends.protocol import Bf16Stats, BlockRegions, DevicePtr, GpuBackend
from ..errors import DeviceMemoryError, DeviceOutOfMemory
from .registry import RuleNotApplicable, expect, expect_bytes, expect_raises, read, rule

ALIGNMENT = 256
"""Every allocation must start on a multiple of this many bytes (CUDA guarantees 256)."""

_SIZES = (1, 255, 256, 257, 4096, 3)
_BLOCKS = 6
_SPECS = ((64, 64), (96, 80), (32, 32))  # (stride, nbytes); row 1 leaves a 16-byte gap per block


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class _Pools:
    """Pools of `_BLOCKS` blocks for `_SPECS`, filled with a known pattern, and their table."""

    def __init__(self, gpu: Any, seed: int = 7):
        self.gpu = gpu
        self.ptrs: list[DevicePtr] = []
        self.contents: list[np.ndarray] = []
        self.regions: BlockRegions | None = None
        try:
            for i, (stride, _) in enumerate(_SPECS):
                ptr = gpu.alloc(_BLOCKS * stride)
                self.ptrs.append(ptr)
                data = _pattern(_BLOCKS * stride, seed + i)
                gpu.copy_h2d(data, ptr)
                self.contents.append(data)
            self.regions = gpu.create_block_regions(
                [(int(p), stride, nbytes) for p, (stride, nbytes) in zip(self.ptrs, _SPECS)]
            )
        except BaseException:
            self.close()
            raise

    def expect_contents(self, expected: list[np.ndarray], what: str) -> None:
        for r, (ptr, (stride, _), want) in enumerate(zip(self.ptrs, _SPECS, expected)):
            expect_bytes(read(self.gpu, ptr, _BLOCKS * stride), want, f"{what}, region {r}")

    def close(self) -> None:
        if self.regions is not None:
            self.gpu.destroy_block_regions(self.regions)
            self.regions = None
        for ptr in self.ptrs:
            self.gpu.free(ptr)
        self.ptrs = []


# -- capabilities -----------------------------------------------------------------------

_CAPABILITY_METHODS = {
    "pinned": ("alloc_pinned", "copy_h2d_async", "copy_d2h_async"),
    "stream_wait": ("make_stream_wait",),
    "host_view": ("view",),
    "vmm": ("vmm_granularity", "reserve_address", "map_chunk", "unmap_chunk", "release_address"),
}


@rule("protocol")
def rule_capabilities_consistent(gpu: Any) -> None:
    """supports(name) answers a bool for every known name (or the backend has no
    `supports`: only the protocol), ValueError for an unknown one; a stated capability
    has its methods; at most one device kind; a GPU kind comes with an int device_ordinal."""
    stated = {name for name in CAPABILITIES if backend_supports(gpu, name)}
    if getattr(gpu, "supports", None) is not None:
        expect_raises(ValueError, lambda: gpu.supports("no-such-capability"), "supports of an unknown name",
                      names="no-such-capability")
    for name, methods in _CAPABILITY_METHODS.items():
        missing = [m for m in methods if name in stated and not callable(getattr(gpu, m, None))]
        expect(not missing, f"states {name!r} but has no {', '.join(missing)}")
    kinds = sorted(n for n in stated if n.startswith("device:"))
    expect(len(kinds) <= 1, f"states more than one device kind: {kinds}")
    if kinds and kinds[0] != "device:cpu":
        ordinal = getattr(gpu, "device_ordinal", None)
        expect(isinstance(ordinal, int) and not isinstance(ordinal, bool), f"states {kinds[0]!r} but device_ordinal is {ordinal!r}")


@rule("protocol", requires=("stream_wait",))
def rule_stream_wait(gpu: Any) -> None:
    """make_stream_wait(waiting, on) orders the work enqueued later on `waiting` after the
    work enqueued so far on `on`."""
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    a, b = gpu.alloc(4096), gpu.alloc(4096)
    try:
        gpu.memset_async(b, 0, 4096, s2)
        gpu.synchronize(s2)
        gpu.memset_async(a, 0x5C, 4096, s1)
        gpu.make_stream_wait(s2, s1)
        gpu.copy_d2d(a, b, 4096, s2)
        gpu.synchronize(s2)
        expect_bytes(read(gpu, b, 4096), np.full(4096, 0x5C, np.uint8), "a copy on the waiting stream")
        gpu.synchronize(s1)
    finally:
        gpu.free(a)
        gpu.free(b)
        gpu.destroy_stream(s1)
        gpu.destroy_stream(s2)


@rule("protocol", requires=("host_view",))
def rule_host_view(gpu: Any) -> None:
    """view(ptr, n) is a writable uint8 numpy array over the device bytes (what the copies
    see), and raises DeviceMemoryError past an allocation's end."""
    p = gpu.alloc(256)
    try:
        gpu.copy_h2d(_pattern(256, 4), p)
        view = gpu.view(p.offset(16), 32)
        expect(isinstance(view, np.ndarray) and view.dtype == np.uint8 and view.size == 32, f"view(...) is {view!r}")
        expect_bytes(view, _pattern(256, 4)[16:48], "view of bytes 16..48")
        view[:] = 0xAA
        want = _pattern(256, 4)
        want[16:48] = 0xAA
        expect_bytes(read(gpu, p, 256), want, "bytes written through a view")
        expect_raises(DeviceMemoryError, lambda: gpu.view(p.offset(200), 57), "a view past the end")
    finally:
        gpu.free(p)


def _readable_host_range(address: int, nbytes: int) -> bool | None:
    """Whether [address, address + nbytes) lies in readable mappings of this process, one
    or several adjacent ones (None where /proc/self/maps is absent), so the rule never
    reads an unmapped address."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return None
    covered, stop = address, address + nbytes
    for line in lines:  # the kernel lists mappings in address order
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= covered < end:
            if not perms.startswith("r"):
                return False
            covered = end
            if covered >= stop:
                return True
    return False


@rule("protocol", requires=("device:cpu",))
def rule_cpu_addresses_are_host_memory(gpu: Any) -> None:
    """A "device:cpu" backend without "host_view" hands out real host addresses (pool
    views export them to DLPack consumers as they are): the bytes copied in are the
    bytes at the address."""
    if backend_supports(gpu, "host_view"):
        raise RuleNotApplicable("the backend states 'host_view': its addresses need not be host addresses")
    p = gpu.alloc(300)
    try:
        gpu.copy_h2d(_pattern(300, 5), p)
        mapped = _readable_host_range(int(p), 300)
        if mapped is None:
            raise RuleNotApplicable("no /proc/self/maps on this system to tell a host address from another")
        expect(mapped, f"{p!r} + 300 bytes is not readable host memory of this process")
        at = np.frombuffer(ctypes.string_at(int(p), 300), np.uint8)
        expect_bytes(at, _pattern(300, 5), f"the host memory at {p!r}")
    finally:
        gpu.free(p)


# -- memory ---------------------------------------------------------------------------


@rule("protocol")
def rule_protocol_methods(gpu: Any) -> None:
    """The backend has every method of GpuBackend (a runtime-checkable Protocol)."""
    missing = [name for name in _required_methods() if not callable(getattr(gpu, name, None))]
    expect(not missing, f"missing required methods: {', '.join(missing)}")
    expect(isinstance(gpu, GpuBackend), "isinstance(backend, GpuBackend) is False")


def _required_methods() -> list[str]:
    return [n for n in vars(GpuBackend) if not n.startswith("_") and callable(getattr(GpuBackend, n))]


@rule("protocol")
def rule_alloc_sizes_and_alignment(gpu: Any) -> None:
    """alloc(n) returns a non-null DevicePtr, 256-byte aligned; live allocations do not
    overlap and every byte of each is writable and reads back."""
    ptrs: list[DevicePtr] = []
    try:
        for n in _SIZES:
            ptrs.append(gpu.alloc(n))
        for p, n in zip(ptrs, _SIZES):
            expect(isinstance(p, DevicePtr), f"alloc({n}) returned {type(p).__name__}, not DevicePtr")
            expect(not p.is_null, f"alloc({n}) returned the null pointer")
            expect(int(p) % ALIGNMENT == 0, f"alloc({n}) returned {p!r}, not {ALIGNMENT}-byte aligned")
        spans = sorted((int(p), int(p) + n) for p, n in zip(ptrs, _SIZES))
        for (start, end), (nxt, _) in zip(spans, spans[1:]):
            expect(end <= nxt, f"allocations overlap: [{start:#x}, {end:#x}) and one at {nxt:#x}")
        for i, (p, n) in enumerate(zip(ptrs, _SIZES)):
            gpu.copy_h2d(_pattern(n, i), p)
        for i, (p, n) in enumerate(zip(ptrs, _SIZES)):
            expect_bytes(read(gpu, p, n), _pattern(n, i), f"the {n}-byte allocation at {p!r}")
    finally:
        for p in ptrs:
            gpu.free(p)


@rule("protocol")
def rule_alloc_refuses_bad_sizes(gpu: Any) -> None:
    """alloc of 0, a negative, a float or a bool raises ValueError naming the value, and
    allocates nothing."""
    before = gpu.mem_info()[0]
    for bad in (0, -1, 1.5, True):
        expect_raises(ValueError, lambda: gpu.alloc(bad), f"alloc({bad!r})", names=repr(bad))
    expect(gpu.mem_info()[0] == before, "a refused alloc changed mem_info's free bytes")


@rule("protocol")
def rule_free_refuses_double_unknown_and_interior(gpu: Any) -> None:
    """free of a freed pointer, of a pointer inside an allocation and of an address the
    backend never gave raises DeviceMemoryError naming the address; the live
    allocation stays intact."""
    keep = gpu.alloc(512)
    try:
        gone = gpu.alloc(512)
        gpu.free(gone)
        expect_raises(DeviceMemoryError, lambda: gpu.free(gone), "a double free", names=f"{int(gone):x}")
        expect_raises(DeviceMemoryError, lambda: gpu.free(keep.offset(8)), "free of an interior pointer",
                      names=f"{int(keep) + 8:x}")
        expect_raises(DeviceMemoryError, lambda: gpu.free(DevicePtr(0x100)), "free of an unknown pointer",
                      names="100")
        gpu.copy_h2d(_pattern(512, 1), keep)
        expect_bytes(read(gpu, keep, 512), _pattern(512, 1), "the allocation kept through refused frees")
    finally:
        gpu.free(keep)


@rule("protocol")
def rule_out_of_memory(gpu: Any) -> None:
    """An allocation larger than the device raises DeviceOutOfMemory (a MemoryError),
    leaks nothing (mem_info's free bytes unchanged) and leaves the backend usable."""
    free, total = gpu.mem_info()
    err = expect_raises(DeviceOutOfMemory, lambda: gpu.alloc(total + (1 << 20)), f"alloc of {total} + 1 MiB bytes")
    expect(isinstance(err, MemoryError), f"{type(err).__name__} is not a MemoryError")
    expect(gpu.mem_info()[0] == free, f"free bytes went from {free} to {gpu.mem_info()[0]} after a failed alloc")
    p = gpu.alloc(64)
    gpu.free(p)


@rule("protocol")
def rule_mem_info(gpu: Any) -> None:
    """mem_info() is (free, total) ints with 0 <= free <= total; an allocation of 1 MiB
    takes at least 1 MiB from free and its free gives it back."""
    free, total = gpu.mem_info()
    expect(all(isinstance(x, int) and not isinstance(x, bool) for x in (free, total)), f"mem_info() = {(free, total)!r}")
    expect(0 <= free <= total, f"mem_info() = {(free, total)}: need 0 <= free <= total")
    p = gpu.alloc(1 << 20)
    during = gpu.mem_info()[0]
    gpu.free(p)
    after = gpu.mem_info()[0]
    expect(during <= free - (1 << 20), f"free bytes {free} -> {during} after a 1 MiB alloc")
    expect(after >= during + (1 << 20), f"free bytes {during} -> {after} after freeing 1 MiB")
    expect(gpu.mem_info()[1] == total, "total bytes changed")


# -- copies and memsets ---------------------------------------------------------------


@rule("protocol")
def rule_copies_pageable(gpu: Any) -> None:
    """copy_h2d and copy_d2h move the raw bytes of numpy arrays (uint8, float32, ml_dtypes
    bfloat16), bytes, bytearray and memoryview, at any offset inside an allocation;
    copy_d2d copies between allocations and offsets on a stream."""
    a, b = gpu.alloc(4096), gpu.alloc(4096)
    try:
        data = _pattern(4096, 1)
        gpu.copy_h2d(data, a)
        expect_bytes(read(gpu, a, 4096), data, "uint8 array h2d then d2h")
        gpu.copy_h2d(b"hello", a.offset(10))
        out = bytearray(7)
        gpu.copy_d2h(a.offset(9), out)
        expect(bytes(out) == bytes([data[9]]) + b"hello" + bytes([data[15]]), f"bytes in, bytearray out: {bytes(out)!r}")
        gpu.copy_h2d(memoryview(b"\x01\x02\x03"), a.offset(4093))
        tail = memoryview(bytearray(3))
        gpu.copy_d2h(a.offset(4093), tail)
        expect(tail.tobytes() == b"\x01\x02\x03", "memoryview copies at the last bytes of an allocation")
        for values in (np.arange(16, dtype=np.float32) - 3.5, np.array([1.5, -2.0, 3.25, 0.0], ml_dtypes.bfloat16)):
            gpu.copy_h2d(values, b.offset(256))
            back = np.zeros_like(values)
            gpu.copy_d2h(b.offset(256), back)
            expect(back.tobytes() == values.tobytes(), f"{values.dtype} array round trip: {back!r}")
        s = gpu.default_stream()
        source = read(gpu, a, 4096)
        gpu.copy_h2d(data[::-1].copy(), b)
        gpu.copy_d2d(a.offset(8), b.offset(100), 64, s)
        gpu.synchronize(s)
        want = data[::-1].copy()
        want[100:164] = source[8:72]
        expect_bytes(read(gpu, b, 4096), want, "copy_d2d of 64 bytes between offsets")
    finally:
        gpu.free(a)
        gpu.free(b)


@rule("protocol")
def rule_copies_refuse_bad_host_buffers(gpu: Any) -> None:
    """copy_d2h into a read-only buffer and copy_h2d of a strided array raise ValueError,
    copy_h2d of a list raises TypeError; device memory is unchanged."""
    p = gpu.alloc(64)
    try:
        data = _pattern(64, 2)
        gpu.copy_h2d(data, p)
        frozen = np.zeros(64, np.uint8)
        frozen.flags.writeable = False
        expect_raises(ValueError, lambda: gpu.copy_d2h(p, b"immutable"), "copy_d2h into bytes", names="read-only")
        expect_raises(ValueError, lambda: gpu.copy_d2h(p, frozen), "copy_d2h into a read-only array", names="read-only")
        expect_raises(ValueError, lambda: gpu.copy_h2d(np.zeros((8, 16), np.uint8)[:, ::2], p),
                      "copy_h2d of a strided array", names="contiguous")
        expect_raises(TypeError, lambda: gpu.copy_h2d([1, 2, 3], p), "copy_h2d of a list", names="buffer")
        expect_bytes(read(gpu, p, 64), data, "memory after refused copies")
    finally:
        gpu.free(p)


@rule("protocol", requires=("pinned",))
def rule_copies_pinned(gpu: Any) -> None:
    """alloc_pinned(n) gives page-locked memory (`.array`, `free()`); the synchronous
    copies take it in both directions, and copy_h2d_async / copy_d2h_async move it (or a
    view of it) in stream order, visible after synchronize."""
    dev = gpu.alloc(256)
    pin = gpu.alloc_pinned(256)
    stream = gpu.create_stream()
    try:
        arr = pin.array
        expect(arr.dtype == np.uint8 and arr.size == 256 and arr.flags.writeable, f"alloc_pinned(256).array is {arr!r}")
        arr[:] = np.arange(256, dtype=np.uint8)
        gpu.copy_h2d(pin, dev)
        expect_bytes(read(gpu, dev, 256), np.arange(256, dtype=np.uint8), "copy_h2d from pinned memory")
        gpu.memset_async(dev, 0x11, 256, gpu.default_stream())
        gpu.synchronize(gpu.default_stream())
        gpu.copy_d2h(dev, arr)
        expect_bytes(arr, np.full(256, 0x11, np.uint8), "copy_d2h into pinned memory")
        arr[:] = _pattern(256, 3)
        gpu.copy_h2d_async(pin, dev, stream)
        gpu.synchronize(stream)
        arr[:] = 0
        gpu.copy_d2h_async(dev.offset(16), arr[32:64], stream)
        gpu.synchronize(stream)
        want = np.zeros(256, np.uint8)
        want[32:64] = _pattern(256, 3)[16:48]
        expect_bytes(arr, want, "copy_h2d_async then copy_d2h_async into a view of pinned memory")
    finally:
        gpu.destroy_stream(stream)
        pin.free()
        gpu.free(dev)


@rule("protocol")
def rule_memset(gpu: Any) -> None:
    """memset_async sets exactly the bytes asked, in stream order; a value outside 0..255
    or a negative byte count raises ValueError naming it and writes nothing."""
    s = gpu.default_stream()
    p = gpu.alloc(1024)
    try:
        gpu.memset_async(p, 0, 1024, s)
        gpu.memset_async(p.offset(100), 0xAB, 200, s)
        gpu.memset_async(p.offset(1023), 0xFF, 1, s)
        gpu.synchronize(s)
        want = np.zeros(1024, np.uint8)
        want[100:300] = 0xAB
        want[1023] = 0xFF
        expect_bytes(read(gpu, p, 1024), want, "memsets of 1024, 200 and 1 bytes")
        for bad in (256, -1):
            expect_raises(ValueError, lambda: gpu.memset_async(p, bad, 4, s), f"memset value {bad}", names=str(bad))
        expect_raises(ValueError, lambda: gpu.memset_async(p, 1, -1, s), "memset of -1 bytes", names="-1")
        gpu.synchronize(s)
        expect_bytes(read(gpu, p, 1024), want, "memory after refused memsets")
    finally:
        gpu.free(p)


@rule("protocol")
def rule_zero_length_ranges(gpu: Any) -> None:
    """Zero-byte memsets and copies, and block calls on no blocks, do nothing and raise
    nothing; a reduction over no blocks is (0.0, 0.0, 0.0)."""
    pools = _Pools(gpu)
    try:
        s = gpu.default_stream()
        p = pools.ptrs[0]
        gpu.memset_async(p, 0xEE, 0, s)
        gpu.copy_d2d(pools.ptrs[1], p, 0, s)
        gpu.copy_h2d(b"", p)
        gpu.copy_h2d(np.zeros(0, np.uint8), p)
        gpu.copy_d2h(p, bytearray(0))
        gpu.fill_blocks(pools.regions, [], 0xEE, s)
        gpu.copy_blocks(pools.regions, [], [], s)
        stats = gpu.reduce_bf16_blocks(pools.regions, 0, [], s)
        expect(tuple(stats) == (0.0, 0.0, 0.0), f"reduce over no blocks = {tuple(stats)}")
        gpu.synchronize(s)
        pools.expect_contents(pools.contents, "after zero-length calls")
    finally:
        pools.close()


# -- streams --------------------------------------------------------------------------


@rule("protocol")
def rule_stream_lifecycle(gpu: Any) -> None:
    """default_stream() is an int; create_stream gives distinct handles, not the default;
    destroying the default, a destroyed or an unknown stream raises ValueError naming it,
    and so does synchronize on a destroyed stream."""
    default = gpu.default_stream()
    expect(isinstance(default, int), f"default_stream() = {default!r}")
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    try:
        expect(len({default, s1, s2}) == 3, f"streams not distinct: default {default}, {s1}, {s2}")
        gpu.synchronize(s1)
        gpu.destroy_stream(s1)
        expect_raises(ValueError, lambda: gpu.destroy_stream(s1), "destroy of a destroyed stream", names=str(s1))
        expect_raises(ValueError, lambda: gpu.synchronize(s1), "synchronize on a destroyed stream", names=str(s1))
        expect_raises(ValueError, lambda: gpu.destroy_stream(default), "destroy of the default stream", names=str(default))
        gpu.synchronize(s2)
    finally:
        gpu.destroy_stream(s2)


@rule("protocol")
def rule_stream_order(gpu: Any) -> None:
    """Work enqueued on one stream (memsets, d2d copies, block fills and copies) runs in
    the order enqueued, and synchronize waits for all of it; after synchronizing one
    stream, work on another sees its results."""
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    pools = _Pools(gpu)
    try:
        a, b, c = pools.ptrs
        stride0, nbytes0 = _SPECS[0]
        gpu.memset_async(a, 1, _BLOCKS * stride0, s1)
        gpu.copy_d2d(a, c, 32, s1)                      # c[0:32] = 1
        gpu.memset_async(a, 2, stride0, s1)             # block 0 of a = 2
        gpu.fill_blocks(pools.regions, [1], 3, s1)      # block 1 of every row = 3
        gpu.copy_blocks(pools.regions, [0], [2], s1)    # block 2 = block 0
        gpu.copy_d2d(a.offset(2 * stride0), c.offset(32), 32, s1)  # c[32:64] = 2
        gpu.synchronize(s1)
        want_a = np.ones(_BLOCKS * stride0, np.uint8)
        want_a[:stride0] = 2
        want_a[stride0 : 2 * stride0] = 3
        want_a[2 * stride0 : 3 * stride0] = 2
        expect_bytes(read(gpu, a, _BLOCKS * stride0), want_a, "region 0 after six ordered calls on one stream")
        want_c = pools.contents[2].copy()
        want_c[0:32] = 1    # the first copy_d2d
        want_c[32:64] = 2   # the fill of block 1, then the last copy_d2d over it
        want_c[64:96] = 1   # block 2 = block 0
        expect_bytes(read(gpu, c, _BLOCKS * 32), want_c, "region 2 after six ordered calls on one stream")
        gpu.memset_async(b, 9, 96, s2)
        gpu.synchronize(s2)
        gpu.copy_d2d(b, a, 96, s1)
        gpu.synchronize(s1)
        expect_bytes(read(gpu, a, 96), np.full(96, 9, np.uint8), "work on one stream after another was synchronized")
    finally:
        pools.close()
        gpu.destroy_stream(s1)
        gpu.destroy_stream(s2)


# -- the region table and the block kernels --------------------------------------------


@rule("protocol")
def rule_region_table(gpu: Any) -> None:
    """create_block_regions returns a BlockRegions holding the rows as given (bases,
    strides, nbytes); rows with a null base or nbytes outside 1..stride raise ValueError;
    destroy_block_regions releases it (and a second table can be made after)."""
    p = gpu.alloc(_BLOCKS * 96)
    try:
        rows = [(int(p), 96, 80), (int(p) + 64, 96, 32)]
        regions = gpu.create_block_regions(rows)
        try:
            expect(isinstance(regions, BlockRegions), f"create_block_regions returned {type(regions).__name__}")
            expect(len(regions) == 2, f"len(regions) = {len(regions)}, expected 2")
            got = list(zip(regions.bases.tolist(), regions.strides.tolist(), regions.nbytes.tolist()))
            expect(got == rows, f"the table holds {got}, expected {rows}")
        finally:
            gpu.destroy_block_regions(regions)
        for bad, names in (([(0, 64, 64)], "non-null"), ([(int(p), 64, 65)], "stride"), ([(int(p), 64, 0)], "nbytes")):
            expect_raises(ValueError, lambda: gpu.create_block_regions(bad), f"create_block_regions({bad})", names=names)
        gpu.destroy_block_regions(gpu.create_block_regions(rows))
    finally:
        gpu.free(p)


@rule("protocol")
def rule_fill_blocks_matches_host(gpu: Any) -> None:
    """fill_blocks sets every byte of every listed block of every row (and nothing in the
    gap between nbytes and stride) to the value, byte for byte like the host reference."""
    pools = _Pools(gpu)
    try:
        s = gpu.default_stream()
        gpu.fill_blocks(pools.regions, [4, 1, 5], 0xEE, s)
        gpu.synchronize(s)
        want = [c.copy() for c in pools.contents]
        for w, (stride, nbytes) in zip(want, _SPECS):
            for blk in (1, 4, 5):
                w[blk * stride : blk * stride + nbytes] = 0xEE
        pools.expect_contents(want, "fill_blocks([4, 1, 5], 0xEE)")
    finally:
        pools.close()


@rule("protocol")
def rule_copy_blocks_matches_host(gpu: Any) -> None:
    """copy_blocks copies block src[i] over dst[i] in every row (nbytes of each, the gap
    untouched), byte for byte like the host reference."""
    pools = _Pools(gpu)
    try:
        s = gpu.default_stream()
        gpu.copy_blocks(pools.regions, [0, 5, 2], [3, 1, 4], s)
        gpu.synchronize(s)
        want = [c.copy() for c in pools.contents]
        for w, before, (stride, nbytes) in zip(want, pools.contents, _SPECS):
            for src, dst in ((0, 3), (5, 1), (2, 4)):
                w[dst * stride : dst * stride + nbytes] = before[src * stride : src * stride + nbytes]
        pools.expect_contents(want, "copy_blocks([0, 5, 2] -> [3, 1, 4])")
    finally:
        pools.close()


@rule("protocol")
def rule_block_calls_refuse_bad_arguments(gpu: Any) -> None:
    """Block calls refuse, with nothing written: racy copy pairs (unequal lengths, a
    repeated destination, a block both source and destination) and negative indices
    (ValueError), a fill value outside 0..255 (ValueError), a region row out of range
    (IndexError), a block past a row's allocation (IndexError or DeviceMemoryError)."""
    pools = _Pools(gpu)
    try:
        s, regions = gpu.default_stream(), pools.regions
        for src, dst, names in (([0, 1], [2], "as many"), ([0, 1], [2, 2], "repeat"), ([0, 1], [1, 2], "both")):
            expect_raises(ValueError, lambda: gpu.copy_blocks(regions, src, dst, s), f"copy_blocks({src}, {dst})", names=names)
        expect_raises(ValueError, lambda: gpu.fill_blocks(regions, [0, -1], 0, s), "fill_blocks of block -1", names="-1")
        expect_raises(ValueError, lambda: gpu.copy_blocks(regions, [-2], [1], s), "copy_blocks from block -2", names="-2")
        expect_raises(ValueError, lambda: gpu.fill_blocks(regions, [0], 256, s), "fill value 256", names="256")
        expect_raises(IndexError, lambda: gpu.reduce_bf16_blocks(regions, 3, [0], s), "reduce of row 3 of 3", names="3")
        expect_raises((IndexError, DeviceMemoryError), lambda: gpu.fill_blocks(regions, [0, _BLOCKS], 0, s),
                      f"fill_blocks of block {_BLOCKS} in pools of {_BLOCKS} blocks")
        expect_raises((IndexError, DeviceMemoryError), lambda: gpu.copy_blocks(regions, [_BLOCKS + 3], [0], s),
                      f"copy_blocks from block {_BLOCKS + 3} in pools of {_BLOCKS} blocks")
        gpu.synchronize(s)
        pools.expect_contents(pools.contents, "pools after refused block calls")
    finally:
        pools.close()


def _bf16_pools(gpu: Any, values: np.ndarray, stride: int) -> tuple[DevicePtr, BlockRegions]:
    """One pool holding `values` (blocks x per-block BF16 values) at `stride` bytes per
    block (stride >= 2 * per-block values + 2), as row 1 of a table whose row 0 is the
    same pool shifted by one BF16 value (a reduction of the wrong row gives other sums)."""
    blocks, per_block = values.shape
    raw = np.zeros(blocks * stride, np.uint8)
    for b in range(blocks):
        raw[b * stride : b * stride + 2 * per_block] = values[b].astype(ml_dtypes.bfloat16).view(np.uint8)
    ptr = gpu.alloc(raw.nbytes)
    try:
        gpu.copy_h2d(raw, ptr)
        rows = [(int(ptr) + 2, stride, 2 * per_block), (int(ptr), stride, 2 * per_block)]
        return ptr, gpu.create_block_regions(rows)
    except BaseException:
        gpu.free(ptr)
        raise


def _expect_exact_stats(gpu: Any, values: np.ndarray, chosen: list[int], stride: int, what: str,
                        against_host: bool = True) -> None:
    """The backend's reduction of `chosen` blocks equals math.fsum of the decoded values
    (and HostBackend's reduction of the same bytes, when `against_host`), exactly."""
    as_bf16 = values.astype(ml_dtypes.bfloat16)
    decoded = np.concatenate([bf16_bytes_to_float64(as_bf16[b].view(np.uint8)) for b in chosen])
    want = Bf16Stats(math.fsum(decoded), math.fsum(decoded * decoded), math.fsum(np.abs(decoded)))
    ptr, regions = _bf16_pools(gpu, values, stride)
    try:
        got = gpu.reduce_bf16_blocks(regions, 1, chosen, gpu.default_stream())
    finally:
        gpu.destroy_block_regions(regions)
        gpu.free(ptr)
    expect(isinstance(got, tuple) and len(got) == 3, f"{what}: reduce returned {got!r}")
    expect(tuple(got) == tuple(want), f"{what}: (sum, ssq, sabs) = {tuple(got)}, math.fsum gives {tuple(want)}")
    if not against_host:
        return
    host = HostBackend(capacity_bytes=values.shape[0] * stride + (1 << 16))
    hptr, hregions = _bf16_pools(host, values, stride)
    reference = host.reduce_bf16_blocks(hregions, 1, chosen, 0)
    expect(tuple(got) == tuple(reference), f"{what}: {tuple(got)}, HostBackend gives {tuple(reference)}")


@rule("protocol")
def rule_reduce_bf16_exact(gpu: Any) -> None:
    """reduce_bf16_blocks of the listed blocks of one row is (sum, sum of squares, sum of
    |x|) of its BF16 values, equal to math.fsum of the decoded values and to HostBackend,
    on values whose float64 sums are exact in any order (signed zeros and subnormals
    included); the other row of the table is not read."""
    rng = np.random.default_rng(3)
    values = rng.integers(-255, 256, (8, 40)) / 64.0
    values[2, :4] = [0.0, -0.0, 255 / 64, -255 / 64]
    _expect_exact_stats(gpu, values, [5, 0, 2, 7], 96, "40 values a block, stride 96")
    wide = rng.integers(-255, 256, (4, 1024)) * np.exp2(rng.integers(-4, 7, (4, 1024)))
    _expect_exact_stats(gpu, wide, [3, 1, 0], 2064, "1024 values a block from 2^-4 to 2^14 (float32 sums are not exact)")
    tiny = rng.integers(-127, 128, (3, 32)) * 2.0**-133  # BF16 subnormals: a flush to zero loses them
    tiny[1, :3] = [2.0**-126, -(2.0**-120), 2.0**-133]
    _expect_exact_stats(gpu, tiny, [0, 1, 2], 80, "subnormals and the smallest normals")


@rule("protocol")
def rule_reduce_bf16_correctly_rounded(gpu: Any) -> None:
    """The sums are exact then rounded once (equal to math.fsum) on values where float64
    accumulation is not: pairs that cancel (the exact sum is the few small values left),
    squares spanning 2^-266 to 2^84, subnormals."""
    rng = np.random.default_rng(11)
    half = rng.standard_normal(160) * np.exp2(rng.integers(-40, 41, 160))
    half = half.astype(ml_dtypes.bfloat16).astype(np.float64)
    small = np.array([1.0, 2.0**-130, 3.0 * 2.0**-133, -(2.0**-20)])
    values = rng.permutation(np.concatenate([half, -half, small, np.zeros(4)])).reshape(8, 41)
    _expect_exact_stats(gpu, values, [0, 4, 1, 5, 2, 3, 7, 6], 96, "cancelling values from 2^-133 to 2^42",
                        against_host=False)
