"""The pagedkv kernels executed on the CPU by the kernel harness, through CudaBackend and
the libcuda stub, against HostBackend (tests/kernel_harness/checks.py says what each
check asserts): at 2 SMs (grid-stride loops wrap) and at the H200's 132, each under two
CTA orders. The harness has no memory model, no concurrency between CTAs and no timing:
these tests prove what the kernels compute, not how they behave on a GPU.
"""

from __future__ import annotations

import pytest

from kernel_harness.checks import CHECKS, check_body
from kernel_harness.stub import run_on_stub


@pytest.mark.parametrize("sms", [2, 132])
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_matches_host_backend(stub_env, check, sms):
    out = run_on_stub(stub_env, check_body(check, sms))
    assert f"CHECK {check} ok" in out


def test_kernel_parameters_match_the_ctypes_structures(stub_env):
    """Every launcher's ctypes argument structure has the kernel's C++ parameter sizes, in
    order (the stub takes them from the harness's signature of each kernel)."""
    run_on_stub(stub_env, '''
        from pagedkv.driver import backend, launch
        STUB.stub_kernel_params.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        checked = 0
        for filename, kernels in backend.KERNELS.items():
            for name, args_type, *_ in kernels:
                sizes = (ctypes.c_int * 32)()
                n = STUB.stub_kernel_params(name.encode(), sizes, 32)
                assert n >= 0, f"no harness kernel {name}"
                want = [ctypes.sizeof(t) for _, t in args_type._fields_]
                assert list(sizes[:n]) == want, (name, list(sizes[:n]), want)
                checked += 1
        assert checked == 4, checked
    ''')
