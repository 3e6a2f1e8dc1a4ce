"""The KV row kernels (nvrtc_src/kv_rows.cu) executed on the CPU by the kernel harness,
through CudaBackend and the libcuda stub, against HostBackend's host codecs: every format
and asymmetric pair, block sizes 1/16/32, head_dim 64/128/256/512, float32 and BF16 rows
with a row stride, out-of-order and -1 slots, two CTA orders, NHD and HND blocks
(kernel_harness/kv_checks.py says what each case asserts). One subprocess per case group keeps the suite fast.
"""

from __future__ import annotations

import pytest

from kernel_harness.kv_checks import CASES, kv_case_body
from kernel_harness.stub import run_on_stub


@pytest.mark.parametrize("case", sorted(CASES))
def test_kv_kernels_are_byte_exact_with_the_host_codecs(stub_env, case):
    out = run_on_stub(stub_env, kv_case_body(case), timeout=300)
    assert "CHECK kv ok" in out
