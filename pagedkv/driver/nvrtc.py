"""Compile the kernels in `pagedkv/nvrtc_src` to CUBIN with NVRTC, through an on-disk cache.

The cache key is a hash of the source, the options, the architecture and the NVRTC
version. Entries carry a checksum of their payload: a corrupt, unreadable or unwritable
cache logs an event and falls back to compiling. Needs NVRTC only, never a GPU.

Note: when a libcuda.so.1 is present, libnvrtc itself loads it and calls cuInit (and
cuGetExportTable) while compiling, so compiling in a process initialises CUDA there just
as a CudaBackend would; do not compile in a parent process that will fork workers.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..core.log import get_logger
from ..core.exact_sum import F32_SSQ_DIGITS, F32_SUM_DIGITS, SSQ_DIGITS, SUM_DIGITS
from . import _bindings
from .errors import CudaError, UnsupportedArchitecture, check

SOURCE_DIR = Path(__file__).resolve().parent.parent / "nvrtc_src"
"""Where the kernel sources (`*.cu`) live."""

CACHE_ENV = "PAGEDKV_KERNEL_CACHE"
"""Environment variable naming the kernel cache directory (overrides the default)."""

DEFAULT_OPTIONS = ("--std=c++17", "-default-device", "--ptxas-options=-v")
"""NVRTC options every kernel is compiled with (no include paths: kernels use no headers).
ptxas' `-v` report (registers, stack frame, spills per kernel) lands in the program log,
so the resources the traffic model checks are those of the very CUBIN the driver loads."""

REDUCE_THREADS = 256
"""Threads per CTA of the reduction kernels: passed to reduce_bf16.cu as -DREDUCE_THREADS
and to kv_rows.cu (its checksum kernels) as -DCHECKSUM_THREADS."""

_SOURCE_DEFINES = {
    "reduce_bf16.cu": (
        f"-DREDUCE_THREADS={REDUCE_THREADS}",
        f"-DSUM_DIGITS={SUM_DIGITS}",
        f"-DSSQ_DIGITS={SSQ_DIGITS}",
    ),
    "kv_rows.cu": (
        f"-DCHECKSUM_THREADS={REDUCE_THREADS}",
        f"-DF32_SUM_DIGITS={F32_SUM_DIGITS}",
        f"-DF32_SSQ_DIGITS={F32_SSQ_DIGITS}",
    ),
}

_SOURCE_OPTIONS = {
    # byte-exact with the host codecs: every multiply and add rounded on its own
    "kv_rows.cu": ("--fmad=false",),
}

_MAGIC = b"PKVCUBIN1\n"
_log = get_logger("nvrtc")


class NvrtcCompileError(CudaError):
    """A kernel source failed to compile; `log` holds NVRTC's program log."""

    def __init__(self, filename: str, arch: str, log: str):
        self.filename = filename
        self.log = log
        super().__init__(
            "nvrtcCompileProgram", 6, "NVRTC_ERROR_COMPILATION", "compilation failed",
            f"for {filename} ({arch}):\n{log.strip()}",
        )


@dataclass(frozen=True)
class CompiledKernel:
    """A CUBIN image and where it came from (`from_cache` is True when no compile ran)."""

    filename: str
    arch: str
    cubin: bytes
    from_cache: bool


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use."""
    nvrtc = _bindings.nvrtc
    return check(nvrtc.nvrtcVersion(), "nvrtcVersion")


def supported_archs() -> list[int]:
    """The SM architectures (e.g. 80, 90, 100) this NVRTC can compile CUBIN for."""
    nvrtc = _bindings.nvrtc
    return list(check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def source_defines(filename: str) -> tuple[str, ...]:
    """The `-D` options the kernel source `filename` is compiled with (empty for a file
    that takes none); the CPU kernel harness compiles the same source with the same ones."""
    return _SOURCE_DEFINES.get(filename, ())


def source_options(filename: str) -> tuple[str, ...]:
    """NVRTC options besides `-D` ones that the kernel source `filename` is compiled with
    (`--fmad=false` for the KV codec kernels; the harness builds with -ffp-contract=off)."""
    return _SOURCE_OPTIONS.get(filename, ())


def arch_option(major: int, minor: int) -> str:
    """`sm_XY` for a compute capability X.Y; UnsupportedArchitecture (a CudaUnavailable)
    when this NVRTC cannot target it."""
    arch = major * 10 + minor
    archs = supported_archs()
    if arch not in archs:
        raise UnsupportedArchitecture(arch, archs)
    return f"sm_{arch}"


def kernel_sources() -> list[Path]:
    """Every kernel source file shipped with the package, sorted by name."""
    return sorted(SOURCE_DIR.glob("*.cu"))


def default_cache_dir() -> Path:
    """`$PAGEDKV_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pagedkv/kernels`, else `~/.cache/pagedkv/kernels`."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv" / "kernels"


def cache_key(source: bytes, filename: str, options: Sequence[str], arch: str) -> str:
    """The hex cache key of one compile: source, file name, options, arch and NVRTC version."""
    major, minor = nvrtc_version()
    digest = hashlib.sha256()
    for part in (source, filename.encode(), "\0".join(options).encode(), arch.encode(), f"{major}.{minor}".encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def compile_source(source: bytes, filename: str, arch: str, options: Sequence[str] = DEFAULT_OPTIONS) -> bytes:
    """CUBIN of `source` for `arch` (`sm_XY`) with `options` as given (no source defines
    added); NvrtcCompileError carries the log and file name."""
    return compile_source_with_log(source, filename, arch, options)[0]


def compile_source_with_log(source: bytes, filename: str, arch: str,
                            options: Sequence[str] = DEFAULT_OPTIONS) -> tuple[bytes, str]:
    """(CUBIN, NVRTC program log) of `source` for `arch` with `options` as given; the log
    holds ptxas' report when the options ask for it. NvrtcCompileError as compile_source."""
    nvrtc = _bindings.nvrtc
    prog = check(nvrtc.nvrtcCreateProgram(source, filename.encode(), 0, [], []), "nvrtcCreateProgram", filename)
    try:
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(status) != 0:
            raise NvrtcCompileError(filename, arch, _program_log(prog))
        size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize", filename)
        cubin = bytearray(size)  # NVRTC writes into it: never a shared immutable bytes object
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN", filename)
        return bytes(cubin), _program_log(prog)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(prog) -> str:
    nvrtc = _bindings.nvrtc
    size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    log = bytearray(size)  # NVRTC writes into it: never a shared immutable bytes object
    check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
    return bytes(log).rstrip(b"\0").decode(errors="replace")


def _read_entry(path: Path) -> bytes | None:
    """The payload of a cache entry, or None when it is missing or corrupt (logged)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        _log.warning("kernel_cache_unreadable", path=str(path), error=str(err))
        return None
    head = len(_MAGIC) + 32
    payload = raw[head:]
    if raw[: len(_MAGIC)] != _MAGIC or len(raw) <= head or hashlib.sha256(payload).digest() != raw[len(_MAGIC) : head]:
        _log.warning("kernel_cache_corrupt", path=str(path), bytes=len(raw))
        return None
    return payload


def _write_entry(path: Path, payload: bytes) -> None:
    """Write a cache entry atomically; failures are logged, never raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        _log.warning("kernel_cache_unwritable", path=str(path), error=str(err))


def compile_cached(
    path: Path, arch: str, cache_dir: Path | None = None, options: Sequence[str] = DEFAULT_OPTIONS
) -> CompiledKernel:
    """CUBIN of the kernel source at `path` for `arch`, compiled with `options` plus the
    file's `source_defines`, from the cache when a valid entry exists, else compiled and
    stored (`cache_dir` defaults to `default_cache_dir()`)."""
    source = Path(path).read_bytes()
    filename = Path(path).name
    options = (*options, *source_options(filename), *source_defines(filename))
    entry = (cache_dir or default_cache_dir()) / f"{cache_key(source, filename, options, arch)}.cubin"
    cached = _read_entry(entry)
    if cached is not None:
        _log.debug("kernel_cache_hit", file=filename, arch=arch)
        return CompiledKernel(filename, arch, cached, True)
    cubin = compile_source(source, filename, arch, options)
    _write_entry(entry, cubin)
    _log.info("kernel_compiled", file=filename, arch=arch, cubin_bytes=len(cubin), cache=str(entry))
    return CompiledKernel(filename, arch, cubin, False)
