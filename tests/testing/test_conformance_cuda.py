"""CudaBackend against the conformance suite: over the libcuda stub with the kernels
executing in the CPU harness (tests/kernel_harness) on every machine, and on a real GPU
where there is one (the `cuda` marker)."""

import pytest
from kernel_harness.stub import run_on_stub

from pagedkv.testing import RULES


def _unstated_host_tier_rules() -> list[str]:
    """The "host_tier" rules, skipped while CudaBackend does not state the capability."""
    from pagedkv.driver import CudaBackend

    return [] if "host_tier" in CudaBackend.SUPPORTED else [r.name for r in RULES if "host_tier" in r.requires]


def test_cuda_backend_passes_the_conformance_suite_over_the_stub(stub_env):
    out = run_on_stub(stub_env, '''
        STUB.stub_set_total_mem(ctypes.c_size_t(1 << 30))
        from pagedkv.driver import CudaBackend
        from pagedkv.testing import backend_conformance
        with CudaBackend() as gpu:
            report = backend_conformance(lambda: gpu)
            print(report.summary())
            print([r.name for r in report.skipped])
            assert gpu.live_allocations() == 0
        assert STUB.stub_live_streams() == 0 and STUB.stub_live_host_allocations() == 0
    ''', timeout=300)
    *_, total, skipped = out.splitlines()
    skips = ["host_view", "cpu_addresses_are_host_memory"] + _unstated_host_tier_rules()
    assert total == f"CudaBackend: {len(RULES) - len(skips)} passed, 0 failed, {len(skips)} skipped", out
    assert skipped == repr(skips)


@pytest.mark.cuda
def test_cuda_backend_passes_the_conformance_suite(cuda_session):
    from pagedkv.testing import backend_conformance

    report = backend_conformance(lambda: cuda_session)
    assert report.ok, report.summary()
    assert [r.name for r in report.skipped] == ["host_view", "cpu_addresses_are_host_memory"] + _unstated_host_tier_rules()
