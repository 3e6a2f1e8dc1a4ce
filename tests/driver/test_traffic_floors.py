"""Issue 19's floors on every hot kernel, held by the traffic model (kernel_harness/traffic.py)
on its workloads (8 KV heads x 128, BF16 rows, 64 tokens, blocks of 16): 0-byte stack frame
and no spills on sm_90; sector efficiency >= 90% on bulk paths (fill, copy, copy_batch, the
BF16 reduction, bf16/fp8 rows) and >= 50% on every main-loop access; >= 16 (bulk) or >= 8
bytes per lane on main-loop accesses; >= 32 KiB in flight per SM at the occupancy ptxas
allows. A kernel that still misses a floor is listed in MISSING with what it misses, as a
strict xfail: the day it meets them the test fails until the entry goes. These are model
figures: a GPU settles them (tools/gpu_check.sh).
"""

from __future__ import annotations

import pytest

from kernel_harness import traffic
from kernel_harness.build import build_kernel_libraries
from kernel_harness.stub import with_libraries

# one worker runs the whole module: its module-scoped fixture is built once (pyproject: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("traffic_floors")

MISSING = {
    # (workload, kernel): why it misses (kept in step with the model's table)
}

# the row kernel of each format's workloads (8 heads of 128, rotated turbo sides): bf16/fp8
# the `16` kernels, nvfp4 and the rotated turbo formats of head_dim 128 their one-path ones
ROW_KERNEL = {"bf16": "16", "fp8": "16", "nvfp4": "_nvfp4", "turbo4": "_turbo_h128", "turbo3": "_turbo_h128",
              "turbo2": "_turbo_h128", "turbo8": "_turbo8_h128"}

EXPECTED = [
    ("fill", "pagedkv_fill_blocks"), ("copy_blocks", "pagedkv_copy_blocks"), ("copy_batch", "pagedkv_copy_batch"),
    ("reduce_bf16", "pagedkv_reduce_bf16_partial"),
    *[(f"kv_checksum/{f}", "pagedkv_kv_checksum_partial") for f in traffic.FORMATS if f != "bf16"],
    *[(f"kv_{op}/{f}", f"pagedkv_kv_{'write' if op != 'read' else 'read'}{ROW_KERNEL[f]}")
      for f in traffic.FORMATS for op in ("write", "read", "write_layers")],
]


@pytest.fixture(scope="module")
def report(stub_env, tmp_path_factory):
    from pagedkv.driver import nvrtc

    out = tmp_path_factory.mktemp("traffic")
    libs = build_kernel_libraries(nvrtc.kernel_sources(), out / "model_kernels", model=True)
    return traffic.run_workloads(out, out / "kernel_cache", env=with_libraries(stub_env, libs))


def test_every_hot_kernel_is_in_the_model(report):
    assert sorted((r.workload, r.kernel) for r in report.runs if r.hot) == sorted(EXPECTED)


@pytest.mark.parametrize("workload, kernel", EXPECTED)
def test_hot_kernel_meets_the_floors(report, workload, kernel, request):
    if (workload, kernel) in MISSING:
        request.applymarker(pytest.mark.xfail(strict=True, reason=MISSING[(workload, kernel)]))
    run = report.run(workload, kernel)
    assert run.floor_misses() == []
