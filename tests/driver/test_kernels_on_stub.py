"""The pagedkv kernels executed on the CPU by the kernel harness, through CudaBackend and
the libcuda stub, against HostBackend (tests/kernel_harness/checks.py says what each
check asserts): at 2 SMs (grid-stride loops wrap) and at the H200's 132, each under two
CTA orders. The harness has no memory model, no concurrency between CTAs and no timing:
these tests prove what the kernels compute, not how they behave on a GPU.
"""

from __future__ import annotations

import os

import pytest

from kernel_harness.build import HARNESS_ENV, HERE
from kernel_harness.checks import CHECKS, check_body
from kernel_harness.stub import build_harness, run_on_stub, with_libraries


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
        assert checked == 18, checked
    ''')


def test_arguments_packed_for_other_types_are_refused(stub_env):
    """A launcher whose ctypes structure does not match the kernel's C++ parameters (a
    4-byte field where the kernel takes a pointer, so the next field sits 4 bytes on, and
    an 8-byte parameter at a 4-byte offset) is refused at cuLaunchKernel, launching nothing."""
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend, CudaError
        from pagedkv.driver.launch import KernelLauncher

        class Narrow(ctypes.Structure):
            _fields_ = [("table", ctypes.c_uint32), ("num_rows", ctypes.c_int32), ("blocks", ctypes.c_uint64),
                        ("num_blocks", ctypes.c_int32), ("value", ctypes.c_uint32)]

        class Packed(ctypes.Structure):
            _pack_ = 4
            _fields_ = [("num_rows", ctypes.c_int32), ("table", ctypes.c_uint64), ("blocks", ctypes.c_uint64),
                        ("num_blocks", ctypes.c_int32), ("value", ctypes.c_uint32)]

        with CudaBackend() as gpu:
            module, function = raw_kernel("fill_blocks.cu", "pagedkv_fill_blocks")
            for wrong in (Narrow, Packed):
                before = STUB.stub_launch_count()
                launcher = KernelLauncher("pagedkv_fill_blocks", function, wrong, 32)
                if wrong is Packed:  # fields in the kernel's order, at 4-byte alignment
                    launcher.pointers[0], launcher.pointers[1] = launcher.pointers[1], launcher.pointers[0]
                try:
                    launcher.launch(1, 0, table=0, num_rows=0, blocks=0, num_blocks=0, value=0)
                except CudaError as err:
                    assert err.status == 1, err
                else:
                    raise AssertionError(wrong.__name__)
                assert STUB.stub_launch_count() == before and STUB.stub_pending_work() == 0
            from cuda.bindings import driver as D
            assert D.cuModuleUnload(module)[0] == 0
    ''')


def test_sm_count_comes_from_the_environment(stub_env):
    run_on_stub(dict(stub_env, PAGEDKV_STUB_SMS="132"), '''
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            assert gpu.sm_count == 132
        p = ctypes.c_void_p()
        assert STUB.cuGetProcAddress_v2(b"cuGetExportTable", ctypes.byref(p), 13000, ctypes.c_uint64(0), None) == 0 and p.value
        assert STUB.cuGetProcAddress_v2(b"cuNoSuchCall", ctypes.byref(p), 13000, ctypes.c_uint64(0), None) == 500
        assert STUB.cuGetProcAddress_v2(b"stub_launch_count", ctypes.byref(p), 13000, ctypes.c_uint64(0), None) == 500
    ''')


def test_a_launch_past_the_kernels_launch_bounds_is_refused(stub_env, tmp_path):
    """The stub takes each kernel's thread limit from its __launch_bounds__ (evaluated in
    the harness build, macros resolved) and refuses a bigger CTA as the driver does. The
    probe kernel is loaded from a minimal ELF image naming it, as a CUBIN would."""
    (probes,) = build_harness([HERE / "probes.cu"], tmp_path)
    env = with_libraries(stub_env, [*stub_env[HARNESS_ENV].split(os.pathsep), probes])
    run_on_stub(env, '''
        from cuda.bindings import driver as D
        from pagedkv.driver import CudaBackend
        names = b"probe_bounded\\0"
        header = bytearray(64)
        header[:5] = b"\\x7fELF\\x02"
        header[0x28:0x30] = (64 + len(names)).to_bytes(8, "little")  # e_shoff: the image's end
        with CudaBackend() as gpu:
            err, module = D.cuModuleLoadData(bytes(header) + names)
            assert err == 0, err
            err, function = D.cuModuleGetFunction(module, b"probe_bounded")
            assert err == 0, err
            out = gpu.alloc(4 * 128)
            arg = ctypes.c_uint64(int(out))
            params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
            for threads, status in ((128, 1), (65, 1), (64, 0)):
                got = D.cuLaunchKernel(function, 1, 1, 1, threads, 1, 1, 0, 0, ctypes.addressof(params), 0)[0]
                assert int(got) == status, (threads, got)
            gpu.synchronize(0)
            back = np.zeros(128, np.uint32)
            gpu.copy_d2h(out, back)
            assert back[:64].tolist() == [64] * 64
            gpu.free(out)
            assert D.cuModuleUnload(module)[0] == 0
    ''')
