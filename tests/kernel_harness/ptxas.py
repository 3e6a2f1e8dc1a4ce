"""ptxas facts of pagedkv's kernels and the occupancy they allow, for the traffic model.

`ptxas_facts(path, arch)` parses ptxas' report of a kernel source compiled with NVRTC as the
driver compiles it (its options include `--ptxas-options=-v`), per kernel: registers, stack
frame, spill stores and loads, static shared memory and barriers. The compile is shared by
every test process (shared_cache.py), since compiling kv_rows.cu takes seconds. `occupancy(facts, threads, arch)` is the CTAs per SM the
resources allow on that architecture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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


def ptxas_facts(path: Path, arch: str) -> dict[str, KernelFacts]:
    """ptxas' facts of every kernel of the source at `path` compiled for `arch` as the
    driver compiles it (its options ask ptxas for `-v`; compiled once per machine, see
    shared_cache)."""
    from .shared_cache import compiled

    return parse_ptxas_log(compiled(path, arch).log)


def occupancy(facts: KernelFacts, threads: int) -> int:
    """CTAs of `threads` threads one SM holds at once with these resources (0: none fits)."""
    lim = SM_LIMITS[facts.arch]
    warps = -(-threads // 32)
    regs_per_warp = -(-max(facts.registers, 1) * 32 // lim["reg_unit"]) * lim["reg_unit"]
    by_regs = lim["registers"] // (regs_per_warp * warps)
    shared = -(-(facts.shared + lim["cta_reserved"]) // lim["shared_unit"]) * lim["shared_unit"]
    by_shared = lim["shared"] // shared
    return max(0, min(lim["ctas"], lim["threads"] // threads, by_regs, by_shared))
