"""The mutation test of the batched-copy kernel: planted bugs in copy_batch.cu (the
generic ones of kernel_harness.mutations, and ones aimed at this kernel: a byte tail one
short, a head byte skipped, the last word of a body dropped, the wrong range for a chunk,
the chunk offset off by one) each make the copy_batch check over the stub fail, and the
same pipeline on the unmutated source passes. As in test_kernel_mutations.py, NVRTC still
compiles the real source; only the code the harness executes is mutated.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernel_harness.build import HARNESS_ENV
from kernel_harness.mutations import MutationNotApplicable, mutate
from kernel_harness.stub import build_harness, run_on_stub, run_on_stub_unchecked, with_libraries
from kernel_harness.swap_checks import copy_batch_body

FILENAME = "copy_batch.cu"
SMS = 2
ORDERS = ("ascending",)

# (name, text in copy_batch.cu, its planted replacement): each text occurs exactly once
TARGETED = [
    ("byte_tail_short", "b < nbytes; b += blockDim.x", "b + 1 < nbytes; b += blockDim.x"),
    ("head_byte_skipped", "if (threadIdx.x < head)", "if (threadIdx.x + 1 < head)"),
    ("last_word_dropped", "if (w < nwords) out[w] = v[u];", "if (w + 1 < nwords) out[w] = v[u];"),
    ("wrong_range", "if (first[mid] <= item) lo = mid;", "if (first[mid] < item) lo = mid;"),
    ("chunk_offset_off", "const u64 offset = (item - first[r]) * (u64)chunk;",
     "const u64 offset = (item - first[r]) * (u64)chunk + (item > first[r]);"),
]
GENERIC = ("cta_does_nothing", "thread0_does_nothing", "tail_off_by_one")


def _source() -> str:
    from pagedkv.driver import nvrtc

    return (nvrtc.SOURCE_DIR / FILENAME).read_text()


def _env_with(stub_env: dict, tmp: Path, text: str) -> dict:
    """stub_env with copy_batch.cu's harness library built from `text`."""
    src = tmp / "src"
    src.mkdir(parents=True)
    (src / FILENAME).write_text(text)
    (lib,) = build_harness([src / FILENAME], tmp / "libs", quick=True)
    libs = [p for p in stub_env[HARNESS_ENV].split(os.pathsep) if Path(p).name != lib.name]
    assert len(libs) == len(stub_env[HARNESS_ENV].split(os.pathsep)) - 1, libs
    return with_libraries(stub_env, [*libs, lib])


def test_unmutated_copy_passes(stub_env, tmp_path):
    env = _env_with(stub_env, tmp_path, _source())
    assert "CHECK copy_batch ok" in run_on_stub(env, copy_batch_body(SMS, "kernel", ORDERS), timeout=300)


def _planted(kind: str) -> str:
    source = _source()
    for name, text, replacement in TARGETED:
        if name == kind:
            assert source.count(text) == 1, (kind, text)
            return source.replace(text, replacement)
    try:
        return mutate(source, kind)
    except MutationNotApplicable as err:
        pytest.fail(f"{kind} cannot be planted in {FILENAME}: {err}")


KINDS = [*GENERIC, *(name for name, _, _ in TARGETED)]


@pytest.mark.parametrize("kind", KINDS)
def test_planted_bug_fails_the_check(stub_env, tmp_path, kind):
    env = _env_with(stub_env, tmp_path, _planted(kind))
    proc = run_on_stub_unchecked(env, copy_batch_body(SMS, "kernel", ORDERS), timeout=300)
    assert proc.returncode != 0 and "CHECK copy_batch ok" not in proc.stdout, (
        f"{kind} planted in {FILENAME} went unnoticed:\n{proc.stdout}\n{proc.stderr[-2000:]}"
    )
    assert "AssertionError" in proc.stderr or "CudaError" in proc.stderr, proc.stderr[-2000:]
