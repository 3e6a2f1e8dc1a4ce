"""Encoding and decoding of 16-element groups (FORMATS.md "Encoding one 16-element group").

Each function takes float32 groups shaped `[..., 16]` (or their codes and scales) and works
on all groups at once. Sums of squares are accumulated in float32 in element order, each
product and sum rounded on its own (no fused multiply-add), as the contract fixes.
"""

from __future__ import annotations

import numpy as np

from .codebooks import E2M1_VALUES, e2m1_magnitude_code, quantize
from .floats import E4M3_MAX, bf16_decode, bf16_encode, e4m3_decode, e4m3_encode

_TINY = np.float32(1e-12)


def sum_of_squares(x: np.ndarray) -> np.ndarray:
    """float32 sum of x[..., i]**2 over the last axis, added in element order 0, 1, 2, ..."""
    acc = np.zeros(x.shape[:-1], dtype=np.float32)
    for i in range(x.shape[-1]):
        term = x[..., i] * x[..., i]
        acc = acc + term
    return acc


def _amax(x: np.ndarray) -> np.ndarray:
    return np.max(np.abs(x), axis=-1)


def turbo_encode(x: np.ndarray, levels: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [..., 16], E4M3 scale bytes [...]) of the norm-matched turbo codec."""
    amax = _amax(x)
    largest = levels[-1]
    tiny = amax <= _TINY
    ratio = np.where(tiny, np.float32(1.0), largest / np.where(tiny, np.float32(1.0), amax))
    u = np.where(tiny[..., None], x, x * ratio[..., None])
    codes = quantize(u, bounds)
    x_norm = np.sqrt(sum_of_squares(x))
    level_norm = np.sqrt(sum_of_squares(levels[codes]))
    scale = np.minimum(x_norm / level_norm, E4M3_MAX)
    return codes, e4m3_encode(scale)


def turbo_decode(codes: np.ndarray, scales: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """float32 `levels[code] * e4m3(scale)` of turbo groups."""
    return levels[codes] * e4m3_decode(scales)[..., None]


def turbo8_encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 bytes [..., 16], BF16 scale bit patterns uint16 [...]) of turbo8 groups."""
    s = np.maximum(_amax(x) / E4M3_MAX, _TINY)
    data = e4m3_encode(x / s[..., None])
    return data, bf16_encode(s)


def turbo8_decode(data: np.ndarray, scale_bits: np.ndarray) -> np.ndarray:
    """float32 `e4m3(byte) * bf16(scale)` of turbo8 groups."""
    return e4m3_decode(data) * bf16_decode(scale_bits)[..., None]


def nvfp4_encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E2M1 nibbles uint8 [..., 16], E4M3 scale bytes [...]) of nvfp4 groups.

    The sign bit is always the sign of x (-0.0 is nibble 8); when the decoded scale is 0
    every magnitude is 0, so a negative value still gets nibble 8."""
    scale_bytes = e4m3_encode(_amax(x) / np.float32(6.0))
    d = e4m3_decode(scale_bytes)
    zero = d == 0
    safe_d = np.where(zero, np.float32(1.0), d)
    magnitude = e2m1_magnitude_code(np.abs(x) / safe_d[..., None])
    magnitude = np.where(zero[..., None], np.uint8(0), magnitude)
    sign = np.signbit(x).astype(np.uint8) << 3
    return (magnitude | sign).astype(np.uint8), scale_bytes


def nvfp4_decode(nibbles: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 `e2m1(nibble) * e4m3(scale)` of nvfp4 groups."""
    return E2M1_VALUES[nibbles] * e4m3_decode(scales)[..., None]

