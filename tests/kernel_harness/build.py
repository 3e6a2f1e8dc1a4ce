"""Build the kernel harness: one shared library per kernel source, for the libcuda stub.

`build_kernel_libraries(sources, out_dir)` compiles each `.cu` file unchanged as C++20
with g++ (the shim header force-included, the source's NVRTC `-D` options, no FP
contraction, SSE2 float math, every access alignment-checked) together with a generated
registration table of its `extern "C" __global__` kernels and the fiber runtime. The
stub finds the libraries through `HARNESS_ENV` (paths joined by os.pathsep). Each library
is built once per machine and kept in the shared test cache (shared_cache.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Sequence

HERE = Path(__file__).resolve().parent
HARNESS_ENV = "PAGEDKV_HARNESS_LIBS"
"""Environment variable the stub reads: the kernel libraries to resolve kernels in."""

ORDER_ENV = "PAGEDKV_HARNESS_ORDER"
"""Environment variable the stub reads: CTA order `ascending`, `descending` or `random:SEED`."""

SMS_ENV = "PAGEDKV_STUB_SMS"
"""Environment variable the stub reads: its MULTIPROCESSOR_COUNT (default 4)."""

CXX_FLAGS = (
    "-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-unused-function",
    "-ffp-contract=off", "-fno-fast-math", "-msse2", "-mfpmath=sse",
)
KERNEL_FLAGS = ("-fsanitize=alignment", "-fno-sanitize-recover=alignment")
MODEL_FLAGS = (
    "-DPKV_MODEL", "-gdwarf-4", "-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0",
    "--param", "asan-stack=0", "--param", "asan-globals=0",
    # accesses as the source writes them: no vectorised or merged loads and stores
    "-fno-tree-vectorize", "-fno-tree-slp-vectorize", "-fno-store-merging", "-fno-tree-sra",
)
"""Extra flags of a traffic-model build (traffic.py): every load and store of kernel code
calls a hook of model.inc with its address and size."""

_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\(([^),]*)[^)]*\)\s*)?([A-Za-z_]\w*)\s*\('
)


class HarnessBuildError(RuntimeError):
    """g++ refused a kernel source or the runtime; the message holds its output."""


def kernel_names(source: str) -> list[str]:
    """The `extern "C" __global__` function names declared in a kernel source, in order."""
    return [name for _, name in _KERNEL.findall(source)]


def kernel_bounds(source: str) -> list[tuple[str, str]]:
    """(name, first `__launch_bounds__` argument as written, or "0") of each kernel."""
    return [(name, bound.strip() or "0") for bound, name in _KERNEL.findall(source)]


def compiler() -> str | None:
    """The C++ compiler to build with ($CXX, else g++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def source_defines(path: Path) -> tuple[str, ...]:
    """The `-DNAME=VALUE` options the driver passes NVRTC for this source (none when the
    driver does not say: `pagedkv.driver.nvrtc.source_defines` is optional)."""
    from pagedkv.driver import nvrtc

    get = getattr(nvrtc, "source_defines", None)
    return tuple(get(path.name)) if get is not None else ()


def _run(cmd: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        raise HarnessBuildError(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


_RUNTIMES: dict[str, Path] = {}
_VERSIONS: dict[str, str] = {}

HARNESS_FILES = ("runtime.cc", "harness.h", "cuda_shim.h", "model.inc")
"""The harness' own sources: part of every library's cache key."""


def build_runtime(out_dir: Path, cxx: str, model: bool = False) -> Path:
    """runtime.o (model_runtime.o with the traffic model's hooks) in `out_dir`, compiled
    once per process and compiler (later calls reuse the first object while it exists)."""
    key = f"{cxx}:{model}"
    obj = _RUNTIMES.get(key)
    if obj is not None and obj.exists():
        return obj
    obj = out_dir / ("model_runtime.o" if model else "runtime.o")
    extra = ("-DPKV_MODEL",) if model else ()
    _run([cxx, *CXX_FLAGS, *extra, "-I", str(HERE), "-c", "-o", str(obj), str(HERE / "runtime.cc")])
    _RUNTIMES[key] = obj
    return obj


def _compiler_version(cxx: str) -> str:
    if cxx not in _VERSIONS:
        _VERSIONS[cxx] = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return _VERSIONS[cxx]


def _registration_unit(source: Path, names: list[tuple[str, str]]) -> str:
    return (
        f'#include "{source}"\n#include "harness.h"\n'
        'extern "C" const PkvKernel pkv_kernel_table[] = {\n'
        + "".join(f"    PKV_KERNEL({n}, {bound}),\n" for n, bound in names)
        + "};\n"
        f'extern "C" const int pkv_kernel_table_size = {len(names)};\n'
    )


def build_kernel_library(source: Path, out_dir: Path, cxx: str, runtime, defines: Iterable[str] = (),
                         model: bool = False, quick: bool = False) -> Path:
    """lib<stem>.so for one kernel source (lib<stem>_model.so, instrumented for the
    traffic model, when `model`) in `out_dir`; `runtime()` gives the runtime object to link.
    `quick` compiles without optimisation (-O0: a third of the compile time, the same IEEE
    arithmetic under the flags of CXX_FLAGS), for libraries built once and run once, such
    as the planted-bug builds of the mutation tests.
    Built once per machine: the library is kept in the shared test cache (shared_cache.py),
    keyed by the source, the harness' sources, the flags, `defines` and the compiler's
    version. HarnessBuildError when it declares no kernel or does not compile."""
    from . import shared_cache

    source = source.resolve()
    text = source.read_text()
    names = kernel_bounds(text)
    if not names:
        raise HarnessBuildError(f"{source} declares no extern \"C\" __global__ kernel")
    unit_text = _registration_unit(source, names)
    extra = (*MODEL_FLAGS, "-Wl,-z,defs") if model else ()
    base = tuple("-O0" if f == "-O2" else f for f in CXX_FLAGS) if quick else CXX_FLAGS
    flags = (*base, *KERNEL_FLAGS, *extra, *defines)
    key = shared_cache.digest(cxx, _compiler_version(cxx), "\0".join(flags), str(model), text, unit_text,
                              *((HERE / f).read_bytes() for f in HARNESS_FILES))
    lib = out_dir / f"lib{source.stem}_{'model' if model else 'harness'}.so"
    cached = shared_cache.cache_dir() / "harness" / f"{key}.so"
    with shared_cache.locked(key):
        if not cached.exists():
            unit = out_dir / f"{source.stem}_harness.cc"
            unit.write_text(unit_text)
            built = out_dir / f".building-{lib.name}"
            _run([cxx, *flags, "-I", str(HERE), "-include", str(HERE / "cuda_shim.h"),
                  "-shared", "-o", str(built), str(unit), str(runtime()), "-ldl"])
            cached.parent.mkdir(exist_ok=True)
            shutil.copyfile(built, cached.with_name(f".tmp-{os.getpid()}-{cached.name}"))
            os.replace(cached.with_name(f".tmp-{os.getpid()}-{cached.name}"), cached)
            os.replace(built, lib)
        else:
            shutil.copyfile(cached, lib)
    return lib


def build_kernel_libraries(sources: Iterable[Path], out_dir: Path, defines=source_defines,
                           model: bool = False, quick: bool = False) -> list[Path]:
    """One library per source in `out_dir` (created); `defines(path)` gives each source's
    `-D` options; `model` builds them instrumented for the traffic model (traffic.py);
    `quick` builds them unoptimised (build_kernel_library).
    Raises HarnessBuildError, or FileNotFoundError when there is no g++."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++ or $CXX) to build the kernel harness")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [build_kernel_library(Path(s), out_dir, cxx, lambda: build_runtime(out_dir, cxx, model),
                                 defines(Path(s)), model, quick) for s in sources]
