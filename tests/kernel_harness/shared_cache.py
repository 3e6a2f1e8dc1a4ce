"""One build of each thing per machine: the kernel harness libraries, NVRTC's CUBINs and
ptxas' reports, kept in a content-keyed directory that every test process shares (both
xdist workers, the stub subprocesses, a nested pytest run).

Compiling kv_rows.cu costs ~17 s of CPU with NVRTC and ~3 s with g++; without this, a
suite run paid it once per stub environment, per traffic-model run and per architecture
test. Entries are keyed by everything that goes into them (sources, options, compiler
and NVRTC versions), so a stale entry is never used; a per-key file lock makes the second
process that wants an entry wait for the first one's build instead of repeating it.

`cache_dir()` is `$PAGEDKV_TEST_CACHE`, else `$XDG_CACHE_HOME/pagedkv-tests`, else
`~/.cache/pagedkv-tests`. `compiled(path, arch)` is the CUBIN and ptxas report of one kernel
source, the CUBIN written as an entry of the NVRTC kernel cache in `kernel_cache_dir()`, so
`nvrtc.compile_cached` there is a hit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CACHE_ENV = "PAGEDKV_TEST_CACHE"
"""Environment variable naming the shared test build cache."""


def cache_dir() -> Path:
    """The shared test build cache (created)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        path = Path(override)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(base) / "pagedkv-tests"
    path.mkdir(parents=True, exist_ok=True)
    return path


def kernel_cache_dir() -> Path:
    """The NVRTC kernel cache the stub environments share (a `PAGEDKV_KERNEL_CACHE`)."""
    path = cache_dir() / "kernels"
    path.mkdir(exist_ok=True)
    return path


def digest(*parts: bytes | str) -> str:
    """A hex key of `parts` (each length-prefixed, so no two part lists collide)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@contextlib.contextmanager
def locked(key: str) -> Iterator[None]:
    """Hold the cache's lock of `key` (other processes asking for it wait)."""
    locks = cache_dir() / "locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{key}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomically(path: Path, data: bytes) -> None:
    """Write `path` so that no reader ever sees part of it."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Compiled:
    """One NVRTC compile of a kernel source: its CUBIN and program log (ptxas -v report)."""

    filename: str
    arch: str
    cubin: bytes
    log: str


def compiled(path: Path, arch: str) -> Compiled:
    """The CUBIN and ptxas report of the kernel source at `path` for `arch`, compiled with
    the driver's options (as `nvrtc.compile_cached` compiles it; they ask ptxas for `-v`),
    once per machine; the CUBIN is stored in `kernel_cache_dir()` under the driver's key."""
    from pagedkv.driver import nvrtc

    source = Path(path).read_bytes()
    filename = Path(path).name
    options = (*nvrtc.DEFAULT_OPTIONS, *nvrtc.source_options(filename), *nvrtc.source_defines(filename))
    key = nvrtc.cache_key(source, filename, options, arch)
    entry = kernel_cache_dir() / f"{key}.cubin"
    log_path = cache_dir() / "ptxas" / f"{key}.log"
    with locked(key):
        cubin = nvrtc._read_entry(entry)
        if cubin is None or not log_path.exists():
            cubin, log = nvrtc.compile_source_with_log(source, filename, arch, options)
            nvrtc._write_entry(entry, cubin)
            log_path.parent.mkdir(exist_ok=True)
            write_atomically(log_path, log.encode())
        return Compiled(filename, arch, cubin, log_path.read_text())
