"""E4M3 and BF16 conversions of FORMATS.md: round to nearest even, E4M3 saturating at +-448."""

from __future__ import annotations

import numpy as np

from ..core.lazy_dtypes import ml

E4M3_MAX = np.float32(448.0)
"""The largest finite OCP FP8 E4M3 value; encoding saturates to +-E4M3_MAX."""


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """uint8 E4M3 bytes of float32 `x`: clamped to +-448, then rounded to nearest even."""
    clamped = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return clamped.astype(ml().float8_e4m3fn).view(np.uint8)


def e4m3_decode(raw: np.ndarray) -> np.ndarray:
    """float32 values of uint8 E4M3 bytes (0x7F and 0xFF decode to NaN)."""
    return np.asarray(raw, dtype=np.uint8).view(ml().float8_e4m3fn).astype(np.float32)


def bf16_encode(x: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of float32 `x` rounded to nearest-even BF16 (store little-endian)."""
    return np.asarray(x, dtype=np.float32).astype(ml().bfloat16).view(np.uint16)


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    """float32 values of uint16 BF16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
