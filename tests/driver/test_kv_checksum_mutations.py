"""Planted bugs in the exact checksum kernels (pagedkv_kv_checksum_* in nvrtc_src/kv_rows.cu)
each fail the checksum check over the stub (kernel_harness/kv_checksum_checks.py, its
small case at 2 SMs): a dropped carry, a CTA that does nothing, a digit off (of the sum
and of the squares), negative values added as positive, float32 denormals dropped, NaN
flagged as +inf, the final pass skipping a partial, a block's last chunk of groups skipped,
the barrier after the bins are cleared missing, a turbo8 scale's low byte dropped, and a
wrong E2M1 decode (the table the read path shares). Only the code the harness
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
    "sum_digit_off": ("F32_SUM_DIGITS, count * m, s, bits >> 31);", "F32_SUM_DIGITS, count * m, s + 32, bits >> 31);"),
    "square_digit_off": ("count * (mm >> 24), 2 * s + 24, false);", "count * (mm >> 24), 2 * s + 56, false);"),
    "sign_ignored": ("F32_SUM_DIGITS, count * m, s, bits >> 31);", "F32_SUM_DIGITS, count * m, s, false);"),
    # float32 denormals come only from turbo8 (a BF16 scale below 2^-117 times an E4M3 byte)
    "denormals_dropped": ("const u64 m = e ? (f | 0x800000u) : f;\n    if (!m) return;\n    const u32 s = e ? e - 1 : 0;\n"
                          "    atomicAdd(&cs_exp",
                          "const u64 m = e ? (f | 0x800000u) : 0u;\n    if (!m) return;\n    const u32 s = e ? e - 1 : 0;\n"
                          "    atomicAdd(&cs_exp"),
    "nan_flagged_as_inf": ("(bits & 0x007FFFFFu) ? CS_FLAG_NAN :", "(bits & 0x007FFFFFu) ? CS_FLAG_POS_INF :"),
    "final_skips_a_partial": ("for (int p = 0; p < num_partials; p++) {\n            const i64 w = partials[(i64)CS_RESULT_WORDS",
                              "for (int p = 0; p < num_partials - 1; p++) {\n"
                              "            const i64 w = partials[(i64)CS_RESULT_WORDS"),
    "missing_syncthreads": ("    if (threadIdx.x == 0) cs_flags = 0;\n    __syncthreads();", "    if (threadIdx.x == 0) cs_flags = 0;\n"),
    "last_group_skipped": ("        if (c < chunks) {\n            u32 w[DATA_WORDS];",
                           "        if (c < chunks - 1) {\n            u32 w[DATA_WORDS];"),
    "wrong_e2m1_decode": ("{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f}", "{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 4.0f, 3.0f, 6.0f}"),
    "turbo8_scale_half": ("const float s = bf16_decode((sw[g >> 1] >> (16 * (g & 1))) & 0xFFFFu);",
                          "const float s = bf16_decode((sw[g >> 1] >> (16 * (g & 1))) & 0xFF00u);"),
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
    (mutant,) = build_harness([src], tmp_path / "libs", quick=True)
    libs = [p for p in stub_env[HARNESS_ENV].split(os.pathsep) if Path(p).name != mutant.name]
    env = with_libraries(stub_env, [*libs, mutant])
    proc = run_on_stub_unchecked(env, checksum_case_body(CASE, 2, orders=("ascending",)), timeout=300)
    if BUGS[kind] is None:
        assert proc.returncode == 0 and "CHECK checksum ok" in proc.stdout, proc.stderr[-3000:]
        return
    assert proc.returncode != 0 and "CHECK checksum ok" not in proc.stdout, f"{kind} went unnoticed:\n{proc.stdout}"
    assert "AssertionError" in proc.stderr or "CudaError" in proc.stderr, proc.stderr[-2000:]
