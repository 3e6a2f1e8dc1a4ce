"""Planted kernel bugs for the mutation test: each `mutate(source, kind)` returns a copy of
a kernel source with one kind of bug in every kernel it declares, found by regex at
function-body starts and loop conditions (never by line number), so the mutations
survive edits to the kernels.

Kinds: `cta_does_nothing` (`if (blockIdx.x == 1) return;` first in each kernel),
`thread0_does_nothing` (`if (threadIdx.x == 0) return;`), `tail_off_by_one` (the last
`for` loop of each kernel stops one item early), `missing_syncthreads` (the first
`__syncthreads()` of the file is gone).
"""

from __future__ import annotations

import re

KINDS = ("cta_does_nothing", "thread0_does_nothing", "tail_off_by_one", "missing_syncthreads")

_KERNEL_HEAD = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?[A-Za-z_]\w*\s*\('
)
_FOR_CONDITION = re.compile(r"\bfor\s*\([^;]*;\s*([A-Za-z_]\w*)\s*<\s*([^;]+?)\s*;")
_SYNC = re.compile(r"__syncthreads\s*\(\s*\)\s*;")


class MutationNotApplicable(ValueError):
    """The source has nothing this kind of mutation can change (e.g. no __syncthreads)."""


def kernel_bodies(source: str) -> list[tuple[int, int]]:
    """(start, end) of each kernel's body: just after its `{` and at its matching `}`."""
    bodies = []
    for head in _KERNEL_HEAD.finditer(source):
        depth, i = 0, head.end() - 1
        while source[i] != "{" or depth:  # skip the parameter list's parentheses
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        start, depth = i + 1, 1
        i = start
        while depth:
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            i += 1
        bodies.append((start, i - 1))
    return bodies


def _at_body_starts(source: str, statement: str) -> str:
    out, at = [], 0
    for start, _ in kernel_bodies(source):
        out += [source[at:start], f"\n    {statement}"]
        at = start
    return "".join(out) + source[at:]


def _tail_off_by_one(source: str) -> str:
    out, at, changed = [], 0, 0
    for start, end in kernel_bodies(source):
        loops = list(_FOR_CONDITION.finditer(source, start, end))
        if not loops:
            continue
        last = loops[-1]
        out += [source[at:last.start(2)], f"({last.group(2)}) - 1"]
        at = last.end(2)
        changed += 1
    if not changed:
        raise MutationNotApplicable("no kernel has a `for (...; i < n; ...)` loop")
    return "".join(out) + source[at:]


def mutate(source: str, kind: str) -> str:
    """`source` with the `kind` bug planted; MutationNotApplicable when it cannot be."""
    if not kernel_bodies(source):
        raise MutationNotApplicable('no extern "C" __global__ kernel')
    if kind == "cta_does_nothing":
        return _at_body_starts(source, "if (blockIdx.x == 1) return;")
    if kind == "thread0_does_nothing":
        return _at_body_starts(source, "if (threadIdx.x == 0) return;")
    if kind == "tail_off_by_one":
        return _tail_off_by_one(source)
    if kind == "missing_syncthreads":
        sync = _SYNC.search(source)
        if sync is None:
            raise MutationNotApplicable("no __syncthreads()")
        return source[: sync.start()] + "/* planted: __syncthreads() removed */" + source[sync.end():]
    raise ValueError(f"unknown mutation kind {kind!r}; expected one of {KINDS}")
