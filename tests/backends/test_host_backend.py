"""DevicePtr and HostBackend's own strictness (`host`). The backend contract itself, on every
backend, is the conformance suite: tests/testing/test_conformance_*.py (pagedkv.testing)."""

import numpy as np
import pytest

from pagedkv import (
    NULL,
    DeviceMemoryError,
    DeviceOutOfMemory,
    DevicePtr,
    HostBackend,
)

# -- DevicePtr -------------------------------------------------------------------------


def test_device_ptr_is_int_like():
    p = DevicePtr(0x1000)
    assert p == 0x1000 and int(p) == 4096 and isinstance(p, int)
    assert p + 16 == 0x1010
    assert {p: 1}[4096] == 1


def test_device_ptr_offset_and_null():
    p = DevicePtr(0x1000)
    q = p.offset(0x20)
    assert isinstance(q, DevicePtr) and q == 0x1020
    assert q.offset(-0x20) == p
    assert not p.is_null
    assert NULL.is_null and DevicePtr().is_null and DevicePtr(0).is_null
    with pytest.raises(ValueError, match="negative"):
        p.offset(-0x1001)


@pytest.mark.parametrize("bad", [1.9, "8", True])
def test_device_ptr_offset_refuses_non_int(bad):
    with pytest.raises(TypeError, match="byte offset must be an int"):
        DevicePtr(0x1000).offset(bad)
    assert DevicePtr(0x1000).offset(np.int64(16)) == 0x1010


def test_device_ptr_hex_repr():
    assert repr(DevicePtr(0x7F00_0000_0100)) == "DevicePtr(0x7f0000000100)"
    assert repr(NULL) == "DevicePtr(0x0)"


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (True, TypeError), (1.5, TypeError), ("0x10", TypeError)])
def test_device_ptr_rejects(bad, exc):
    with pytest.raises(exc):
        DevicePtr(bad)


def test_device_ptr_accepts_numpy_int():
    assert DevicePtr(np.int64(512)) == 512


# -- allocation (HostBackend) ----------------------------------------------------------


def test_addresses_aligned_unique_non_zero(host):
    sizes = [1, 255, 256, 257, 1000, 4096, 3]
    ptrs = [host.alloc(n) for n in sizes]
    assert all(isinstance(p, DevicePtr) and not p.is_null and int(p) % 256 == 0 for p in ptrs)
    assert len(set(ptrs)) == len(ptrs)
    # no two allocations overlap
    spans = sorted((int(p), int(p) + n) for p, n in zip(ptrs, sizes))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    # an address is never reused, so a stale pointer stays unknown
    host.free(ptrs[0])
    again = host.alloc(1)
    assert again not in ptrs


def test_live_allocations_and_bytes(host):
    assert host.live_allocations() == 0 and host.live_bytes() == 0
    a, b = host.alloc(100), host.alloc(300)
    assert host.live_allocations() == 2 and host.live_bytes() == 400
    assert host.mem_info() == ((1 << 30) - 400, 1 << 30)
    host.free(a)
    assert host.live_allocations() == 1 and host.live_bytes() == 300
    host.free(b)
    assert host.live_allocations() == 0 and host.live_bytes() == 0
    assert host.mem_info() == (1 << 30, 1 << 30)


def test_fresh_allocation_is_zeroed(host):
    p = host.alloc(64)
    out = np.full(64, 7, np.uint8)
    host.copy_d2h(p, out)
    assert not out.any()


def test_pointer_inside_allocation_resolves(host):
    p = host.alloc(1000)
    host.copy_h2d(b"\x01\x02\x03", p.offset(997))
    out = bytearray(4)
    host.copy_d2h(p.offset(996), out)
    assert out == b"\x00\x01\x02\x03"


def test_unknown_pointer(host):
    p = host.alloc(256)
    for bad in (DevicePtr(0x10), NULL, p.offset(256), p.offset(300)):
        with pytest.raises(DeviceMemoryError, match=f"0x{int(bad):x}.*not inside any live allocation"):
            host.copy_h2d(b"x", bad)


def test_range_past_allocation(host):
    p = host.alloc(100)
    with pytest.raises(DeviceMemoryError, match=r"runs 1 bytes past the end of the 100-byte allocation"):
        host.copy_h2d(bytes(51), p.offset(50))
    with pytest.raises(DeviceMemoryError, match="past the end"):
        host.copy_d2h(p, bytearray(101))
    with pytest.raises(DeviceMemoryError, match="past the end"):
        host.memset_async(p.offset(1), 0, 100, 0)
    other = host.alloc(100)
    with pytest.raises(DeviceMemoryError, match="past the end"):
        host.copy_d2d(p, other, 101, 0)
    # nothing was written by the refused calls
    out = np.empty(100, np.uint8)
    host.copy_d2h(p, out)
    assert not out.any()


def test_double_free_and_bad_free(host):
    p = host.alloc(512)
    with pytest.raises(DeviceMemoryError, match="not the start of an allocation"):
        host.free(p.offset(8))
    host.free(p)
    with pytest.raises(DeviceMemoryError, match=f"free of DevicePtr\\(0x{int(p):x}\\): unknown or already freed"):
        host.free(p)
    with pytest.raises(DeviceMemoryError, match="unknown"):
        host.free(DevicePtr(0x100))
    assert host.live_allocations() == 0


def test_use_after_free(host):
    p = host.alloc(64)
    host.free(p)
    with pytest.raises(DeviceMemoryError, match="not inside any live allocation"):
        host.copy_d2h(p, bytearray(1))


def test_out_of_memory_says_asked_and_free():
    small = HostBackend(capacity_bytes=1000)
    small.alloc(600)
    with pytest.raises(DeviceOutOfMemory, match=r"asked 500 bytes .* 400 bytes .* free of 1000") as info:
        small.alloc(500)
    assert isinstance(info.value, MemoryError)
    assert small.live_bytes() == 600 and small.live_allocations() == 1
    small.alloc(400)  # exactly what is left
    assert small.mem_info() == (0, 1000)


@pytest.mark.parametrize("bad", [0, -1, 1.0, True])
def test_alloc_size_must_be_positive_int(host, bad):
    with pytest.raises(ValueError, match="allocation size"):
        host.alloc(bad)


@pytest.mark.parametrize("bad", [0, -5, True, 1.5])
def test_capacity_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostBackend(capacity_bytes=bad)


# -- streams (HostBackend) -------------------------------------------------------------


def test_streams(host):
    assert host.default_stream() == 0
    s1, s2 = host.create_stream(), host.create_stream()
    assert len({0, s1, s2}) == 3
    p = host.alloc(16)
    host.memset_async(p, 5, 16, s1)
    host.synchronize(s1)
    host.destroy_stream(s1)
    for call in (lambda: host.synchronize(s1), lambda: host.memset_async(p, 0, 1, s1), lambda: host.destroy_stream(s1)):
        with pytest.raises(ValueError, match=str(s1)):
            call()
    with pytest.raises(ValueError, match="cannot destroy stream 0"):
        host.destroy_stream(0)
    with pytest.raises(ValueError, match="unknown stream 99"):
        host.synchronize(99)
    host.synchronize(s2)


# -- copies (HostBackend) ----------------------------------------------------------------


def read(gpu, ptr, n):
    out = np.empty(n, np.uint8)
    gpu.copy_d2h(ptr, out)
    return out


def test_host_copy_d2d_overlap_is_memmove(host):
    p = host.alloc(16)
    host.copy_h2d(bytes(range(16)), p)
    host.copy_d2d(p, p.offset(4), 8, 0)
    assert bytes(read(host, p, 16)) == bytes([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15])


def test_host_copy_refuses_bad_host_buffers(host):
    p = host.alloc(64)
    with pytest.raises(ValueError, match="read-only"):
        host.copy_d2h(p, b"immutable")
    with pytest.raises(ValueError, match="C-contiguous"):
        host.copy_h2d(np.zeros((8, 8), np.uint8)[:, ::2], p)
    with pytest.raises(TypeError, match="buffer protocol"):
        host.copy_h2d([1, 2, 3], p)


# -- block kernels (HostBackend) -----------------------------------------------------

BLOCKS = 6


def make_regions(gpu, specs):
    """Pools of BLOCKS blocks for (stride, nbytes) specs, filled with a known random pattern."""
    rng = np.random.default_rng(7)
    pools, rows, contents = [], [], []
    for stride, nbytes in specs:
        p = gpu.alloc(BLOCKS * stride)
        data = rng.integers(0, 256, BLOCKS * stride, dtype=np.uint8)
        gpu.copy_h2d(data, p)
        pools.append(p)
        rows.append((int(p), stride, nbytes))
        contents.append(data)
    return pools, gpu.create_block_regions(rows), contents


SPECS = [(64, 64), (96, 80), (32, 32)]  # row 1 has a 16-byte gap after each block


def test_host_block_kernels_bounds_checked(host):
    pools, regions, contents = make_regions(host, SPECS)
    with pytest.raises(DeviceMemoryError, match="past the end"):
        host.fill_blocks(regions, [BLOCKS], 0, 0)
    with pytest.raises(ValueError, match="negative block index -1"):
        host.fill_blocks(regions, [0, -1], 0, 0)
    with pytest.raises(ValueError, match="fill value"):
        host.fill_blocks(regions, [0], 256, 0)
    with pytest.raises(IndexError, match="region 3 out of range"):
        host.reduce_bf16_blocks(regions, 3, [0], 0)
    # nothing was filled by the refused calls
    for p, (stride, _), before in zip(pools, SPECS, contents):
        np.testing.assert_array_equal(read(host, p, BLOCKS * stride), before)


def test_host_reduce_refuses_odd_block(host):
    p = host.alloc(64)
    regions = host.create_block_regions([(int(p), 32, 31)])
    with pytest.raises(ValueError, match="odd block size 31"):
        host.reduce_bf16_blocks(regions, 0, [0], 0)


def test_host_copy_d2h_refuses_read_only_array(host):
    p = host.alloc(8)
    frozen = np.zeros(8, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        host.copy_d2h(p, frozen)


def test_free_of_a_non_address_names_it(host):
    ptr = host.alloc(64)
    for bad, shown in ((None, "NoneType None"), (1.5, "float 1.5"), (True, "bool True"), ("0x7f", "str '0x7f'")):
        with pytest.raises(TypeError, match=f"^free takes a DevicePtr returned by alloc, got {shown}"):
            host.free(bad)
    assert host.live_allocations() == 1
    host.free(ptr)
