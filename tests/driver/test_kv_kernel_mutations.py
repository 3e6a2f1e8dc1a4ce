"""Planted bugs in the KV row kernels (nvrtc_src/kv_rows.cu) each fail the byte-exact KV
check over the stub: the generic ones of kernel_harness.mutations (a CTA or thread 0 that
does nothing, a missing __syncthreads) and codec ones (E4M3 rounding ties down instead of
to even, a butterfly with its difference reversed within a lane and across lanes, BF16
rounding truncating, -1 slots not skipped, a set's scale bytes gathered from the wrong
lanes, the sum of squares of a group skipping a lane's part, the one-path kernels' batches
shifted wrong, an HND side addressed as NHD, an HND head chunk's size without its scales, the few-token
unit's fp8 bytes 8 bytes off, its -1 slots not skipped, its -1 rows -0.0) and read-only ones (the nvfp4
sign flipped in the decode, -1 rows -0.0). Only the code the harness executes is mutated; NVRTC compiles the real source.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernel_harness.build import HARNESS_ENV
from kernel_harness.kv_checks import kv_case_body
from kernel_harness.mutations import mutate
from kernel_harness.stub import build_harness, run_on_stub_unchecked, with_libraries

SOURCE = "kv_rows.cu"
CASE = "all_formats_hd128_bs16_f32"

CODEC_BUGS = {
    "e4m3_ties_down": ("(t + 0x7FFFFu + ((t >> 20) & 1u)) >> 20", "(t + 0x7FFFFu) >> 20"),
    "butterfly_reversed": ("x[j + h] = a - b;", "x[j + h] = b - a;"),
    "butterfly_lanes_reversed": ("x[j] = upper ? other - x[j] : x[j] + other;", "x[j] = upper ? x[j] - other : x[j] + other;"),
    "bf16_truncates": ("return (t + 0x7FFFu + ((t >> 16) & 1u)) >> 16;", "return t >> 16;"),
    "read_nvfp4_sign_flipped": ("out[i] = (code & 8u ? -m : m) * dq;", "out[i] = (code & 8u ? m : -m) * dq;"),
    "read_skip_row_not_zeroed": ("        for (int k = 0; k < 16; k++) x[k] = 0.0f;\n    }\n    store_elems<16>",
                                 "        for (int k = 0; k < 16; k++) x[k] = -0.0f;\n    }\n    store_elems<16>"),
    "skip_slot_ignored": ("    const bool valid = slot >= 0 && slot < limit;\n    float x[16];",
                          "    const bool valid = slot >= -1 && slot < limit;\n    float x[16];"),
    "group_scale_gather_off": ("const u64 sword = gather_word<SF == 8 ? 9 : 5, 1, 8>(sb, SF, sub, 8);",
                               "const u64 sword = gather_word<SF == 8 ? 9 : 5, 1, 8>(sb, SF, sub ^ 1, 8);"),
    "ssq_chain_skips_a_lane": ("                x_ssq = __shfl_sync(FULL_MASK, x_ssq, group_lane + k);",
                               "                x_ssq = __shfl_sync(FULL_MASK, x_ssq, group_lane + (k ? k - 1 : 0));"),
    # the one-path kernels' batches: the head batch's last unit computed twice (seen only when
    # a batch runs full), the group batch's first unit computed again
    "head_batch_last_not_shifted": ("for (int c = 0; c + 1 < B; c++) in[c] = in[c + 1];",
                                    "for (int c = 0; c + 1 < B; c++) if (c + 2 < B) in[c] = in[c + 1];"),
    "group_batch_not_shifted": ("for (int c = 0; c + 1 < GROUP_BATCH; c++) in[c] = in[c + 1];",
                                "for (int c = 0; c + 1 < GROUP_BATCH; c++) in[c] = in[c + (c > 0)];"),
    # the HND address path: an HND side run as one NHD side, a head chunk's scales left out of
    # the chunk's size
    "hnd_read_as_nhd": ("*chunks = hnd && S.fmt >= 0 ? S.heads : 1;", "*chunks = 1;"),
    # the rows of a few tokens a unit (tokens_unit): an odd fp8 lane's 16 bytes 8 bytes off
    "tokens_unit_fp8_offset": ("const int foff = odd ? off[1] - 8 : off[0];", "const int foff = odd ? off[1] : off[0];"),
    "tokens_unit_skip_ignored": ("valid[q] = slot[q] >= 0 && slot[q] < limit;", "valid[q] = slot[q] >= -1 && slot[q] < limit;"),
    "tokens_unit_skip_row_not_zeroed": ("* S.scale : 0.0f;", "* S.scale : -0.0f;"),
    "hnd_chunk_without_scales": ("S.pool += (u64)(h * (g.data_section + g.scale_row_bytes * block_size));",
                                 "S.pool += (u64)(h * g.data_section);"),
}
KINDS = ["cta_does_nothing", "thread0_does_nothing", "missing_syncthreads", *CODEC_BUGS]
CASE_OF = {"head_batch_last_not_shifted": "batched_hd128_16heads_bf16", "group_batch_not_shifted": "batched_hd128_16heads_bf16",
           "hnd_read_as_nhd": "hnd_all_formats_hd128_bs16_f32", "hnd_chunk_without_scales": "hnd_all_formats_hd128_bs16_f32",
           "tokens_unit_fp8_offset": "hnd_all_formats_hd128_bs16_f32",
           # the chunk path's bugs: a case whose BF16 rows are not 16-byte aligned
           "skip_slot_ignored": "all_formats_hd64_bs1_bf16_strided",
           "read_skip_row_not_zeroed": "all_formats_hd64_bs1_bf16_strided"}
"""Bugs that need another case than CASE (full batches: 16 heads; HND blocks)."""


def _planted(text: str, kind: str) -> str:
    if kind in CODEC_BUGS:
        old, new = CODEC_BUGS[kind]
        assert text.count(old) == 1, f"{kind}: {old!r} must occur once in {SOURCE}"
        return text.replace(old, new)
    return mutate(text, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_planted_kv_bug_fails_the_kv_check(stub_env, tmp_path, kind):
    from pagedkv.driver import nvrtc

    src = tmp_path / "src" / SOURCE
    src.parent.mkdir()
    src.write_text(_planted((nvrtc.SOURCE_DIR / SOURCE).read_text(), kind))
    (mutant,) = build_harness([src], tmp_path / "libs", quick=True)
    libs = [p for p in stub_env[HARNESS_ENV].split(os.pathsep) if Path(p).name != mutant.name]
    env = with_libraries(stub_env, [*libs, mutant])
    # the row kernels' one barrier publishes the shared codebooks: with threads in ascending
    # order thread 0's first reads may come after the others' copies, so that bug needs the
    # descending order to show
    orders = ("descending",) if kind == "missing_syncthreads" else ("ascending",)
    proc = run_on_stub_unchecked(env, kv_case_body(CASE_OF.get(kind, CASE), orders=orders), timeout=300)
    assert proc.returncode != 0 and "CHECK kv ok" not in proc.stdout, f"{kind} went unnoticed:\n{proc.stdout}"
    assert "AssertionError" in proc.stderr or "CudaError" in proc.stderr, proc.stderr[-2000:]
