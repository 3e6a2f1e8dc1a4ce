"""Planted bugs in the exact checksum kernels (pagedkv_kv_checksum_* in nvrtc_src/kv_rows.cu)
each fail the checksum check over the stub (kernel_harness/kv_checksum_checks.py, its
small case at 2 SMs): a dropped carry, a CTA that does nothing, a digit off (of the sum
and of the squares), negative values added as positive, float32 denormals dropped, NaN
flagged as +inf, the final pass skipping a partial, a block's last group skipped, a missing __syncthreads in the CTA
tree, and a wrong E2M1 decode (the table the read path shares). Only the code the harness
executes is mutated; NVRTC compiles the real source. The unmutated copy passes the same
pipeline.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernel_harness.build import HARNESS_ENV
from kernel_harness.kv_checksum_checks import checksum_case_body
from kernel_harness.stub import build_harness, run_on_stub_unchecked, with_libraries

SOURCE = "kv_rows.cu"
CASE = "mutation_small"

BUGS = {
    "unmutated": None,
    "dropped_carry": ("        d[i + 1] += c;\n", "\n"),
    "cta_does_nothing": ("for (int k = blockIdx.x; k < num_blocks; k += gridDim.x) {\n        const u8* base",
                         "for (int k = blockIdx.x; k < (blockIdx.x == 1 ? 0 : num_blocks); k += gridDim.x) {\n"
                         "        const u8* base"),
    "sum_digit_off": ("        a.d[CS_SUM_AT + dv + 1] += hi;\n", "        a.d[CS_SUM_AT + dv + 2] += hi;\n"),
    "square_digit_off": ("a.d[CS_SSQ_AT + dq + 2] += (i64)(q_hi >> 32);", "a.d[CS_SSQ_AT + dq + 1] += (i64)(q_hi >> 32);"),
    "sign_ignored": ("        a.d[CS_SUM_AT + dv] -= lo;\n", "        a.d[CS_SUM_AT + dv] += lo;\n"),
    "denormals_dropped": ("const u32 m = e ? (f | 0x800000u) : f;", "const u32 m = e ? (f | 0x800000u) : 0u;"),
    "nan_flagged_as_inf": ("a.flags |= f ? CS_FLAG_NAN :", "a.flags |= f ? CS_FLAG_POS_INF :"),
    "final_skips_a_partial": ("for (int p = threadIdx.x; p < num_partials; p += CHECKSUM_THREADS) {\n        const i64* part",
                              "for (int p = threadIdx.x; p < num_partials - 1; p += CHECKSUM_THREADS) {\n"
                              "        const i64* part"),
    "missing_syncthreads": ("cs_sh[j][threadIdx.x] = first + j < CS_FLAGS_AT ? a.d[first + j] : (i64)a.flags;\n"
                            "        __syncthreads();",
                            "cs_sh[j][threadIdx.x] = first + j < CS_FLAGS_AT ? a.d[first + j] : (i64)a.flags;\n"),
    "last_group_skipped": ("for (i64 gi = threadIdx.x; gi < groups; gi += CHECKSUM_THREADS) {",
                           "for (i64 gi = threadIdx.x; gi < groups - 1; gi += CHECKSUM_THREADS) {"),
    "wrong_e2m1_decode": ("{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f}", "{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 4.0f, 3.0f, 6.0f}"),
}


@pytest.mark.parametrize("kind", sorted(BUGS))
def test_planted_checksum_bug_fails_the_checksum_check(stub_env, tmp_path, kind):
    from pagedkv.driver import nvrtc

    text = (nvrtc.SOURCE_DIR / SOURCE).read_text()
    if BUGS[kind] is not None:
        old, new = BUGS[kind]
        assert text.count(old) == 1, f"{kind}: {old!r} must occur once in {SOURCE}"
        text = text.replace(old, new)
    src = tmp_path / "src" / SOURCE
    src.parent.mkdir()
    src.write_text(text)
    (mutant,) = build_harness([src], tmp_path / "libs")
    libs = [p for p in stub_env[HARNESS_ENV].split(os.pathsep) if Path(p).name != mutant.name]
    env = with_libraries(stub_env, [*libs, mutant])
    proc = run_on_stub_unchecked(env, checksum_case_body(CASE, 2, orders=("ascending",)), timeout=300)
    if BUGS[kind] is None:
        assert proc.returncode == 0 and "CHECK checksum ok" in proc.stdout, proc.stderr[-3000:]
        return
    assert proc.returncode != 0 and "CHECK checksum ok" not in proc.stdout, f"{kind} went unnoticed:\n{proc.stdout}"
    assert "AssertionError" in proc.stderr or "CudaError" in proc.stderr, proc.stderr[-2000:]
