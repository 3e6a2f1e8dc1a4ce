"""The mutation test of the kernel harness: planted kernel bugs (a CTA that does nothing,
thread 0 that does nothing, a tail off by one, a missing __syncthreads) each make the
kernel's check over the stub fail, and the same pipeline on the unmutated sources passes.
Each mutant is a copy of pagedkv/nvrtc_src with the bug in every kernel of one file,
built into its own harness libraries and run in a subprocess (NVRTC still compiles the
real sources: only the code the harness executes is mutated). What a passing run shows is
that the harness and the checks of tests/kernel_harness/checks.py see these bugs; it is
no GPU (no memory model, no concurrency between CTAs, no timing).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernel_harness.build import HARNESS_ENV
from kernel_harness.checks import check_body
from kernel_harness.mutations import KINDS, MutationNotApplicable, mutate
from kernel_harness.stub import build_harness, run_on_stub, run_on_stub_unchecked, with_libraries

SOURCE_CHECKS = {"fill_blocks.cu": "fill", "copy_blocks.cu": "copy", "reduce_bf16.cu": "reduce"}
SMS = 2


def _sources() -> dict[str, Path]:
    from pagedkv.driver import nvrtc

    sources = {p.name: p for p in nvrtc.kernel_sources()}
    assert set(SOURCE_CHECKS) <= set(sources), sorted(sources)
    return sources


def _copies(tmp: Path, texts: dict[str, str]) -> list[Path]:
    """The kernel libraries of `texts` (file name -> source text) built under `tmp`."""
    src_dir = tmp / "src"
    src_dir.mkdir(parents=True)
    copies = []
    for name, text in sorted(texts.items()):
        copy = src_dir / name
        copy.write_text(text)
        copies.append(copy)
    return build_harness(copies, tmp / "libs", quick=True)


def _with_mutant(stub_env: dict, tmp: Path, filename: str, text: str) -> dict:
    """stub_env with the library of `filename` replaced by one built from `text`."""
    (mutant,) = _copies(tmp, {filename: text})
    libs = [p for p in stub_env[HARNESS_ENV].split(os.pathsep) if Path(p).name != mutant.name]
    assert len(libs) == len(_sources()) - 1, (libs, mutant.name)
    return with_libraries(stub_env, [*libs, mutant])


def test_unmutated_copies_pass_every_check(stub_env, tmp_path):
    env = with_libraries(stub_env, _copies(tmp_path, {n: p.read_text() for n, p in _sources().items()}))
    for check in SOURCE_CHECKS.values():
        assert f"CHECK {check} ok" in run_on_stub(env, check_body(check, SMS))


MUTANTS = [
    (kind, name)
    for kind in KINDS
    for name in SOURCE_CHECKS
    if kind != "missing_syncthreads" or name == "reduce_bf16.cu"
]


@pytest.mark.parametrize("kind,filename", MUTANTS, ids=[f"{k}-{f.split('.')[0]}" for k, f in MUTANTS])
def test_planted_bug_fails_its_check(stub_env, tmp_path, kind, filename):
    try:
        mutant = mutate(_sources()[filename].read_text(), kind)
    except MutationNotApplicable as err:
        pytest.fail(f"{kind} cannot be planted in {filename}: {err}")
    env = _with_mutant(stub_env, tmp_path, filename, mutant)
    check = SOURCE_CHECKS[filename]
    proc = run_on_stub_unchecked(env, check_body(check, SMS))
    assert proc.returncode != 0 and f"CHECK {check} ok" not in proc.stdout, (
        f"{kind} planted in {filename} went unnoticed by the {check} check:\n{proc.stdout}\n{proc.stderr[-2000:]}"
    )
    # it failed on a wrong result or a launch fault, not on something unrelated
    assert "AssertionError" in proc.stderr or "CudaError" in proc.stderr, proc.stderr[-2000:]


SYNTHETIC = '''__device__ int helper(int n) { for (int i = 0; i < n; i++) {} return n; }
extern "C" __global__ void __launch_bounds__(256) first(const int* p, int n)
{
    for (int w = 0; w < n; w++) { if (p[w]) { } }
    for (int j = 0; j < LIMBS; j++) {}
    __syncthreads();
    __syncthreads();
}
extern "C" __global__ void second(int m) { for (long b = 0; b < m * 2; b += 1) {} }
'''


def test_mutations_land_in_every_kernel_and_nowhere_else():
    cta = mutate(SYNTHETIC, "cta_does_nothing")
    assert cta.count("if (blockIdx.x == 1) return;") == 2
    assert cta.index("int n)\n{\n    if (blockIdx.x == 1) return;") > 0 and "void second(int m) {\n    if (blockIdx" in cta
    thread0 = mutate(SYNTHETIC, "thread0_does_nothing")
    assert thread0.count("if (threadIdx.x == 0) return;") == 2
    tail = mutate(SYNTHETIC, "tail_off_by_one")
    assert "w < (n) - 1" in tail and "b < (m * 2) - 1" in tail
    assert "i < n;" in tail and "j < LIMBS;" in tail, "helpers and constant bounds are left alone"
    sync = mutate(SYNTHETIC, "missing_syncthreads")
    assert sync.count("__syncthreads();") == 1 and "planted" in sync
    with pytest.raises(MutationNotApplicable):
        mutate("__device__ void f() {}", "cta_does_nothing")
    with pytest.raises(MutationNotApplicable):
        mutate('extern "C" __global__ void k() {}', "missing_syncthreads")
    with pytest.raises(ValueError, match="unknown mutation kind 'nope'"):
        mutate(SYNTHETIC, "nope")
