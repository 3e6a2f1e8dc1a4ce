"""The traffic model of the kernel harness (kernel_harness/traffic.py, model.inc, ptxas.py):
on probe kernels with known access patterns, each warp-level figure is exact; then the
floors of issue 19 on every hot kernel of pagedkv, measured on the model's workloads (a
decode-sized write/read per format, a prefill write of two layers, checksums of every
format, fill, copy and the copy_batch kernel).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from kernel_harness import ptxas, traffic
from kernel_harness.build import HERE, build_kernel_libraries, compiler
from kernel_harness.direct import Harness


@pytest.fixture(scope="module")
def model_probes(tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C++ compiler on this machine to build the kernel harness")
    out = tmp_path_factory.mktemp("model_probes")
    (lib,) = build_kernel_libraries([HERE / "model_probes.cu"], out, defines=lambda p: (), model=True)
    return Harness(lib), out


def aligned(values) -> np.ndarray:
    """A copy of `values` starting on a 256-byte boundary (as stub allocations do)."""
    values = np.asarray(values)
    raw = np.zeros(values.nbytes + 256, np.uint8)
    start = -raw.ctypes.data % 256
    out = raw[start:start + values.nbytes].view(values.dtype)
    out[...] = values.ravel()
    return out


def trace_of(model_probes, name, grid, block, *args) -> traffic.KernelRun:
    harness, out = model_probes
    trace = out / f"{name}.jsonl"
    trace.unlink(missing_ok=True)
    os.environ[traffic.MODEL_ENV] = str(trace)
    try:
        status, message = harness.launch(name, grid, block, *args)
    finally:
        del os.environ[traffic.MODEL_ENV]
    assert status == 0, message
    (run,) = traffic.parse_trace(trace, archs=()).runs
    return run


def site(run, line_text, kind):
    """The site of `run` on the model_probes.cu line containing `line_text`."""
    lines = (HERE / "model_probes.cu").read_text().splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if line_text in line]
    (s,) = [s for s in run.sites.values() if s.location == f"model_probes.cu:{number}" and s.kind == kind]
    return s


def test_coalesced_16_byte_accesses_are_16_sectors_at_full_efficiency(model_probes):
    src, dst = aligned(np.arange(4 * 256, dtype=np.uint32)), aligned(np.zeros(4 * 256, np.uint32))
    run = trace_of(model_probes, "probe_coalesced16", 2, 128, src, dst)
    for kind in ("load", "store"):
        s = site(run, "out[i] = in[i];", kind)
        assert (s.requests, s.lanes, s.bytes) == (8, 256, 4096)
        assert s.bytes_per_lane == 16.0 and s.sectors_per_request == 16.0 and s.efficiency == 1.0
        assert not s.is_uniform
    assert (dst == src).all()
    assert run.in_flight_per_thread() == 16.0


@pytest.mark.parametrize("stride, sectors", [(1, 4), (2, 8), (8, 32)])
def test_strided_loads_touch_more_sectors(model_probes, stride, sectors):
    src, dst = aligned(np.arange(32 * 8, dtype=np.uint32)), aligned(np.zeros(32, np.uint32))
    run = trace_of(model_probes, "probe_strided", 1, 32, src, dst, ctypes.c_int(stride))
    load = site(run, "out[i] = in[i * stride];", "load")
    assert load.sectors_per_request == sectors and load.efficiency == 1 / stride
    assert load.bytes_per_lane == 4.0
    assert (dst == src[:: stride][:32]).all()


def test_a_broadcast_is_uniform_and_not_a_main_loop_site(model_probes):
    src, dst = np.arange(8, dtype=np.uint32), np.zeros(64, np.uint32)
    run = trace_of(model_probes, "probe_uniform", 1, 64, src, dst)
    load = site(run, "out[threadIdx.x] = in[3];", "load")
    assert load.is_uniform and load.uniform == load.requests == 2 and load.sectors_per_request == 1.0
    assert [s.kind for s in run.hot_sites()] == ["store"]


@pytest.mark.parametrize("stride, ways", [(1, 1), (2, 2), (4, 4), (32, 32), (33, 1)])
def test_shared_bank_conflicts(model_probes, stride, ways):
    out = np.zeros(32, np.uint32)
    run = trace_of(model_probes, "probe_bank", 1, 32, out, ctypes.c_int(stride))
    assert site(run, "s[threadIdx.x * stride] = threadIdx.x;", "store").bank_ways == ways
    assert site(run, "out[threadIdx.x] = s[threadIdx.x * stride];", "load").bank_ways == ways
    assert (out == np.arange(32)).all()


@pytest.mark.parametrize("ways", [1, 4, 8])
def test_divergent_constant_reads(model_probes, ways):
    out = np.zeros(32, np.uint32)
    run = trace_of(model_probes, "probe_constant", 1, 32, out, ctypes.c_int(ways))
    assert site(run, "PROBE_TABLE[threadIdx.x % ways]", "load").constant_ways == ways
    assert (out == np.arange(32) % ways + 1).all()


def test_shared_atomics_on_one_word_serialise(model_probes):
    out = np.zeros(32, np.uint32)
    run = trace_of(model_probes, "probe_shared_atomic", 1, 32, out, ctypes.c_int(1))
    s = site(run, "atomicAdd(&c[word], 1u);", "atomic")
    assert s.space == "shared" and s.bank_ways == 32 and s.requests == 1
    assert (out == 32).all()


def test_a_batch_of_loads_before_the_stores_is_in_flight_together(model_probes):
    src, dst = aligned(np.arange(4 * 512, dtype=np.uint32)), aligned(np.zeros(4 * 512, np.uint32))
    run = trace_of(model_probes, "probe_batched", 1, 32, src, dst, ctypes.c_int(512))
    assert run.in_flight_per_thread() == 64.0
    assert (dst == src).all()


def test_ptxas_report_is_parsed_per_kernel():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_a' for 'sm_90'
ptxas info    : Function properties for k_a
ptxas         .     368 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 368 bytes cumulative stack size, 38912 bytes smem
ptxas info    : Compiling entry function 'k_b' for 'sm_90'
ptxas info    : Function properties for k_b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 28 registers, used 0 barriers
"""
    facts = ptxas.parse_ptxas_log(log)
    assert facts["k_a"] == ptxas.KernelFacts("k_a", "sm_90", 80, 368, 8, 4, 38912, 1)
    assert facts["k_b"] == ptxas.KernelFacts("k_b", "sm_90", 28, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("regs, shared, threads, ctas", [
    (28, 0, 256, 8),          # thread limit: 2048 / 256
    (72, 0, 256, 3),          # 72 regs -> 2304 a warp, 18432 a CTA: 3 CTAs in 65536
    (80, 38912, 256, 3),      # registers still bind (shared allows 5)
    (32, 49152, 128, 4),      # shared: (48 + 1) KiB a CTA, 4 in 228 KiB
    (255, 0, 1024, 0),        # 255 x 1024 registers do not fit
])
def test_occupancy_from_registers_shared_memory_and_threads(regs, shared, threads, ctas):
    facts = ptxas.KernelFacts("k", "sm_90", regs, 0, 0, 0, shared, 1)
    assert ptxas.occupancy(facts, threads) == ctas


def test_ptxas_facts_of_a_kernel_source_come_from_nvrtc():
    facts = ptxas.ptxas_facts(traffic.KERNEL_DIR / "fill_blocks.cu", "sm_90")
    fill = facts["pagedkv_fill_blocks"]
    assert fill.arch == "sm_90" and fill.registers > 0 and fill.stack_frame == 0 and fill.spill_stores == 0
