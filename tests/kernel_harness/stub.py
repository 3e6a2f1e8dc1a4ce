"""Build and run the libcuda stub with the kernel harness, for tests that drive
CudaBackend in a subprocess (this pytest process never loads a libcuda).

`make_stub_env(out, kernel_cache)` builds the stub and the kernel libraries of
pagedkv/nvrtc_src into `out` and returns the environment of a subprocess that loads
them; `run_on_stub(env, body)` runs PRELUDE + body there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from . import build as harness_build
from . import zygote

STUB_SOURCE = Path(__file__).resolve().parent.parent / "stub_libcuda" / "stub_libcuda.c"
REPO_ROOT = Path(__file__).resolve().parent.parent.parent

PRELUDE = '''
import ctypes, struct, sys, threading
import numpy as np
STUB = ctypes.CDLL("libcuda.so.1")  # the same handle cuda-bindings will resolve
STUB.stub_call_count.restype = ctypes.c_long
STUB.stub_launch_count.restype = ctypes.c_long
STUB.stub_set_total_mem.argtypes = [ctypes.c_size_t]

class LaunchRecord(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 48), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_uint64), ("nparams", ctypes.c_int),
                ("sizes", ctypes.c_int * 8), ("params", (ctypes.c_uint8 * 8) * 8)]

def calls(name):
    return STUB.stub_call_count(name.encode())

def launch(i):
    """Launch record i (negative counts from the last) as (record, [param bytes...])."""
    if i < 0:
        i += STUB.stub_launch_count()
    rec = LaunchRecord()
    assert STUB.stub_launch_get(ctypes.c_long(i), ctypes.byref(rec)) == 0, i
    return rec, [bytes(rec.params[k])[: rec.sizes[k]] for k in range(rec.nparams)]

def u64(b): return struct.unpack("<Q", b)[0]
def i64(b): return struct.unpack("<q", b)[0]
def i32(b): return struct.unpack("<i", b)[0]
def u32(b): return struct.unpack("<I", b)[0]

def int32_at(address, n):
    """n int32 values at a stub 'device' address (stub device memory is host memory)."""
    return np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(address)).tolist()

def int64_at(address, n):
    return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(address)).tolist()

def raw_kernel(filename, name):
    """(module, function) of kernel `name`, loaded straight from the NVRTC kernel cache into
    the current context (a CudaBackend must be open), bypassing the backend's launchers."""
    from cuda.bindings import driver as D
    from pagedkv.driver import nvrtc
    err, module = D.cuModuleLoadData(nvrtc.compile_cached(nvrtc.SOURCE_DIR / filename, "sm_90").cubin)
    assert err == 0, err
    err, function = D.cuModuleGetFunction(module, name.encode())
    assert err == 0, err
    return module, function

def raw_launch(function, grid, block, stream, *args):
    """cuLaunchKernel of `function` with `args` (ctypes values, in order); the CUresult as an int."""
    from cuda.bindings import driver as D
    pointers = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    return int(D.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(pointers), 0)[0])
'''


def build_stub(out: Path) -> Path:
    """Compile the stub into `out`/libcuda.so.1 (skips the test when there is no C compiler)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine to build the libcuda stub")
    out.mkdir(parents=True, exist_ok=True)
    lib = out / "libcuda.so.1"
    build = subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wl,-soname,libcuda.so.1",
         "-o", str(lib), str(STUB_SOURCE), "-lpthread", "-ldl"],
        capture_output=True, text=True,
    )
    if build.returncode != 0:
        pytest.fail(f"building the libcuda stub with {cc} failed:\n{build.stderr}")
    return lib


def build_harness(sources, out: Path, quick: bool = False) -> list[Path]:
    """The kernel harness libraries of `sources` in `out` (skips when there is no g++);
    `quick` builds them unoptimised (kernel_harness.build.build_kernel_library)."""
    if harness_build.compiler() is None:
        pytest.skip("no C++ compiler on this machine to build the kernel harness")
    return harness_build.build_kernel_libraries(sources, out, quick=quick)


def with_libraries(env: dict, libs) -> dict:
    """A copy of `env` whose stub runs the kernels of `libs`."""
    env = dict(env)
    env[harness_build.HARNESS_ENV] = os.pathsep.join(str(p) for p in libs)
    return env


def make_stub_env(out: Path, kernel_cache: Path | None = None) -> dict:
    """Build the stub and pagedkv's kernel libraries into `out`; the subprocess environment
    (CTA order and SM count left at the stub's defaults, the NVRTC kernel cache filled).
    `kernel_cache` defaults to the one every test process shares (shared_cache.py)."""
    build_stub(out)
    from pagedkv.driver import nvrtc

    env = with_libraries(dict(os.environ), build_harness(nvrtc.kernel_sources(), out / "kernels"))
    env.pop(harness_build.ORDER_ENV, None)
    env.pop(harness_build.SMS_ENV, None)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(out), env.get("LD_LIBRARY_PATH")]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if kernel_cache is None:
        # the shared cache, filled here (each source compiled once per machine), so each
        # test's driver calls over the stub are its own
        from .shared_cache import compiled, kernel_cache_dir

        for path in nvrtc.kernel_sources():
            compiled(path, "sm_90")
        env["PAGEDKV_KERNEL_CACHE"] = str(kernel_cache_dir())
        return env
    env["PAGEDKV_KERNEL_CACHE"] = str(kernel_cache)
    # fill the kernel cache once, so each test's driver calls are its own (NVRTC itself
    # loads libcuda and calls cuInit when it compiles)
    subprocess.run(
        [sys.executable, "-c", "from pagedkv.driver import nvrtc\n"
         "for p in nvrtc.kernel_sources(): nvrtc.compile_cached(p, 'sm_90')"],
        env=env, check=True, capture_output=True, timeout=600,
    )
    return env


def run_on_stub(env: dict, body: str, timeout: float = 120) -> str:
    """Run PRELUDE + `body` in a fresh interpreter over the stub; fail with its output."""
    proc = run_on_stub_unchecked(env, body, timeout)
    if proc.returncode != 0:
        pytest.fail(f"stub subprocess failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def run_on_stub_unchecked(env: dict, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run PRELUDE + `body` over the stub and return the finished process, whatever its status."""
    script = PRELUDE + textwrap.dedent(body)
    forked = zygote.run(env, script, timeout)  # the same child, forked with numpy imported
    if forked is not None:
        return forked
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
