"""The float32 levels and decision bounds of the turbo codebooks and the E2M1 table (FORMATS.md).

A turbo value's code is the number of bounds at or below it; the bounds are contract
constants, not recomputed midpoints.
"""

from __future__ import annotations

import numpy as np

from ..core.dtype import KvCacheDtype

TURBO4_LEVELS = np.array(
    [-2.7326, -2.0690, -1.6180, -1.2562, -0.9423, -0.6568, -0.3880, -0.1284,
     0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
    dtype=np.float32,
)
TURBO4_BOUNDS = np.array(
    [-2.4008, -1.8435, -1.4371, -1.0993, -0.7996, -0.5224, -0.2582, 0.0,
     0.2582, 0.5224, 0.7996, 1.0993, 1.4371, 1.8435, 2.4008],
    dtype=np.float32,
)
TURBO3_LEVELS = np.array(
    [-2.1520, -1.3440, -0.7560, -0.2451, 0.2451, 0.7560, 1.3440, 2.1520], dtype=np.float32
)
TURBO3_BOUNDS = np.array([-1.748, -1.050, -0.501, 0.0, 0.501, 1.050, 1.748], dtype=np.float32)
TURBO2_LEVELS = np.array([-1.5104, -0.4528, 0.4528, 1.5104], dtype=np.float32)
TURBO2_BOUNDS = np.array([-0.9816, 0.0, 0.9816], dtype=np.float32)

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
"""E2M1 value of nibble bits 0-2; bit 3 is the sign."""

E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
"""Value of every nibble 0..15 (nibble 8 is -0.0)."""

# Midpoints between adjacent E2M1 magnitudes, split by the direction a tie rounds (to the
# even index): a tie at a "down" midpoint keeps the lower magnitude, at an "up" one the upper.
E2M1_TIES_DOWN = np.array([0.25, 1.25, 2.5, 5.0], dtype=np.float32)
E2M1_TIES_UP = np.array([0.75, 1.75, 3.5], dtype=np.float32)

_TURBO_CODEBOOKS = {
    KvCacheDtype.TURBO4: (TURBO4_LEVELS, TURBO4_BOUNDS),
    KvCacheDtype.TURBO3: (TURBO3_LEVELS, TURBO3_BOUNDS),
    KvCacheDtype.TURBO2: (TURBO2_LEVELS, TURBO2_BOUNDS),
}


def turbo_codebook(fmt: KvCacheDtype) -> tuple[np.ndarray, np.ndarray]:
    """(levels, bounds) of turbo4, turbo3 or turbo2 as float32 arrays."""
    return _TURBO_CODEBOOKS[fmt]


def quantize(u: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """uint8 codes of float32 `u`: the number of `bounds` at or below each value."""
    return np.searchsorted(bounds, u, side="right").astype(np.uint8)


def e2m1_magnitude_code(a: np.ndarray) -> np.ndarray:
    """uint8 E2M1 magnitude index (0..7) of non-negative float32 `a`, rounded to nearest even
    and saturating at 6."""
    down = (a[..., None] > E2M1_TIES_DOWN).sum(axis=-1)
    up = (a[..., None] >= E2M1_TIES_UP).sum(axis=-1)
    return (down + up).astype(np.uint8)
