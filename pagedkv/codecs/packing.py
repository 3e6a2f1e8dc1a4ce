"""Bit packing of codes into bytes, first code in the lowest bits (FORMATS.md "Packing").

Every function works on a uint8 array whose last axis is a whole number of 16-code groups
and maps it to / from that row's packed bytes.
"""

from __future__ import annotations

import numpy as np


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 `codes` (last axis a multiple of 8) at `bits` (4, 3 or 2) per code."""
    codes = np.asarray(codes, dtype=np.uint8)
    lead = codes.shape[:-1]
    if bits == 4:
        pairs = codes.reshape(*lead, -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(*lead, -1)
    if bits == 2:
        quads = codes.reshape(*lead, -1, 4)
        packed = quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)
        return packed.reshape(*lead, -1)
    if bits == 3:
        runs = codes.reshape(*lead, -1, 8).astype(np.uint32)
        word = np.zeros(runs.shape[:-1], dtype=np.uint32)
        for k in range(8):
            word |= runs[..., k] << (3 * k)
        little_endian = np.stack([(word >> (8 * b)) & 0xFF for b in range(3)], axis=-1)
        return little_endian.astype(np.uint8).reshape(*lead, -1)
    raise ValueError(f"cannot pack {bits}-bit codes; expected 4, 3 or 2")


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """The uint8 codes `pack(codes, bits)` was given."""
    packed = np.asarray(packed, dtype=np.uint8)
    lead = packed.shape[:-1]
    if bits == 4:
        return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*lead, -1)
    if bits == 2:
        return np.stack([(packed >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-1).reshape(*lead, -1)
    if bits == 3:
        triples = packed.reshape(*lead, -1, 3).astype(np.uint32)
        word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
        codes = np.stack([(word >> (3 * k)) & 0x07 for k in range(8)], axis=-1)
        return codes.astype(np.uint8).reshape(*lead, -1)
    raise ValueError(f"cannot unpack {bits}-bit codes; expected 4, 3 or 2")
