"""Exact checksums (sum, sum of squares and sum of |x|) of BF16 and float32 values in wide
fixed point.

Every finite BF16 value is `m * 2**(s - 133)` with an integer mantissa `m < 2**8` and a
shift `0 <= s <= 253`, so it is an integer multiple of 2**-133 and its square one of
2**-266. Adding those integers is exact and independent of order; the one rounding is the
final conversion to float64, which gives the correctly rounded exact result: what
`math.fsum` returns over the float64 values (or their float64 squares, which are exact).
Both backends produce the same integers (the GPU kernel as 32-bit digits held in int64
words with deferred carries) and turn them into `Bf16Stats` here.

Decoded KV values (every side format, pagedkv.diagnostics) are float32: every finite one
is `m * 2**(s - 149)` with `m < 2**24` and `0 <= s <= 253`, so the float32 layout widens
the units to 2**-149 for values and 2**-298 for squares (F32_* constants): 9 sum digits
as before, 18 square digits (a square's `m * m < 2**48` shifted spans three digits).

Non-finite inputs (exponent field 255) are not added; they are flagged instead:
- any NaN makes all three results NaN;
- otherwise +inf and -inf together make `sum` NaN, and either makes `ssq` and `sabs` +inf;
- otherwise infinities of one sign make `sum` that infinity.
An exactly zero sum is +0.0.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np


class Bf16Stats(NamedTuple):
    """Sum, sum of squares and sum of absolute values of BF16 values: each the correctly
    rounded float64 of the exact result (see this module's docstring for non-finite inputs)."""

    sum: float
    ssq: float
    sabs: float


SUM_SCALE_BITS = 133
"""A value's fixed-point integer is value * 2**SUM_SCALE_BITS."""

SSQ_SCALE_BITS = 2 * SUM_SCALE_BITS
"""A square's fixed-point integer is square * 2**SSQ_SCALE_BITS."""

DIGIT_BITS = 32
"""Bits per digit of the GPU's carry-save accumulators (each digit is an int64 word)."""

SUM_DIGITS = 9
"""Digits of the sum and sum-of-|x| accumulators (the largest shift 253 + 8 mantissa bits)."""

SSQ_DIGITS = 17
"""Digits of the sum-of-squares accumulator (the largest shift 506 + 16 bits)."""

FLAG_NAN, FLAG_POS_INF, FLAG_NEG_INF = 1, 2, 4
"""Bits of the non-finite flags word."""

RESULT_WORDS = 2 * SUM_DIGITS + SSQ_DIGITS + 1
"""int64 words of a reduction result: sum digits, sum-of-|x| digits, sum-of-squares digits, flags."""

F32_SUM_SCALE_BITS = 149
"""A float32 value's fixed-point integer is value * 2**F32_SUM_SCALE_BITS."""

F32_SSQ_SCALE_BITS = 2 * F32_SUM_SCALE_BITS
"""A float32 square's fixed-point integer is square * 2**F32_SSQ_SCALE_BITS."""

F32_SUM_DIGITS = 9
"""Digits of the float32 sum and sum-of-|x| accumulators (the largest shift 253 + 24 bits)."""

F32_SSQ_DIGITS = 18
"""Digits of the float32 sum-of-squares accumulator (the largest shift 506 + 48 bits)."""

F32_RESULT_WORDS = 2 * F32_SUM_DIGITS + F32_SSQ_DIGITS + 1
"""int64 words of a float32 reduction result (pagedkv_kv_checksum_*): sum digits,
sum-of-|x| digits, sum-of-squares digits, flags."""

_CHUNK = 1 << 22  # values per numpy pass: every float64 bin total stays an exact integer


def digits_value(digits: Sequence[int]) -> int:
    """The integer `sum(d_i * 2**(32 i))` of carry-save digits (each any signed int64)."""
    return sum(int(d) << (DIGIT_BITS * i) for i, d in enumerate(digits))


def stats_from_integers(
    total: int, squares: int, absolute: int, flags: int, scale_bits: int = SUM_SCALE_BITS
) -> Bf16Stats:
    """Bf16Stats of exact fixed-point integers (units 2**-scale_bits for the sum and the
    sum of |x|, 2**-(2 * scale_bits) for the squares: BF16's 133 unless told) and the
    non-finite flags, each rounded once to the nearest float64 (ties to even)."""
    if flags & FLAG_NAN:
        return Bf16Stats(math.nan, math.nan, math.nan)
    pos, neg = bool(flags & FLAG_POS_INF), bool(flags & FLAG_NEG_INF)
    if pos or neg:
        s = math.nan if pos and neg else (math.inf if pos else -math.inf)
        return Bf16Stats(s, math.inf, math.inf)
    # int / int true division is correctly rounded in CPython, whatever the sizes
    return Bf16Stats(
        total / (1 << scale_bits) + 0.0,
        squares / (1 << (2 * scale_bits)),
        absolute / (1 << scale_bits),
    )


def stats_from_words(words: Sequence[int]) -> Bf16Stats:
    """Bf16Stats of a GPU reduction result: RESULT_WORDS int64 words in the layout above."""
    if len(words) != RESULT_WORDS:
        raise ValueError(f"a reduction result has {RESULT_WORDS} words, got {len(words)}")
    total = digits_value(words[:SUM_DIGITS])
    absolute = digits_value(words[SUM_DIGITS : 2 * SUM_DIGITS])
    squares = digits_value(words[2 * SUM_DIGITS : 2 * SUM_DIGITS + SSQ_DIGITS])
    return stats_from_integers(total, squares, absolute, int(words[-1]))


def stats_from_f32_words(words: Sequence[int]) -> Bf16Stats:
    """Bf16Stats of a float32 reduction result: F32_RESULT_WORDS int64 words (sum digits,
    sum-of-|x| digits, sum-of-squares digits, flags) in units 2**-149 and 2**-298."""
    if len(words) != F32_RESULT_WORDS:
        raise ValueError(f"a float32 reduction result has {F32_RESULT_WORDS} words, got {len(words)}")
    total = digits_value(words[:F32_SUM_DIGITS])
    absolute = digits_value(words[F32_SUM_DIGITS : 2 * F32_SUM_DIGITS])
    squares = digits_value(words[2 * F32_SUM_DIGITS : 2 * F32_SUM_DIGITS + F32_SSQ_DIGITS])
    return stats_from_integers(total, squares, absolute, int(words[-1]), F32_SUM_SCALE_BITS)


def bf16_stats(bits: np.ndarray) -> Bf16Stats:
    """The exact checksums of BF16 values given as their uint16 bit patterns (any shape)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16).reshape(-1)
    exponent = (bits >> 7) & 0xFF
    flags = 0
    special = exponent == 0xFF
    if special.any():
        sb = bits[special]
        if (sb & 0x7F).any():
            flags |= FLAG_NAN
        if (sb == 0x7F80).any():
            flags |= FLAG_POS_INF
        if (sb == 0xFF80).any():
            flags |= FLAG_NEG_INF
        bits = bits[~special]
        exponent = exponent[~special]
    total = squares = absolute = 0
    for start in range(0, bits.size, _CHUNK):
        b = bits[start : start + _CHUNK]
        e = exponent[start : start + _CHUNK].astype(np.int64)
        mantissa = (b & 0x7F).astype(np.int64) | np.where(e > 0, 0x80, 0)
        shift = np.maximum(e - 1, 0)
        weights = mantissa.astype(np.float64)
        negative = (b & 0x8000) != 0
        pos = np.bincount(shift[~negative], weights=weights[~negative], minlength=254)
        neg = np.bincount(shift[negative], weights=weights[negative], minlength=254)
        sq = np.bincount(shift, weights=weights * weights, minlength=254)
        for s in np.flatnonzero(pos + neg + sq).tolist():
            p, n = int(pos[s]), int(neg[s])
            total += (p - n) << s
            absolute += (p + n) << s
            squares += int(sq[s]) << (2 * s)
    return stats_from_integers(total, squares, absolute, flags)


def float_stats(values: np.ndarray) -> Bf16Stats:
    """The exact checksums of float32 `values` (any shape), each correctly rounded to
    float64 once: `math.fsum` of the values, of their squares (exact in float64) and of
    their magnitudes. Non-finite values follow the rules of the module docstring; an exactly
    zero sum is +0.0."""
    x = np.asarray(values, dtype=np.float32).reshape(-1).astype(np.float64)
    if np.isnan(x).any():
        return Bf16Stats(math.nan, math.nan, math.nan)
    pos, neg = bool(np.isposinf(x).any()), bool(np.isneginf(x).any())
    if pos or neg:
        return Bf16Stats(math.nan if pos and neg else (math.inf if pos else -math.inf), math.inf, math.inf)
    return Bf16Stats(math.fsum(x.tolist()) + 0.0, math.fsum((x * x).tolist()) + 0.0, math.fsum(np.abs(x).tolist()) + 0.0)
