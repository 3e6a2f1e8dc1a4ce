"""The kernel harness itself (tests/kernel_harness), on probe kernels run in this process
through its C entry points (no libcuda is loaded): built-in indices, CTA order, the 0xFF
shared-memory poison, barriers, divergence and alignment faults, __trap, warp intrinsics
and IEEE conversions. The harness runs CTAs one at a time and a CTA's threads as fibers:
it has no memory model, no concurrency between CTAs and no timing.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kernel_harness.build import HERE, HarnessBuildError, build_kernel_libraries, compiler, kernel_bounds, kernel_names
from kernel_harness.direct import ASCENDING, DESCENDING, RANDOM, Harness

OK, ILLEGAL_ADDRESS, MISALIGNED_ADDRESS, LAUNCH_FAILED = 0, 700, 716, 719


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C++ compiler on this machine to build the kernel harness")
    (lib,) = build_kernel_libraries([HERE / "probes.cu"], tmp_path_factory.mktemp("probes"), defines=lambda p: ())
    return Harness(lib)


def test_kernel_names_are_found_with_launch_bounds_and_line_breaks():
    src = 'extern "C" __global__ void a(int x) {}\nextern "C"  __global__ void __launch_bounds__(256, 2)\n  b_2 (int* p) {}'
    assert kernel_names(src) == ["a", "b_2"]
    assert kernel_bounds(src) == [("a", "0"), ("b_2", "256")]


def test_launch_bounds_are_evaluated_with_the_source_macros(probes):
    lib = probes.lib
    assert lib.pkv_harness_kernel_max_threads(probes.index["probe_bounded"]) == 64
    assert lib.pkv_harness_kernel_max_threads(probes.index["probe_indices"]) == 1024
    assert lib.pkv_harness_kernel_max_threads(len(probes.index)) == -1


def test_a_source_without_kernels_is_refused(tmp_path):
    empty = tmp_path / "empty.cu"
    empty.write_text("__device__ int f(int x) { return x; }\n")
    with pytest.raises(HarnessBuildError, match="declares no"):
        build_kernel_libraries([empty], tmp_path / "out", defines=lambda p: ())


def test_parameter_sizes_come_from_the_signature(probes):
    sizes, aligns = (ctypes.c_int * 32)(), (ctypes.c_int * 32)()
    n = probes.lib.pkv_harness_kernel_params(probes.index["probe_misaligned_ldcs"], sizes, aligns, 32)
    assert (n, list(sizes[:n]), list(aligns[:n])) == (3, [8, 4, 8], [8, 4, 8])


def test_built_in_indices_of_every_thread(probes):
    grid, block = (3, 2, 2), (4, 2, 3)
    out = np.zeros(12 * 24 * 4, np.uint32)
    assert probes.launch("probe_indices", grid, block, out, order=RANDOM, seed=5) == (OK, "")
    want = []
    for bz in range(2):
        for by in range(2):
            for bx in range(3):
                for tz in range(3):
                    for ty in range(2):
                        for tx in range(4):
                            want += [tx | ty << 8 | tz << 16, bx | by << 8 | bz << 16, 4 | 2 << 8 | 3 << 16, 3 | 2 << 8 | 2 << 16]
    assert out.tolist() == want


@pytest.mark.parametrize("order,seed", [(ASCENDING, 0), (DESCENDING, 0), (RANDOM, 1), (RANDOM, 2)])
def test_ctas_run_one_at_a_time_in_the_order_asked(probes, order, seed):
    log, count = np.zeros(40, np.uint32), np.zeros(1, np.uint32)
    assert probes.launch("probe_cta_order", 40, 32, log, count, order=order, seed=seed)[0] == OK
    assert count[0] == 40 and sorted(log.tolist()) == list(range(40))
    if order == ASCENDING:
        assert log.tolist() == list(range(40))
    elif order == DESCENDING:
        assert log.tolist() == list(range(39, -1, -1))
    else:
        assert log.tolist() not in (list(range(40)), list(range(39, -1, -1)))
        again = np.zeros(40, np.uint32)
        count[0] = 0
        probes.launch("probe_cta_order", 40, 32, again, count, order=order, seed=seed)
        assert again.tolist() == log.tolist(), "the same seed gives the same order"


def test_shared_memory_is_poisoned_before_every_cta(probes):
    out = np.zeros(3 * 64, np.uint32)
    assert probes.launch("probe_shared_poison", 3, 64, out)[0] == OK
    assert (out == 0xFFFFFFFF).all(), "CTA 1 and 2 must not see what CTA 0 wrote"


@pytest.mark.parametrize("order", [ASCENDING, DESCENDING, RANDOM])
def test_syncthreads_orders_writes_before_reads(probes, order):
    out = np.zeros(2 * 256, np.uint32)
    assert probes.launch("probe_barrier_exchange", 2, 256, out, order=order, seed=9)[0] == OK
    t = np.arange(256)
    assert out.tolist() == ((255 - t) * 7).tolist() + ((255 - t) * 7 + 1).tolist()


def test_barriers_at_different_sites_are_divergence(probes):
    status, message = probes.launch("probe_divergent_sites", 1, 32, np.zeros(32, np.uint32))
    assert status == LAUNCH_FAILED
    assert "barrier divergence" in message and "probes.cu" in message, message


def test_a_thread_that_exits_before_a_barrier_the_others_pass_is_divergence(probes):
    out = np.zeros(32, np.uint32)
    status, message = probes.launch("probe_early_exit", 1, 32, out)
    assert status == LAUNCH_FAILED
    assert "thread 3 passed 0 __syncthreads, thread 0 passed 1" in message, message


@pytest.mark.parametrize("offset,status", [(0, OK), (4, OK), (1, MISALIGNED_ADDRESS), (2, MISALIGNED_ADDRESS)])
def test_misaligned_scalar_store_is_a_fault(probes, offset, status):
    buf = np.zeros(16, np.uint8)
    got, message = probes.launch("probe_misaligned_store", 1, 1, buf, ctypes.c_int(offset))
    assert got == status, message
    if status == OK:
        assert buf[offset:offset + 4].tolist() == [4, 3, 2, 1]
    else:
        assert "misaligned" in message and "4-byte alignment" in message, message
        assert not buf.any(), "the faulting store wrote nothing"


@pytest.mark.parametrize("offset,status", [(0, OK), (16, OK), (8, MISALIGNED_ADDRESS), (4, MISALIGNED_ADDRESS)])
def test_misaligned_vector_load_intrinsic_is_a_fault(probes, offset, status):
    buf = np.arange(64, dtype=np.uint8)
    base = -buf.ctypes.data % 16  # a 16-byte aligned start inside buf
    view = buf[base:base + 40]
    out = np.zeros(4, np.uint32)
    got, message = probes.launch("probe_misaligned_ldcs", 1, 1, view, ctypes.c_int(offset), out)
    assert got == status, message
    if status == OK:
        assert out.view(np.uint8).tolist() == view[offset:offset + 16].tolist()
    else:
        assert "misaligned __ldcs" in message and "16-byte alignment" in message, message


def test_trap_fails_the_launch_and_stops_it(probes):
    out = np.zeros(4 * 32, np.uint32)
    status, message = probes.launch("probe_trap", 4, 32, out)
    assert status == LAUNCH_FAILED and "__trap()" in message and "block 2,0,0 thread 5,0,0" in message, message
    assert out[:64].all() and not out[96:].any(), "CTAs after the trapping one never run"


@pytest.mark.parametrize("order", [ASCENDING, DESCENDING])
def test_warp_intrinsics(probes, order):
    v = np.array([(i * 37 + 11) % 101 for i in range(64)], np.uint32)
    v[40] = 77
    out = np.zeros(64 * 6, np.uint32)
    assert probes.launch("probe_warp", 1, 64, v, out, order=order) == (OK, "")
    got = out.reshape(64, 6)
    for t in range(64):
        base, lane = t - t % 32, t % 32
        seg = lane - lane % 16
        assert got[t, 0] == v[base + (lane ^ 5)]
        assert got[t, 1] == v[base + 7]
        assert got[t, 2] == (v[base + lane + 3] if lane + 3 < 32 else v[t])
        assert got[t, 3] == (v[base + lane - 2] if lane - 2 >= seg else v[t])
        assert got[t, 4] == sum(1 << i for i in range(32) if v[base + i] & 1)
        assert got[t, 5] == (1 if t >= 32 else 0) | 2


def test_a_warp_intrinsic_some_lanes_never_reach_is_divergence(probes):
    status, message = probes.launch("probe_warp_divergence", 1, 32, np.zeros(32, np.uint32))
    assert status == LAUNCH_FAILED and "warp divergence" in message and "never reached" in message, message


def test_lanes_of_one_mask_in_different_warp_intrinsics_are_divergence(probes):
    status, message = probes.launch("probe_mixed_warp_intrinsics", 1, 32, np.zeros(32, np.uint32))
    assert status == LAUNCH_FAILED and "different warp intrinsics" in message, message


def test_float_conversions_round_to_nearest_even_without_contraction(probes):
    rng = np.random.default_rng(4)
    x = np.concatenate([
        rng.normal(size=2000).astype(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.00390625, 1.01171875, 3.4e38, 1e-40], np.float32),
        (rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32)).view(np.float32),
    ])
    bf, madd = np.zeros(x.size, np.uint16), np.zeros(x.size, np.float32)
    assert probes.launch("probe_float", 1, 128, x, bf, madd, ctypes.c_int(x.size))[0] == OK
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(bf[~nan], want[~nan])
    assert np.isnan(bf[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    with np.errstate(all="ignore"):
        expect = (x * np.float32(3)) + np.float32(1)
    assert np.array_equal(madd.view(np.uint32)[~np.isnan(expect)], expect.view(np.uint32)[~np.isnan(expect)])


def test_integer_intrinsics(probes):
    rng = np.random.default_rng(8)
    pairs = rng.integers(0, 2**64, (300, 2), dtype=np.uint64)
    pairs[0] = (0, 0)
    pairs[1] = (2**64 - 1, 1)
    out = np.zeros(300 * 10, np.uint64)
    assert probes.launch("probe_integer_intrinsics", 1, 64, pairs, out, ctypes.c_int(300))[0] == OK
    M32, M64 = 2**32 - 1, 2**64 - 1
    for (a, b), got in zip(pairs.tolist(), out.reshape(300, 10).tolist()):
        x, y = a & M32, b & M32
        s = (b >> 40) & 31
        v = y << 32 | x
        sel = (a >> 32) & 0x7777
        perm = sum((((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i)) for i in range(4))
        want = [
            bin(x).count("1") | bin(a).count("1") << 32,
            (32 - x.bit_length()) | (64 - a.bit_length()) << 32,
            ((x & -x).bit_length()) | ((a & -a).bit_length()) << 32,
            int(f"{x:032b}"[::-1], 2),
            (x * y) >> 32,
            (a * b) >> 64,
            (((v << s) >> 32) & M32) | ((v >> s) & M32) << 32,
            perm,
            min(a, b),
            max(x, y),
        ]
        assert got == [w & M64 for w in want], (a, b)


def test_atomics_are_exact_read_modify_writes(probes):
    counters = np.array([0, 0, 2**32 - 1, 0], np.uint32)
    total = np.zeros(1, np.uint64)
    assert probes.launch("probe_atomics", 5, 48, counters, total, order=RANDOM, seed=3)[0] == OK
    assert counters.tolist() == [240, 239, 0, 2**32 - 1] and total[0] == 5 * sum(range(48))
