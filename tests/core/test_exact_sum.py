"""Exact BF16 checksums (pagedkv.core.exact_sum) and HostBackend.reduce_bf16_blocks: each
result is the correctly rounded exact value, i.e. what math.fsum gives over the float64
values (or their float64 squares, which are exact), on data built to defeat float64
accumulation: huge and tiny values together, cancellation, subnormals."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from pagedkv import HostBackend
from pagedkv.core.exact_sum import (
    FLAG_NAN,
    FLAG_NEG_INF,
    FLAG_POS_INF,
    RESULT_WORDS,
    SSQ_DIGITS,
    SUM_DIGITS,
    bf16_stats,
    digits_value,
    stats_from_words,
)


def fsum_stats(bits: np.ndarray) -> tuple[float, float, float]:
    x = bits.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64).tolist()
    return math.fsum(x), math.fsum(v * v for v in x), math.fsum(abs(v) for v in x)


def finite_bits(rng, n: int) -> np.ndarray:
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    return bits[((bits >> 7) & 0xFF) != 0xFF]


def adversarial_sets():
    rng = np.random.default_rng(2024)
    big = np.array([0x7F7F, 0xFF7F], dtype=np.uint16)  # +-max finite, cancelling
    tiny = np.arange(1, 128, dtype=np.uint16)  # every positive subnormal
    yield "random", finite_bits(rng, 50_000)
    yield "huge cancels, tiny remains", np.concatenate([big, tiny, big[::-1], np.full(7, 0x8001, np.uint16)])
    yield "subnormals only", np.concatenate([tiny, tiny | 0x8000, tiny[:5]])
    yield "one huge many tiny", np.concatenate([np.full(1, 0x7F7F, np.uint16), np.full(4096, 0x0001, np.uint16)])
    yield "exact zero", np.concatenate([np.arange(0, 0x7F00, 97, dtype=np.uint16), np.arange(0, 0x7F00, 97, dtype=np.uint16) | 0x8000])
    yield "negative zeros", np.full(9, 0x8000, np.uint16)
    wide = rng.integers(0, 254, size=3000) << 7 | rng.integers(0, 128, size=3000)
    yield "every exponent", np.concatenate([wide, wide[:1500] | 0x8000]).astype(np.uint16)


@pytest.mark.parametrize("name,bits", list(adversarial_sets()), ids=[n for n, _ in adversarial_sets()])
def test_exact_stats_equal_fsum(name, bits):
    got = bf16_stats(bits)
    want = fsum_stats(bits)
    assert tuple(got) == want, (name, got, want)


def test_float64_accumulation_would_be_wrong_here():
    """The data above is adversarial: a plain float64 sum of it is not the exact answer."""
    bits = dict(adversarial_sets())["huge cancels, tiny remains"]
    x = bits.view(ml_dtypes.bfloat16).astype(np.float64)
    assert float(np.sum(x)) != math.fsum(x.tolist())
    assert bf16_stats(bits).sum == math.fsum(x.tolist()) == (127 * 128 / 2 - 7) * 2.0**-133


def test_order_does_not_matter():
    rng = np.random.default_rng(7)
    bits = finite_bits(rng, 20_000)
    first = bf16_stats(bits)
    for _ in range(3):
        assert bf16_stats(rng.permutation(bits)) == first


@pytest.mark.parametrize(
    "specials,want",
    [
        ([0x7FC0], (math.nan, math.nan, math.nan)),
        ([0x7F80, 0xFFC1], (math.nan, math.nan, math.nan)),
        ([0x7F80], (math.inf, math.inf, math.inf)),
        ([0xFF80, 0xFF80], (-math.inf, math.inf, math.inf)),
        ([0x7F80, 0xFF80], (math.nan, math.inf, math.inf)),
    ],
)
def test_non_finite_inputs(specials, want):
    bits = np.array([0x3F80, 0xC000, *specials], dtype=np.uint16)
    got = bf16_stats(bits)
    for g, w in zip(got, want):
        assert (math.isnan(g) and math.isnan(w)) or g == w, (got, want)


def test_result_words_layout_and_carry_save_digits():
    assert RESULT_WORDS == 2 * SUM_DIGITS + SSQ_DIGITS + 1 == 36
    assert digits_value([5, -1, 2]) == 5 - (1 << 32) + (2 << 64)
    # 1.0 = 2^133 units: digit 4 (bits 128..159) holds 2^5; its square 2^266 units: digit 8 holds 2^10
    words = [0] * RESULT_WORDS
    words[4] = 32
    words[SUM_DIGITS + 4] = 32
    words[2 * SUM_DIGITS + 8] = 1 << 10
    assert stats_from_words(words) == (1.0, 1.0, 1.0)
    words[-1] = FLAG_POS_INF | FLAG_NEG_INF
    s = stats_from_words(words)
    assert math.isnan(s.sum) and s.ssq == math.inf
    words[-1] = FLAG_NAN
    assert all(math.isnan(v) for v in stats_from_words(words))
    with pytest.raises(ValueError, match="36 words, got 35"):
        stats_from_words(words[:-1])


def test_host_backend_reduction_is_exact_and_checks_its_row():
    host = HostBackend(1 << 22)
    bits = dict(adversarial_sets())["random"][:8192]
    ptr = host.alloc(bits.nbytes + 64)
    host.copy_h2d(bits, ptr)
    regions = host.create_block_regions([(int(ptr), 2048, 2048)])
    got = host.reduce_bf16_blocks(regions, 0, [7, 0, 3], 0)
    picked = np.concatenate([bits[1024 * b : 1024 * (b + 1)] for b in (7, 0, 3)])
    assert tuple(got) == fsum_stats(picked)
    for rows, words in (
        ([(int(ptr) + 1, 2048, 2048)], "odd base address"),
        ([(int(ptr), 2047, 1024)], "odd block stride 2047"),
        ([(int(ptr), 2048, 1023)], "odd block size 1023"),
    ):
        with pytest.raises(ValueError, match=words):
            host.reduce_bf16_blocks(host.create_block_regions(rows), 0, [0], 0)


def test_host_backend_synchronize_all_is_part_of_the_contract():
    from pagedkv import GpuBackend

    host = HostBackend(1 << 20)
    assert host.synchronize_all() is None
    assert isinstance(host, GpuBackend) and hasattr(GpuBackend, "synchronize_all")
