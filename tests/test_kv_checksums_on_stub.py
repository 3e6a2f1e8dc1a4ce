"""The exact every-format checksum kernels (pagedkv_kv_checksum_* in nvrtc_src/kv_rows.cu)
executed on the CPU by the kernel harness, through CudaBackend and the libcuda stub: the
diagnostics events on CudaBackend (device reduction) equal HostBackend's (host decode)
and math.fsum over the host decode, for every format and asymmetric pair, block sizes
1/16/32, head_dim 48/64/128/256/512, encoded rows, garbage bytes and NaN/inf inputs, two
CTA orders, at 2 and 132 SMs (kernel_harness/kv_checksum_checks.py says what each case
holds); and the checksum calls never copy pool bytes to the host.
"""

from __future__ import annotations

import pytest

from kernel_harness.kv_checksum_checks import CASES, checksum_case_body
from kernel_harness.stub import run_on_stub


@pytest.mark.parametrize("sms", [2, 132])
@pytest.mark.parametrize("case", sorted(CASES))
def test_device_checksums_equal_host_checksums_and_fsum(stub_env, case, sms):
    out = run_on_stub(stub_env, checksum_case_body(case, sms), timeout=300)
    assert "CHECK checksum ok" in out
