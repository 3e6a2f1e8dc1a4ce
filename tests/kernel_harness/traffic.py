"""The memory-traffic model: what each of pagedkv's kernels asks of the memory system,
measured on the CPU kernel harness, with ptxas' facts and an occupancy estimate.

How it works (model.inc holds the C++ half):
- `build.build_kernel_libraries(..., model=True)` compiles every kernel source with GCC's
  kernel-address sanitizer in outline mode: each load and store of kernel code calls a
  hook with its address and size. Run through the libcuda stub like the normal harness,
  every launch appends one JSON line of per-site sums to $PAGEDKV_MODEL_OUT.
- A site is one access instruction of the host build (its return address), mapped to the
  kernel source's `file:line` with addr2line (the innermost inlined frame in the kernel
  file); the shim's atomics are traced as one read-modify-write each. GCC does not
  instrument an access it proves in bounds (a shared or constant variable at a constant
  index: uniform across a warp), so those are not seen.
- The k-th execution of a site by the lanes of a warp is one warp-level request. Per site:
  bytes per lane, distinct 32-byte sectors per request, sector efficiency (distinct bytes /
  32 x sectors), uniform requests (every lane the same address: a broadcast, one sector),
  shared-memory wavefronts per request (bank conflicts) and distinct constant addresses.
- Bytes in flight per thread: the byte-weighted mean size of a lane's runs of consecutive
  global loads (or stores) with no other traced access, barrier or warp intrinsic between;
  register-only arithmetic between two loads is not seen, so a loop that computes on each
  value before the next load reads as one run (the rewritten kernels load a batch first).
- `ptxas.ptxas_facts` gives registers, stack frame, spills and shared memory per kernel for
  sm_90 and sm_100; `ptxas.occupancy` the CTAs per SM; bytes in flight per SM = CTAs x
  threads x bytes in flight per thread.

`run_workloads(out)` builds everything, runs WORKLOADS over the stub and returns a
`Report`; `Report.table()` is what `tools/bench.py --section model` prints, and
tests/driver/test_traffic_model.py holds FLOORS against it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from . import build, ptxas

KERNEL_DIR = Path(__file__).resolve().parent.parent.parent / "pagedkv" / "nvrtc_src"
MODEL_ENV = "PAGEDKV_MODEL_OUT"
SPACES = ("global", "shared", "constant", "local")

HOT_SHARE = 0.01
"""A global site that moves at least this share of its kernel's global bytes (and is not a
uniform broadcast) is in the kernel's main loop: the floors hold for it."""

IN_FLIGHT_FLOOR = 32 * 1024
"""Modeled bytes in flight per SM every hot kernel must reach (H200: ~25 KiB by Little's law)."""

SECTOR_FLOOR, BULK_SECTOR_FLOOR = 0.50, 0.90
BYTES_FLOOR, BULK_BYTES_FLOOR = 8, 16


@dataclass
class Site:
    """One access site of one kernel (every instruction of the host build at that line)."""

    location: str  # file:line
    space: str
    kind: str  # "load", "store" or "atomic"
    requests: int = 0
    lanes: int = 0
    bytes: int = 0
    sectors: int = 0
    distinct: int = 0
    uniform: int = 0
    wavefronts: int = 0
    phases: int = 0
    lane_wavefronts: int = 0
    const_addresses: int = 0
    min_size: int = 1 << 30
    max_size: int = 0

    def add(self, row: list[int]) -> None:
        """Add one trace row's sums (model.inc's order)."""
        (_, _, _, requests, lanes, nbytes, sectors, distinct, uniform, wavefronts, phases, lane_wavefronts,
         const_addresses, min_size, max_size) = row
        self.requests += requests
        self.lanes += lanes
        self.bytes += nbytes
        self.sectors += sectors
        self.distinct += distinct
        self.uniform += uniform
        self.wavefronts += wavefronts
        self.phases += phases
        self.lane_wavefronts += lane_wavefronts
        self.const_addresses += const_addresses
        self.min_size = min(self.min_size, min_size)
        self.max_size = max(self.max_size, max_size)

    @property
    def bytes_per_lane(self) -> float:
        """Mean bytes one lane moves per execution."""
        return self.bytes / self.lanes if self.lanes else 0.0

    @property
    def sectors_per_request(self) -> float:
        """Mean distinct 32-byte sectors of one warp-level request (global)."""
        return self.sectors / self.requests if self.requests else 0.0

    @property
    def efficiency(self) -> float:
        """Useful bytes / (32 x sectors) over every request (global)."""
        return self.distinct / (32 * self.sectors) if self.sectors else 0.0

    @property
    def is_uniform(self) -> bool:
        """Most requests are broadcasts (every lane reads the same address)."""
        return self.requests > 0 and self.uniform * 2 > self.requests

    @property
    def bank_ways(self) -> float:
        """Shared wavefronts per phase: 1.0 is conflict-free (atomics: lanes per bank)."""
        if not self.phases:
            return 0.0
        return (self.lane_wavefronts if self.kind == "atomic" else self.wavefronts) / self.phases

    @property
    def constant_ways(self) -> float:
        """Distinct constant addresses per request: 1.0 is a broadcast, more serialise."""
        return self.const_addresses / self.requests if self.requests else 0.0


@dataclass
class KernelRun:
    """One kernel in one workload: its sites, in-flight runs and ptxas facts."""

    workload: str
    kernel: str
    threads: int
    launches: int = 0
    sites: dict = field(default_factory=dict)
    load_runs: list = field(default_factory=lambda: [0.0, 0.0])
    store_runs: list = field(default_factory=lambda: [0.0, 0.0])
    local_bytes: int = 0
    facts: dict = field(default_factory=dict)  # arch -> ptxas.KernelFacts
    bulk: bool = False

    @property
    def hot(self) -> bool:
        """On the hot path, so held to the floors: every kernel but the reductions' final
        passes (one CTA adding a few words per CTA of the partial pass)."""
        return not self.kernel.endswith("_final")

    def global_sites(self) -> list[Site]:
        """Global sites, most bytes first."""
        return sorted((s for s in self.sites.values() if s.space == "global"), key=lambda s: -s.bytes)

    def global_bytes(self) -> int:
        """Bytes of every global access."""
        return sum(s.bytes for s in self.global_sites())

    def hot_sites(self) -> list[Site]:
        """The main loop's global sites: not broadcasts, at least HOT_SHARE of the bytes."""
        total = self.global_bytes()
        return [s for s in self.global_sites() if not s.is_uniform and total and s.bytes >= HOT_SHARE * total]

    def in_flight_per_thread(self) -> float:
        """Byte-weighted mean run of consecutive global loads or stores of one lane (the larger)."""
        load = self.load_runs[0] / self.load_runs[1] if self.load_runs[1] else 0.0
        store = self.store_runs[0] / self.store_runs[1] if self.store_runs[1] else 0.0
        return max(load, store)

    def ctas_per_sm(self, arch: str = "sm_90") -> int:
        """CTAs one SM of `arch` holds (ptxas' registers and shared memory, the launch's threads)."""
        facts = self.facts.get(arch)
        return ptxas.occupancy(facts, self.threads) if facts else 0

    def in_flight_per_sm(self, arch: str = "sm_90") -> float:
        """Modeled bytes in flight per SM: CTAs x threads x bytes in flight per thread."""
        return self.ctas_per_sm(arch) * self.threads * self.in_flight_per_thread()

    def floor_misses(self) -> list[str]:
        """Every floor of issue 19 this kernel misses, as readable strings (empty: all held)."""
        misses = []
        facts = self.facts.get("sm_90")
        if facts is None:
            misses.append("no ptxas facts for sm_90")
        else:
            if facts.stack_frame:
                misses.append(f"{facts.stack_frame}-byte stack frame on sm_90")
            if facts.spill_stores or facts.spill_loads:
                misses.append(f"spills on sm_90 ({facts.spill_stores} B stored, {facts.spill_loads} B loaded)")
        sector_floor = BULK_SECTOR_FLOOR if self.bulk else SECTOR_FLOOR
        bytes_floor = BULK_BYTES_FLOOR if self.bulk else BYTES_FLOOR
        for s in self.hot_sites():
            if s.efficiency < sector_floor - 1e-9:
                misses.append(f"{s.location} {s.kind}: sector efficiency {s.efficiency:.0%} < {sector_floor:.0%}")
            if s.bytes_per_lane < bytes_floor - 1e-9:
                misses.append(f"{s.location} {s.kind}: {s.bytes_per_lane:.1f} bytes per lane < {bytes_floor}")
        flight = self.in_flight_per_sm()
        if flight < IN_FLIGHT_FLOOR:
            misses.append(f"{flight / 1024:.1f} KiB in flight per SM < {IN_FLIGHT_FLOOR // 1024} KiB")
        return misses


@dataclass
class Report:
    """Every workload's kernels."""

    runs: list

    def run(self, workload: str, kernel: str) -> KernelRun:
        """The run of `kernel` in `workload` (KeyError naming both when absent)."""
        for r in self.runs:
            if r.workload == workload and r.kernel == kernel:
                return r
        raise KeyError(f"no {kernel} in workload {workload}")

    def table(self, sites: bool = True) -> str:
        """The model's table: per kernel ptxas facts, occupancy and bytes in flight, then its
        global sites (and the other spaces' notable ones) with their figures."""
        lines = []
        head = (f"{'workload':<22} {'kernel':<28} {'regs':>4} {'stack':>5} {'spill':>5} {'smem':>6} "
                f"{'r100':>4} {'st100':>5} {'CTA/SM':>6} {'B/thr':>6} {'KiB/SM':>7} {'floors':>6}")
        lines.append(head)
        for r in self.runs:
            f90, f100 = r.facts.get("sm_90"), r.facts.get("sm_100")
            misses = r.floor_misses() if r.hot else []
            lines.append(
                f"{r.workload:<22} {r.kernel:<28} {f90.registers if f90 else '-':>4} "
                f"{f90.stack_frame if f90 else '-':>5} {(f90.spill_stores + f90.spill_loads) if f90 else '-':>5} "
                f"{f90.shared if f90 else '-':>6} {f100.registers if f100 else '-':>4} "
                f"{f100.stack_frame if f100 else '-':>5} {r.ctas_per_sm():>6} {r.in_flight_per_thread():6.0f} "
                f"{r.in_flight_per_sm() / 1024:7.1f} {('ok' if not misses else f'{len(misses)} miss') if r.hot else '-':>6}")
            if not sites:
                continue
            total = r.global_bytes() or 1
            hot = {id(s) for s in r.hot_sites()}
            for s in sorted(r.sites.values(), key=lambda s: (SPACES.index(s.space), -s.bytes)):
                if s.space == "global":
                    mark = "*" if id(s) in hot else ("u" if s.is_uniform else " ")
                    lines.append(
                        f"    {mark} {s.location:<24} {s.space:<8} {s.kind:<6} {s.bytes_per_lane:5.1f} B/lane "
                        f"{s.sectors_per_request:5.1f} sect/req {s.efficiency:5.0%} eff {s.bytes / total:5.1%} of bytes")
                elif s.space == "shared" and (s.bank_ways > 1.0 or s.bytes * 50 > total):
                    lines.append(f"      {s.location:<24} {s.space:<8} {s.kind:<6} {s.bytes_per_lane:5.1f} B/lane "
                                 f"{s.bank_ways:5.2f} wavefronts/phase")
                elif s.space == "constant" and s.constant_ways > 1.0:
                    lines.append(f"      {s.location:<24} {s.space:<8} {s.kind:<6} {s.bytes_per_lane:5.1f} B/lane "
                                 f"{s.constant_ways:5.2f} addresses/request (divergent)")
            for m in misses:
                lines.append(f"      MISSED: {m}")
        return "\n".join(lines)


# ---- workloads --------------------------------------------------------------------------

FORMATS = ("bf16", "fp8", "nvfp4", "turbo4", "turbo3", "turbo2", "turbo8")
BULK_WORKLOADS = ("fill", "copy_blocks", "copy_batch", "reduce_bf16")
"""Workloads held to the bulk floors (90% sector efficiency, 16 bytes per lane); so are the
bf16/fp8 KV row workloads."""

WORKLOAD_BODY = r'''
import json, os
import ml_dtypes
import numpy as np
from pagedkv import DeviceArray, KvCacheConfig, PagedKvCache
from pagedkv.core.dtype import KvCacheDtype
from pagedkv.driver import CudaBackend

OUT = os.environ["PAGEDKV_MODEL_OUT"]
STUB.stub_set_device(2, 9, 0)
STUB.stub_set_occupancy(1)
HEADS, HEAD_DIM, BLOCK, TOKENS = 8, 128, 16, 64
FORMATS = {formats!r}

def label(name):
    with open(OUT, "a") as f:
        f.write(json.dumps({{"label": name}}) + "\n")

rng = np.random.default_rng(0)
with CudaBackend(copy_batch="kernel") as gpu:
    stream = gpu.create_stream()
    sync = lambda: gpu.synchronize(stream)
    rows = rng.normal(size=(TOKENS, HEADS, HEAD_DIM)).astype(ml_dtypes.bfloat16)
    bufs = [gpu.alloc(rows.nbytes) for _ in range(4)]
    for b in bufs[:2]:
        gpu.copy_h2d(rows.view(np.uint16), b)
    k, v, out_k, out_v = (DeviceArray(b, rows.shape, "bfloat16") for b in bufs)
    slot_host = rng.permutation(8 * BLOCK)[:TOKENS].astype(np.int64)
    slot_ptr = gpu.alloc(slot_host.nbytes)
    gpu.copy_h2d(slot_host, slot_ptr)
    slots = DeviceArray(slot_ptr, (TOKENS,), "int64")
    for fmt, layout in [(f, layout) for layout in ("NHD", "HND") for f in FORMATS]:
        config = KvCacheConfig(block_size=BLOCK, num_kv_heads=HEADS, head_dim=HEAD_DIM, num_layers=2, dtype=fmt,
                               layout=layout)
        cache = PagedKvCache(config, 8, gpu)
        cache.alloc_blocks(8)
        sync()
        tag = "" if layout == "NHD" else "_hnd"   # the HND workloads: kv_write_hnd/bf16, ...
        if fmt == "bf16" and layout == "NHD":
            label("fill")
            cache.fill_blocks(list(range(8)), 0x5A, gpu, stream); sync()
            label("copy_blocks")
            cache.copy_blocks([(i, i + 4) for i in range(4)], gpu, stream); sync()
        label(f"kv_write{{tag}}/{{fmt}}")
        cache.write_tokens(0, slots, k, v, gpu, stream); sync()
        label(f"kv_read{{tag}}/{{fmt}}")
        cache.read_tokens(0, slots, gpu, out_k=out_k, out_v=out_v, stream=stream); sync()
        label(f"kv_write_layers{{tag}}/{{fmt}}")
        plan = cache.plan_layer_writes([0, 1], [k, k], [v, v], gpu)
        plan.write(slots, stream); sync()
        plan.close()
        pools = cache.pools()
        side = KvCacheDtype.parse(fmt)
        if not (fmt == "bf16" and layout == "HND"):   # bf16 sums know no layout: the BF16 reduction
            label("reduce_bf16" if fmt == "bf16" else f"kv_checksum{{tag}}/{{fmt}}")
            gpu.reduce_kv_blocks(pools.regions(), pools.region_index(0, "K"), list(range(8)), side, BLOCK,
                                 HEADS * HEAD_DIM, stream, layout=layout, heads=HEADS)
            sync()
        cache.release(gpu)
    label("copy_batch")
    a, b = gpu.alloc(1 << 20), gpu.alloc(1 << 20)
    gpu.copy_batch_async([b, b + (512 << 10)], [a, a + (256 << 10)], [256 << 10, 256 << 10], stream); sync()
    gpu.free(a); gpu.free(b)
    for p in bufs + [slot_ptr]:
        gpu.free(p)
    gpu.destroy_stream(stream)
print("WORKLOADS DONE")
'''


def model_env(out: Path, kernel_cache: Path) -> dict:
    """Build the stub and the model libraries into `out`; the subprocess environment."""
    from pagedkv.driver import nvrtc

    from . import stub

    env = stub.make_stub_env(out, kernel_cache)
    libs = build.build_kernel_libraries(nvrtc.kernel_sources(), out / "model_kernels", model=True)
    return stub.with_libraries(env, libs)


def run_workloads(out: Path, kernel_cache: Path, formats=FORMATS, env: dict | None = None,
                  archs=ptxas.ARCHS) -> Report:
    """Run WORKLOAD_BODY over the model libraries and build the Report (ptxas facts for `archs`)."""
    from . import stub

    env = dict(env or model_env(out, kernel_cache))
    trace = out / "trace.jsonl"
    trace.unlink(missing_ok=True)
    env[MODEL_ENV] = str(trace)
    stub.run_on_stub(env, WORKLOAD_BODY.format(formats=tuple(formats)), timeout=600)
    return parse_trace(trace, archs)


def _kernel_threads() -> dict[str, int]:
    from pagedkv.driver.kernels import KERNELS

    return {name: threads for kernels in KERNELS.values() for name, _, threads in kernels}


def _kernel_sources() -> dict[str, Path]:
    return {name: KERNEL_DIR / filename for filename, kernels in _kernels_by_file().items() for name in kernels}


def _kernels_by_file() -> dict[str, list[str]]:
    from pagedkv.driver.kernels import KERNELS

    return {filename: [name for name, _, _ in kernels] for filename, kernels in KERNELS.items()}


def symbolize(lib: str, offsets: list[int]) -> dict[int, tuple[str, bool] | None]:
    """offset -> (kernel `file:line`, inside an atomic) of each return address in `lib`
    (None: not in kernel source), from addr2line's inline chain (innermost `.cu` frame)."""
    if not offsets:
        return {}
    proc = subprocess.run(["addr2line", "-e", lib, "-f", "-i", "-C", "-a", *[hex(o - 1) for o in offsets]],
                          capture_output=True, text=True, check=True)
    result: dict[int, tuple[str, bool] | None] = {}
    chains: list[list[tuple[str, str]]] = []
    lines = proc.stdout.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            chains.append([])
            i += 1
            continue
        chains[-1].append((lines[i], lines[i + 1] if i + 1 < len(lines) else "??:0"))
        i += 2
    for off, chain in zip(offsets, chains):
        atomic = any(fn.startswith("atomic") for fn, _ in chain)
        where = None
        for _, loc in chain:
            path = loc.split(" ")[0]
            file, _, line = path.rpartition(":")
            if file.endswith(".cu"):
                where = f"{Path(file).name}:{line}"
                break
        result[off] = None if where is None else (where, atomic)
    return result


def parse_trace(trace: Path, archs=ptxas.ARCHS) -> Report:
    """The Report of a model trace: launches grouped by the labels before them."""
    threads = _kernel_threads()
    sources = _kernel_sources()
    entries = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    symbols: dict[str, dict] = {}
    by_lib: dict[str, set] = defaultdict(set)
    for e in entries:
        if "kernel" in e:
            by_lib[e["lib"]].update(row[0] for row in e["sites"])
    for lib, offs in by_lib.items():
        symbols[lib] = symbolize(lib, sorted(offs))
    runs: dict[tuple[str, str], KernelRun] = {}
    workload = "unlabelled"
    for e in entries:
        if "label" in e:
            workload = e["label"]
            continue
        if e["status"] != 0:
            raise RuntimeError(f"{e['kernel']} failed with status {e['status']} in workload {workload}")
        key = (workload, e["kernel"])
        run = runs.get(key)
        if run is None:
            run = runs[key] = KernelRun(workload, e["kernel"], threads.get(e["kernel"], e["block"][0]))
            fmt = workload.partition("/")[2]
            run.bulk = workload in BULK_WORKLOADS or fmt in ("bf16", "fp8")
        run.launches += 1
        run.load_runs = [a + b for a, b in zip(run.load_runs, e["load_runs"])]
        run.store_runs = [a + b for a, b in zip(run.store_runs, e["store_runs"])]
        run.local_bytes += e["local_bytes"]
        for row in e["sites"]:
            sym = symbols[e["lib"]].get(row[0])
            if sym is None:
                continue
            location, _ = sym
            space = SPACES[row[1]]
            kind = ("load", "store", "atomic")[row[2]]
            site = run.sites.get((location, space, kind))
            if site is None:
                site = run.sites[(location, space, kind)] = Site(location, space, kind)
            site.add(row)
    for run in runs.values():
        src = sources.get(run.kernel)
        if src is None:
            continue
        for arch in archs:
            facts = ptxas.ptxas_facts(src, arch).get(run.kernel)
            if facts is not None:
                run.facts[arch] = facts
    return Report(list(runs.values()))


def main(argv: list[str] | None = None) -> int:
    """Print the model table (build, run, report) into a temporary directory."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pagedkv-model-") as tmp:
        report = run_workloads(Path(tmp), Path(tmp) / "kernel_cache")
        print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
