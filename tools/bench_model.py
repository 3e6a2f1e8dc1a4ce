"""Model section of tools/bench.py (`--section model`): the memory-traffic model of every hot
kernel, measured on the CPU kernel harness (tests/kernel_harness/traffic.py), no GPU needed.

Per workload and kernel: ptxas' registers, stack frame, spills and shared memory for sm_90
(and registers and stack for sm_100), the CTAs per SM they allow, the modeled bytes in flight
per thread and per SM; under each kernel its global access sites (`*` main loop, held to the
floors; `u` a broadcast) with bytes per lane, sectors per warp request, sector efficiency and
share of the kernel's bytes, shared sites with bank conflicts and divergent constant reads.
Then one ceiling line per hot kernel (all but the reductions' one-CTA final passes): the number of issue 19's floors it misses (must be 0):
0-byte stack frame and no spills on sm_90, sector efficiency >= 90% (bulk: fill, copy,
copy_batch, BF16 reduction, bf16/fp8 rows) or >= 50%, >= 16 (bulk) or >= 8 bytes per lane
on main-loop sites, >= 32 KiB in flight per SM. These are model figures, not a GPU's.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from floors import ceiling

REPO = Path(__file__).resolve().parent.parent


def run(args) -> None:
    """Build the model libraries, run the workloads over the stub and print the table."""
    sys.path.insert(0, str(REPO / "tests"))
    from kernel_harness import traffic

    with tempfile.TemporaryDirectory(prefix="pagedkv-model-") as tmp:
        report = traffic.run_workloads(Path(tmp), Path(tmp) / "kernel_cache")
    print(report.table(sites=not getattr(args, "quick", False)))
    for r in report.runs:
        if not r.hot:
            continue
        ceiling(f"{r.workload} {r.kernel}: floors missed", float(len(r.floor_misses())), 0.0)
