"""The codecs against a scalar, step-by-step reading of FORMATS.md (bit-exact), the rotation,
the reference error figures, and every refused input."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from pagedkv.codecs import decode, encode, rotate, unrotate
from pagedkv.codecs.rotation import fwht, sign_tables

F32 = np.float32
LEVELS = {
    "turbo4": [-2.7326, -2.0690, -1.6180, -1.2562, -0.9423, -0.6568, -0.3880, -0.1284,
               0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
    "turbo3": [-2.1520, -1.3440, -0.7560, -0.2451, 0.2451, 0.7560, 1.3440, 2.1520],
    "turbo2": [-1.5104, -0.4528, 0.4528, 1.5104],
}
BOUNDS = {
    "turbo4": [-2.4008, -1.8435, -1.4371, -1.0993, -0.7996, -0.5224, -0.2582, 0.0,
               0.2582, 0.5224, 0.7996, 1.0993, 1.4371, 1.8435, 2.4008],
    "turbo3": [-1.748, -1.050, -0.501, 0.0, 0.501, 1.050, 1.748],
    "turbo2": [-0.9816, 0.0, 0.9816],
}
BITS = {"turbo4": 4, "turbo3": 3, "turbo2": 2}


def e4m3_byte(v: np.float32) -> int:
    v = min(max(float(v), -448.0), 448.0)
    return int(np.array([v], F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0])


def e4m3_value(byte: int) -> np.float32:
    return F32(np.array([byte], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)[0])


def scalar_turbo(x: list, fmt: str) -> bytes:
    """One group, one element at a time, in the order the contract states."""
    levels = [F32(v) for v in LEVELS[fmt]]
    bounds = [F32(v) for v in BOUNDS[fmt]]
    amax = F32(0)
    for v in x:
        amax = max(amax, F32(abs(v)))
    codes = []
    for v in x:
        u = v if amax <= F32(1e-12) else F32(v * F32(levels[-1] / amax))
        codes.append(sum(1 for b in bounds if b <= u))
    ssq_x, ssq_l = F32(0), F32(0)
    for v, c in zip(x, codes):
        ssq_x = F32(ssq_x + F32(v * v))
        ssq_l = F32(ssq_l + F32(levels[c] * levels[c]))
    s = min(F32(F32(np.sqrt(ssq_x)) / F32(np.sqrt(ssq_l))), F32(448))
    bits = BITS[fmt]
    word = 0
    for k, c in enumerate(codes):
        word |= c << (bits * k)
    return word.to_bytes(16 * bits // 8, "little") + bytes([e4m3_byte(s)])


def scalar_nvfp4(x: list) -> bytes:
    amax = max(F32(abs(v)) for v in x)
    scale = e4m3_byte(F32(amax / F32(6)))
    d = e4m3_value(scale)
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    nibbles = []
    for v in x:
        mag = 0
        if d != 0:
            a = float(F32(abs(v) / d))
            best = min(range(8), key=lambda i: (abs(grid[i] - a), i % 2))  # nearest, ties to even
            mag = best
        nibbles.append(mag | (8 if math.copysign(1.0, float(v)) < 0 else 0))
    return bytes(nibbles[2 * j] | nibbles[2 * j + 1] << 4 for j in range(8)) + bytes([scale])


def scalar_turbo8(x: list) -> bytes:
    amax = max(F32(abs(v)) for v in x)
    s = max(F32(amax / F32(448)), F32(1e-12))
    data = bytes(e4m3_byte(F32(v / s)) for v in x)
    return data + np.array([s], F32).astype(ml_dtypes.bfloat16).tobytes()


def awkward_groups(seed: int, count: int) -> np.ndarray:
    """Gaussian, heavy-tailed, tiny, huge, zero and bound-hitting groups."""
    rng = np.random.default_rng(seed)
    groups = [rng.standard_normal((count, 16)), rng.standard_t(2, (count, 16)) * 30]
    groups.append(rng.standard_normal((count // 4, 16)) * 1e-6)
    groups.append(rng.standard_normal((count // 4, 16)) * 3e3)
    groups.append(np.zeros((2, 16)))
    sparse = rng.standard_normal((count // 4, 16))
    sparse[rng.random(sparse.shape) < 0.7] = 0.0
    groups.append(sparse)
    return np.concatenate(groups).astype(F32)


@pytest.mark.parametrize("fmt", ["turbo4", "turbo3", "turbo2", "nvfp4", "turbo8"])
def test_vectorised_codec_matches_the_scalar_reading_bit_for_bit(fmt):
    groups = awkward_groups(3, 60)
    raw = encode(groups.reshape(1, 1, -1), fmt, rotate=False)
    n = groups.shape[0]
    data_size = {"nvfp4": 8, "turbo8": 16}.get(fmt, 2 * BITS.get(fmt, 0))
    scale_size = 2 if fmt == "turbo8" else 1
    scalar = {"nvfp4": scalar_nvfp4, "turbo8": scalar_turbo8}.get(fmt, lambda g: scalar_turbo(g, fmt))
    for g in range(n):
        want = scalar([F32(v) for v in groups[g]])
        got = raw[g * data_size : (g + 1) * data_size] + raw[n * data_size + g * scale_size :][:scale_size]
        assert got == want, (g, groups[g])


# -- rotation --------------------------------------------------------------------------------


def sylvester(n: int) -> np.ndarray:
    i = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 128, 512])
def test_butterfly_is_the_natural_order_hadamard(n):
    x = np.random.default_rng(n).integers(-50, 50, (3, n)).astype(F32)
    np.testing.assert_array_equal(fwht(x), x @ sylvester(n).T)


def test_known_small_hadamard():
    assert fwht(np.array([1, 2, 3, 4], F32)).tolist() == [10, -2, -4, 0]


def scalar_rotate(x: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    v = [F32(a * s) for a, s in zip(x, first)]
    n, h = len(v), 1
    while h < n:
        for start in range(0, n, 2 * h):
            for j in range(start, start + h):
                a, b = v[j], v[j + h]
                v[j], v[j + h] = F32(a + b), F32(a - b)
        h *= 2
    c = F32(1.0 / math.sqrt(n))
    return np.array([F32(F32(a * c) * s) for a, s in zip(v, last)], F32)


@pytest.mark.parametrize("n", [128, 256, 512])
def test_rotation_follows_the_contract_order_bit_for_bit(n):
    x = np.random.default_rng(n).standard_normal((2, n)).astype(F32) * 3
    s1, s2 = sign_tables(n)
    got = rotate(x)
    back = unrotate(x)
    for row in range(2):
        np.testing.assert_array_equal(got[row], scalar_rotate(x[row], s1, s2))
        np.testing.assert_array_equal(back[row], scalar_rotate(x[row], s2, s1))


@pytest.mark.parametrize("n", [128, 256, 512])
def test_rotation_is_the_signed_orthogonal_hadamard(n):
    s1, s2 = sign_tables(n)
    matrix = rotate(np.eye(n, dtype=F32))  # row i = R e_i, so this is R transposed
    expected = (s2[:, None] * sylvester(n) * s1[None, :] / math.sqrt(n)).T
    np.testing.assert_allclose(matrix, expected, atol=1e-6)
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(n), atol=1e-5)


@pytest.mark.parametrize("n", [128, 256, 512])
def test_rotation_round_trip_within_float32_rounding(n):
    x = np.random.default_rng(5).standard_normal((4, 3, n)).astype(F32)
    back = unrotate(rotate(x))
    np.testing.assert_allclose(back, x, rtol=0, atol=8 * np.finfo(F32).eps * np.abs(x).max())
    assert np.abs(back - x).max() > 0 or n == 256  # 1/16 is exact: 256 returns x bit for bit


@pytest.mark.parametrize("n", [16, 64, 96, 1024])
def test_other_head_sizes_are_not_rotated(n):
    x = np.random.default_rng(n).standard_normal((2, n)).astype(F32)
    np.testing.assert_array_equal(rotate(x), x)
    np.testing.assert_array_equal(unrotate(x), x)


def test_sign_tables_ship_with_the_package():
    s1, s2 = sign_tables(128)
    assert s1[:8].tolist() == [-1, 1, 1, -1, -1, 1, -1, 1]
    assert s2[:8].tolist() == [1, 1, 1, 1, -1, 1, 1, -1]
    for n in (128, 256, 512):
        for table in sign_tables(n):
            assert table.shape == (n,) and set(np.unique(table).tolist()) == {-1.0, 1.0}


# -- reference error figures (FORMATS.md: 3.2M samples, seed 0, no rotation) ----------------

GAUSSIAN = {"turbo4": 0.0059, "turbo3": 0.0242, "turbo2": 0.129, "nvfp4": 0.0090, "fp8": 0.0007}
STUDENT_T3 = {"turbo4": 0.0084, "turbo3": 0.045, "turbo2": 0.253, "nvfp4": 0.0081}


@pytest.fixture(scope="module")
def samples():
    rng = np.random.default_rng(0)
    gaussian = rng.standard_normal(3_200_000).astype(F32).reshape(-1, 1, 128)
    student = rng.standard_t(3, 3_200_000).astype(F32).reshape(-1, 1, 128)
    return {"gaussian": gaussian, "student_t3": student}


@pytest.mark.parametrize(
    "dist, fmt, figure",
    [("gaussian", f, v) for f, v in GAUSSIAN.items()] + [("student_t3", f, v) for f, v in STUDENT_T3.items()],
)
def test_relative_mse_matches_the_reference_figures(samples, dist, fmt, figure):
    x = samples[dist]
    out = decode(encode(x, fmt, rotate=False), fmt, x.shape[0], 1, 128, unrotate=False)
    rel = float(np.mean((out.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2))
    assert abs(rel - figure) <= 0.03 * figure, (dist, fmt, rel)


# -- refused inputs --------------------------------------------------------------------------


def block(shape=(1, 1, 16), dtype=F32):
    return np.ones(shape, dtype=dtype)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: encode(block(), "turbo4k_turbo3v"), ValueError, "asymmetric"),
        (lambda: encode(block(), "turbo9"), ValueError, "turbo9"),
        (lambda: encode(block((1, 2, 24)), "turbo4"), ValueError, "head_dim 24"),
        (lambda: encode(block((1, 2, 8)), "nvfp4"), ValueError, "head_dim 8"),
        (lambda: encode(block(dtype=np.float16), "bf16"), TypeError, "float16"),
        (lambda: encode(block(dtype=np.float64), "fp8"), TypeError, "float64"),
        (lambda: encode([[[1.0] * 16]], "fp8"), TypeError, "numpy array"),
        (lambda: encode(block((16,)), "turbo4"), ValueError, "(16,)"),
        (lambda: encode(np.full((1, 1, 16), np.nan, F32), "bf16"), ValueError, "nan"),
        (lambda: encode(np.full((1, 1, 16), -np.inf, F32), "turbo8"), ValueError, "-inf"),
        (lambda: encode(block(), "fp8", scale=0.0), ValueError, "0.0"),
        (lambda: encode(block(), "fp8", scale=float("nan")), ValueError, "nan"),
        (lambda: decode(bytes(8), "turbo4", 1, 1, 16), ValueError, "got 8"),
        (lambda: decode(bytes(9), "turbo4", 0, 1, 16), ValueError, "block_size"),
        (lambda: decode(bytes(9), "turbo4", 1, 1, 20), ValueError, "head_dim 20"),
        (lambda: decode(bytes(9), "bf16k_turbo4v", 1, 1, 16), ValueError, "asymmetric"),
    ],
)
def test_bad_input_is_refused(call, error, words):
    with pytest.raises(error, match=None) as info:
        call()
    assert words.lower() in str(info.value).lower()


def test_elementwise_formats_take_any_head_dim():
    x = np.linspace(-2, 2, 2 * 3 * 5, dtype=F32).reshape(2, 3, 5)
    for fmt in ("bf16", "fp8"):
        assert decode(encode(x, fmt), fmt, 2, 3, 5).shape == (2, 3, 5)


def test_shipped_contract_states_the_constants_the_code_uses():
    import re
    from pathlib import Path

    from pagedkv.codecs import codebooks

    text = (Path(__file__).resolve().parents[2] / "docs" / "FORMATS.md").read_text(encoding="utf-8")
    flat = " ".join(text.split())

    def numbers_after(marker: str, count: int) -> list[float]:
        tail = flat[flat.index(marker) + len(marker) :]
        return [float(v) for v in re.findall(r"-?\d+\.\d+", tail)[:count]]

    assert numbers_after("**turbo4** codebook, index 0..15:", 16) == codebooks.TURBO4_LEVELS.astype(float).round(4).tolist()
    assert numbers_after("**turbo3**, index 0..7:", 8) == codebooks.TURBO3_LEVELS.astype(float).round(4).tolist()
    assert numbers_after("**turbo2**, index 0..3:", 4) == codebooks.TURBO2_LEVELS.astype(float).round(4).tolist()
    assert numbers_after("these exact values are the contract: turbo4", 15) == codebooks.TURBO4_BOUNDS.astype(float).round(4).tolist()
    assert numbers_after("2.4008`; turbo3", 7) == codebooks.TURBO3_BOUNDS.astype(float).round(4).tolist()
    assert numbers_after("1.748`; turbo2", 3) == codebooks.TURBO2_BOUNDS.astype(float).round(4).tolist()
