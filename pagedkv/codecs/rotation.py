"""The Walsh-Hadamard rotation of turbo sides: y = signs2 * (H_n (signs1 * x)) / sqrt(n).

Computed as FORMATS.md fixes it, so a kernel following the same order gets the same bits:
signs1 applied, then the in-place butterfly in float32 with strides 1, 2, ..., n/2, each
pair (a, b) becoming (a + b, a - b), then one multiply by the float32 constant 1/sqrt(n),
then signs2. The inverse swaps the two sign tables. Sign tables ship as package data.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import numpy as np

ROTATED_HEAD_DIMS = (128, 256, 512)
"""Head sizes a turbo side rotates; any other head size is stored unrotated."""


@functools.cache
def sign_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(signs1, signs2) of the n-point rotation as float32 +-1 arrays (read-only)."""
    if n not in ROTATED_HEAD_DIMS:
        raise ValueError(f"no rotation sign table for head_dim {n}; tables exist for {ROTATED_HEAD_DIMS}")
    text = resources.files("pagedkv").joinpath("data/wht_signs.json").read_text(encoding="utf-8")
    tables = json.loads(text)
    out = []
    for which in ("signs1", "signs2"):
        chars = tables[f"{which}_{n}"]
        signs = np.array([1.0 if c == "+" else -1.0 for c in chars], dtype=np.float32)
        if signs.size != n or set(chars) - {"+", "-"}:
            raise ValueError(f"wht_signs.json {which}_{n} is not {n} '+'/'-' characters")
        signs.setflags(write=False)
        out.append(signs)
    return out[0], out[1]


def fwht(x: np.ndarray) -> np.ndarray:
    """H_n x over the last axis (natural order, unnormalised) by the float32 butterfly."""
    v = np.array(x, dtype=np.float32, copy=True)
    n = v.shape[-1]
    lead = v.shape[:-1]
    h = 1
    while h < n:
        pairs = v.reshape(*lead, n // (2 * h), 2, h)
        a = pairs[..., 0, :].copy()
        b = pairs[..., 1, :]
        pairs[..., 0, :] = a + b
        pairs[..., 1, :] = a - b
        h *= 2
    return v


def _transform(x: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    n = x.shape[-1]
    scale = np.float32(1.0 / np.sqrt(n))
    return (fwht(x * first) * scale) * last


def rotate(x: np.ndarray) -> np.ndarray:
    """The rotated float32 copy of `x` over its last axis (head_dim 128, 256 or 512; any other
    size is returned unchanged as float32)."""
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    if n not in ROTATED_HEAD_DIMS:
        return x.copy()
    signs1, signs2 = sign_tables(n)
    return _transform(x, signs1, signs2)


def unrotate(y: np.ndarray) -> np.ndarray:
    """The inverse of `rotate` over the last axis: x = signs1 * (H_n (signs2 * y)) / sqrt(n)."""
    y = np.asarray(y, dtype=np.float32)
    n = y.shape[-1]
    if n not in ROTATED_HEAD_DIMS:
        return y.copy()
    signs1, signs2 = sign_tables(n)
    return _transform(y, signs2, signs1)
