"""The conformance suite itself: each rule fails, with a reason, on a backend that breaks
the point it covers (a HostBackend with one planted defect), the report and the pytest
entry say so, and pagedkv.testing imports without pytest."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pagedkv import DevicePtr, HostBackend
from pagedkv.errors import DeviceMemoryError
from pagedkv.testing import RULES, ConformanceReport, backend_conformance, conformance_tests


class ClaimsPinned(HostBackend):
    def supports(self, name):
        return name == "pinned" or super().supports(name)


class TwoDeviceKinds(HostBackend):
    def supports(self, name):
        return name == "device:cuda" or super().supports(name)


class FakeAddressesNoView(HostBackend):
    """Claims device:cpu addresses without host_view: its addresses are not host memory."""

    def supports(self, name):
        return name != "host_view" and super().supports(name)


class Misaligned(HostBackend):
    def alloc(self, nbytes):
        return super().alloc(nbytes + 16).offset(16)

    def free(self, ptr):
        super().free(ptr.offset(-16))


class SilentDoubleFree(HostBackend):
    def free(self, ptr):
        try:
            super().free(ptr)
        except DeviceMemoryError:
            pass


class PlainMemoryError(HostBackend):
    def alloc(self, nbytes):
        if nbytes > self.mem_info()[0]:
            raise MemoryError("out of memory")
        return super().alloc(nbytes)


class LeaksOnOom(HostBackend):
    def alloc(self, nbytes):
        if nbytes > self.mem_info()[0]:
            self._used += 4096
        return super().alloc(nbytes)


class FillsTheGap(HostBackend):
    """Fills whole strides, not nbytes."""

    def fill_blocks(self, regions, blocks, value, stream):
        for base, stride in zip(regions.bases.tolist(), regions.strides.tolist()):
            for b in blocks:
                self.memset_async(DevicePtr(base + b * stride), value, stride, stream)


class DropsLastPair(HostBackend):
    def copy_blocks(self, regions, src, dst, stream):
        super().copy_blocks(regions, list(src)[:-1], list(dst)[:-1], stream)


class Float32Sums(HostBackend):
    def reduce_bf16_blocks(self, regions, region, blocks, stream):
        exact = super().reduce_bf16_blocks(regions, region, blocks, stream)
        return type(exact)(*(float(np.float32(x)) for x in exact))


class ReducesRowZero(HostBackend):
    def reduce_bf16_blocks(self, regions, region, blocks, stream):
        return super().reduce_bf16_blocks(regions, 0, blocks, stream)


class RefusesEmptyMemset(HostBackend):
    def memset_async(self, ptr, value, nbytes, stream):
        if nbytes == 0:
            raise ValueError("nothing to set")
        super().memset_async(ptr, value, nbytes, stream)


class DestroysDefaultStream(HostBackend):
    def destroy_stream(self, stream):
        if stream != 0:
            super().destroy_stream(stream)


class MemsetsRunAtSynchronize(HostBackend):
    """Queues memsets until synchronize but copies at once: work out of stream order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queued = []

    def memset_async(self, ptr, value, nbytes, stream):
        self.queued.append((ptr, value, nbytes, stream))

    def synchronize(self, stream):
        for args in self.queued:
            super().memset_async(*args)
        self.queued = []


class WritesBeforeBoundsCheck(HostBackend):
    def fill_blocks(self, regions, blocks, value, stream):
        super().fill_blocks(regions, [b for b in blocks if b == 0], value, stream)
        super().fill_blocks(regions, blocks, value, stream)


class CopiesBlocksBackwards(HostBackend):
    def copy_blocks(self, regions, src, dst, stream):
        super().copy_blocks(regions, dst, src, stream)


class CopiesOnlyWholeStrideRows(HostBackend):
    """copy_blocks that skips region rows narrower than their stride (state slot rows are)."""

    def copy_blocks(self, regions, src, dst, stream):
        from pagedkv.backends.protocol import BlockRegions

        rows = [(int(b), int(st), int(n)) for b, st, n in zip(regions.bases, regions.strides, regions.nbytes) if n == st]
        super().copy_blocks(BlockRegions.from_rows(rows), src, dst, stream)


PLANTED = [
    (FakeAddressesNoView, "cpu_addresses_are_host_memory", "+ 300 bytes is not readable host memory of this process"),
    (ClaimsPinned, "capabilities_consistent", "states 'pinned' but has no alloc_pinned, copy_h2d_async, copy_d2h_async"),
    (TwoDeviceKinds, "capabilities_consistent", "more than one device kind: ['device:cpu', 'device:cuda']"),
    (Misaligned, "alloc_sizes_and_alignment", "not 256-byte aligned"),
    (SilentDoubleFree, "free_refuses_double_unknown_and_interior", "a double free: returned"),
    (PlainMemoryError, "out_of_memory", "raised MemoryError"),
    (LeaksOnOom, "out_of_memory", "after a failed alloc"),
    (FillsTheGap, "fill_blocks_matches_host", "region 1: 48 byte(s) differ, first at offset 176"),
    (DropsLastPair, "copy_blocks_matches_host", "byte(s) differ"),
    (Float32Sums, "reduce_bf16_exact", "math.fsum gives"),
    (ReducesRowZero, "reduce_bf16_exact", "math.fsum gives"),
    (RefusesEmptyMemset, "zero_length_ranges", "raised ValueError: nothing to set"),
    (DestroysDefaultStream, "stream_lifecycle", "destroy of the default stream: returned"),
    (MemsetsRunAtSynchronize, "stream_order", "after six ordered calls"),
    (WritesBeforeBoundsCheck, "block_calls_refuse_bad_arguments", "after refused block calls"),
    (CopiesBlocksBackwards, "cache_core", "zero, poison, init and copy"),
    (CopiesOnlyWholeStrideRows, "hybrid_state_slots", "copy_state, poison and init: state slot 2 tensor 1"),
]


@pytest.mark.parametrize("backend, rule, reason", PLANTED, ids=[p[0].__name__ for p in PLANTED])
def test_a_planted_defect_fails_its_rule_with_the_reason(backend, rule, reason):
    report = backend_conformance(lambda: backend(capacity_bytes=1 << 26), only=[rule])
    assert not report.ok
    assert report[rule].status == "failed"
    assert reason in report[rule].reason, report[rule].reason


def test_the_clean_host_backend_passes_every_rule():
    report = backend_conformance(lambda: HostBackend(capacity_bytes=1 << 26))
    assert [r.name for r in report.results] == [r.name for r in RULES]
    assert report.failed == [] and report.ok
    assert [(r.name, r.reason) for r in report.skipped] == [
        ("stream_wait", "the backend does not support 'stream_wait'"),
        ("cpu_addresses_are_host_memory", "the backend states 'host_view': its addresses need not be host addresses"),
        ("copies_pinned", "the backend does not support 'pinned'"),
    ]
    assert report.backend == "HostBackend"
    passed = len(RULES) - 3
    assert report.summary().splitlines()[-1] == f"HostBackend: {passed} passed, 0 failed, 3 skipped"


def test_rules_cover_every_point_of_the_protocol():
    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)
    groups = [r.group for r in RULES]
    assert groups == sorted(groups, key=["protocol", "cache"].index), "protocol rules run first"
    assert {"cache_core", "cache_tokens", "cache_sequences", "cache_prefix"} <= set(names)
    assert all(r.doc for r in RULES)


def test_report_skip_only_and_unknown_names():
    report = backend_conformance(lambda: HostBackend(capacity_bytes=1 << 26), only=["memset", "mem_info"],
                                 skip={"mem_info": "not today"})
    assert isinstance(report, ConformanceReport) and report.ok
    assert [(r.name, r.status, r.reason) for r in report.results] == [
        ("mem_info", "skipped", "not today"), ("memset", "passed", "")]
    with pytest.raises(KeyError, match="no conformance rule named 'nope'"):
        report["nope"]
    with pytest.raises(ValueError, match="unknown conformance rule 'nope'"):
        backend_conformance(HostBackend, only=["nope"])
    with pytest.raises(ValueError, match="unknown conformance rule 'memsett'"):
        conformance_tests(HostBackend, skip={"memsett": "typo"})


def test_a_rule_that_leaks_fails_and_a_factory_that_raises_fails():
    class NeverFrees4096Bytes(HostBackend):
        def free(self, ptr):
            if self.view(ptr, 0).base.nbytes != 4096:
                super().free(ptr)

    report = backend_conformance(lambda: NeverFrees4096Bytes(capacity_bytes=1 << 26), only=["copies_pageable"])
    assert report["copies_pageable"].reason == (
        "free bytes " + " -> ".join(str((1 << 26) - 8192 * i) for i in range(6)) + " over 5 runs: memory not given back")

    class KeepsAStagingBuffer(HostBackend):
        def fill_blocks(self, regions, blocks, value, stream):
            if not hasattr(self, "staging"):
                self.staging = self.alloc(1 << 16)
            super().fill_blocks(regions, blocks, value, stream)

    assert backend_conformance(lambda: KeepsAStagingBuffer(capacity_bytes=1 << 26), only=["fill_blocks_matches_host"]).ok

    def broken():
        raise RuntimeError("no device")

    report = backend_conformance(broken, only=["memset"])
    assert report["memset"].reason == "the factory raised RuntimeError: no device"


def test_pytest_entry_fails_skips_and_passes():
    tests = conformance_tests(lambda: Float32Sums(capacity_bytes=1 << 26), only=["reduce_bf16_exact", "copies_pinned", "memset"])
    assert sorted(tests) == ["test_conformance_copies_pinned", "test_conformance_memset", "test_conformance_reduce_bf16_exact"]
    tests["test_conformance_memset"]()
    with pytest.raises(pytest.skip.Exception, match="does not support 'pinned'"):
        tests["test_conformance_copies_pinned"]()
    with pytest.raises(pytest.fail.Exception, match="reduce_bf16_exact: .*math.fsum gives"):
        tests["test_conformance_reduce_bf16_exact"]()


def test_importable_and_runnable_without_pytest():
    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "from pagedkv import HostBackend\n"
        "from pagedkv.testing import backend_conformance, conformance_tests\n"
        "tests = conformance_tests(HostBackend)\n"
        "report = backend_conformance(lambda: HostBackend(1 << 26), only=['memset', 'cache_core'])\n"
        "import pagedkv.backends, pagedkv.backends.per_range\n"
        "print(report.ok, len(tests), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == f"True {len(RULES)} False\n" and out.stderr == ""
