"""Issue 19's floors on every hot kernel, held by the traffic model (kernel_harness/traffic.py)
on its workloads (8 KV heads x 128, BF16 rows, 64 tokens, blocks of 16; NHD and HND blocks): 0-byte stack frame
and no spills on sm_90; sector efficiency >= 90% on bulk paths (fill, copy, copy_batch, the
BF16 reduction, bf16/fp8 rows) and >= 50% on every main-loop access; >= 16 (bulk) or >= 8
bytes per lane on main-loop accesses; >= 32 KiB in flight per SM at the occupancy ptxas
allows. A kernel that still misses a floor is listed in MISSING with what it misses, as a
strict xfail: the day it meets them the test fails until the entry goes. These are model
figures: a GPU settles them (tools/gpu_check.sh).
"""

from __future__ import annotations

import pickle

import pytest

from kernel_harness import ptxas, shared_cache, traffic
from kernel_harness.build import build_kernel_libraries
from kernel_harness.stub import with_libraries

# one worker runs the module (its report fixture once, first: loadgroup schedules the
# largest group first), while the other runs the rest instead of waiting on the report's lock
pytestmark = pytest.mark.xdist_group("traffic_floors")

_HND_SCALES = ("HND nvfp4 at scattered slots: one (token, head)'s scales are 8 bytes of their own (NHD: a "
               "token's 8 heads' 64 bytes together), so a scale access uses 8 bytes of its 32-byte sector")
MISSING = {
    # (workload, kernel): why it misses (kept in step with the model's table)
    ("kv_write_hnd/nvfp4", "pagedkv_kv_write_nvfp4"): _HND_SCALES,
    ("kv_read_hnd/nvfp4", "pagedkv_kv_read_nvfp4"): _HND_SCALES + "; and 26.7 KiB in flight per SM < 32 KiB",
}

# the row kernel of each format's workloads (8 heads of 128, rotated turbo sides): bf16/fp8
# the `16` kernels, nvfp4 and the rotated turbo formats of head_dim 128 their one-path ones
ROW_KERNEL = {"bf16": "16", "fp8": "16", "nvfp4": "_nvfp4", "turbo4": "_turbo_h128", "turbo3": "_turbo_h128",
              "turbo2": "_turbo_h128", "turbo8": "_turbo8_h128"}

EXPECTED = [
    ("fill", "pagedkv_fill_blocks"), ("copy_blocks", "pagedkv_copy_blocks"), ("copy_batch", "pagedkv_copy_batch"),
    ("reduce_bf16", "pagedkv_reduce_bf16_partial"),
    *[(f"kv_checksum{tag}/{f}", "pagedkv_kv_checksum_partial") for f in traffic.FORMATS if f != "bf16"
      for tag in ("", "_hnd")],
    *[(f"kv_{op}{tag}/{f}", f"pagedkv_kv_{'write' if op != 'read' else 'read'}{ROW_KERNEL[f]}")
      for f in traffic.FORMATS for op in ("write", "read", "write_layers") for tag in ("", "_hnd")],
]
"""Every hot (workload, kernel); the `_hnd` workloads are the same on HND blocks (the same
kernels: an HND side runs as one one-head side per head chunk)."""


def _report_key() -> str:
    """A key of everything the report depends on: pagedkv's sources (kernels and Python),
    the harness' sources, the compilers' versions."""
    import pathlib

    import pagedkv
    from kernel_harness import build

    package = pathlib.Path(pagedkv.__file__).parent
    harness = pathlib.Path(build.__file__).parent
    files = sorted([*package.rglob("*.py"), *package.rglob("*.cu"), *harness.glob("*.*")])
    cxx = build.compiler() or ""
    return shared_cache.digest(cxx, build._compiler_version(cxx) if cxx else "", traffic.WORKLOAD_BODY,
                               *(f"{f.relative_to(f.parents[1])}" for f in files), *(f.read_bytes() for f in files))


@pytest.fixture(scope="module")
def report(stub_env, tmp_path_factory):
    """The traffic model's report, run once per machine and source tree: both xdist workers
    (and later runs of the same tree) read the first one's, kept in the shared test cache."""
    from pagedkv.driver import nvrtc

    key = _report_key()
    path = shared_cache.cache_dir() / "traffic" / f"{key}.pickle"
    with shared_cache.locked(key):
        if path.exists():
            return pickle.loads(path.read_bytes())
        out = tmp_path_factory.mktemp("traffic")
        libs = build_kernel_libraries(nvrtc.kernel_sources(), out / "model_kernels", model=True)
        made = traffic.run_workloads(out, out / "kernel_cache", env=with_libraries(stub_env, libs))
        path.parent.mkdir(exist_ok=True)
        shared_cache.write_atomically(path, pickle.dumps(made))
    return made


def test_every_hot_kernel_is_in_the_model(report):
    assert sorted((r.workload, r.kernel) for r in report.runs if r.hot) == sorted(EXPECTED)


@pytest.mark.parametrize("workload, kernel", EXPECTED)
def test_hot_kernel_meets_the_floors(report, workload, kernel, request):
    if (workload, kernel) in MISSING:
        request.applymarker(pytest.mark.xfail(strict=True, reason=MISSING[(workload, kernel)]))
    run = report.run(workload, kernel)
    assert run.floor_misses() == []


@pytest.mark.parametrize("kernel", ["pagedkv_kv_write", "pagedkv_kv_read"])
def test_every_format_row_kernels_keep_three_ctas_an_sm(kernel):
    """The every-format row kernels (mixed-kind layers, rotated turbo at head_dim 256 / 512,
    unrotated turbo: no workload of the model above) take a batch of 1, which must cost no
    more registers than the plain paths: 3 CTAs of 128 threads an SM on sm_90 (<= 168
    registers), no stack frame, no spills."""
    facts = ptxas.ptxas_facts(traffic.KERNEL_DIR / "kv_rows.cu", "sm_90")[kernel]
    assert (facts.stack_frame, facts.spill_stores, facts.spill_loads) == (0, 0, 0)
    assert facts.registers <= 168 and ptxas.occupancy(facts, 128) == 3
