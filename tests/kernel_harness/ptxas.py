"""ptxas facts of pagedkv's kernels and the occupancy they allow, for the traffic model.

`ptxas_facts(path, arch)` compiles a kernel source with NVRTC (its own options and `-D`
values, plus `--ptxas-options=-v`) and parses ptxas' report per kernel: registers, stack
frame, spill stores and loads, static shared memory and barriers. Results are cached on
disk (keyed like the kernel cache: source, options, arch, NVRTC version), since compiling
kv_rows.cu takes seconds. `occupancy(facts, threads, arch)` is the CTAs per SM the
resources allow on that architecture.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

ARCHS = ("sm_90", "sm_100")
"""The architectures the model reports (H100/H200 and B200)."""

# per-SM limits: threads, CTAs, 32-bit registers, shared memory bytes (the most a CTA may
# use is the SM's minus the 1 KiB the driver reserves per CTA), register allocation unit
# (per warp) and shared allocation unit
SM_LIMITS = {
    "sm_90": {"threads": 2048, "ctas": 32, "registers": 65536, "shared": 233472, "cta_reserved": 1024,
              "reg_unit": 256, "shared_unit": 128},
    "sm_100": {"threads": 2048, "ctas": 32, "registers": 65536, "shared": 233472, "cta_reserved": 1024,
               "reg_unit": 256, "shared_unit": 128},
}


@dataclass(frozen=True)
class KernelFacts:
    """What ptxas reports for one kernel on one architecture."""

    kernel: str
    arch: str
    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    shared: int
    barriers: int


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BAR = re.compile(r"used (\d+) barriers")


def parse_ptxas_log(log: str) -> dict[str, KernelFacts]:
    """The facts of every entry function in an NVRTC program log with ptxas -v output."""
    facts: dict[str, KernelFacts] = {}
    current = None
    fields: dict = {}
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = m.group(1)
            fields = {"kernel": current, "arch": m.group(2), "registers": 0, "stack_frame": 0, "spill_stores": 0,
                      "spill_loads": 0, "shared": 0, "barriers": 0}
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            fields["stack_frame"], fields["spill_stores"], fields["spill_loads"] = map(int, m.groups())
        m = _USED.search(line)
        if m:
            fields["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            fields["shared"] = int(s.group(1)) if s else 0
            b = _BAR.search(line)
            fields["barriers"] = int(b.group(1)) if b else 0
            facts[current] = KernelFacts(**fields)
            current = None
    return facts


def _cache_dir() -> Path:
    from pagedkv.driver import nvrtc

    return nvrtc.default_cache_dir() / "ptxas-info"


def ptxas_facts(path: Path, arch: str) -> dict[str, KernelFacts]:
    """ptxas' facts of every kernel of the source at `path` compiled for `arch` as the
    driver compiles it (cached on disk)."""
    from pagedkv.driver import nvrtc

    source = Path(path).read_bytes()
    filename = Path(path).name
    options = (*nvrtc.DEFAULT_OPTIONS, *nvrtc.source_options(filename), *nvrtc.source_defines(filename),
               "--ptxas-options=-v")
    key = nvrtc.cache_key(source, filename, options, arch)
    entry = _cache_dir() / f"{key}.json"
    try:
        cached = json.loads(entry.read_text())
        return {k: KernelFacts(**v) for k, v in cached.items()}
    except (OSError, ValueError, TypeError):
        pass
    log = compile_log(source, filename, arch, options)
    facts = parse_ptxas_log(log)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text(json.dumps({k: asdict(v) for k, v in facts.items()}))
    except OSError:
        pass
    return facts


def compile_log(source: bytes, filename: str, arch: str, options) -> str:
    """NVRTC's program log of compiling `source` for `arch` with `options`."""
    from pagedkv.driver import _bindings, nvrtc
    from pagedkv.driver.errors import check

    lib = _bindings.nvrtc
    prog = check(lib.nvrtcCreateProgram(source, filename.encode(), 0, [], []), "nvrtcCreateProgram", filename)
    try:
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        status = lib.nvrtcCompileProgram(prog, len(opts), opts)[0]
        log = nvrtc._program_log(prog)
        if int(status) != 0:
            raise nvrtc.NvrtcCompileError(filename, arch, log)
        return log
    finally:
        lib.nvrtcDestroyProgram(prog)


def occupancy(facts: KernelFacts, threads: int) -> int:
    """CTAs of `threads` threads one SM holds at once with these resources (0: none fits)."""
    lim = SM_LIMITS[facts.arch]
    warps = -(-threads // 32)
    regs_per_warp = -(-max(facts.registers, 1) * 32 // lim["reg_unit"]) * lim["reg_unit"]
    by_regs = lim["registers"] // (regs_per_warp * warps)
    shared = -(-(facts.shared + lim["cta_reserved"]) // lim["shared_unit"]) * lim["shared_unit"]
    by_shared = lim["shared"] // shared
    return max(0, min(lim["ctas"], lim["threads"] // threads, by_regs, by_shared))
