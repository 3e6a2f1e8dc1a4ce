"""Exact byte vectors of FORMATS.md, group edge cases and the placement of groups and scales."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pagedkv import KvCacheDtype
from pagedkv.codecs import decode, encode
from pagedkv.codecs.codebooks import TURBO2_LEVELS, TURBO3_LEVELS, TURBO4_LEVELS
from pagedkv.core.dtype import side_data_bytes

E2M1_TABLE = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
TURBO4_BOOK = [-2.7326, -2.0690, -1.6180, -1.2562, -0.9423, -0.6568, -0.3880, -0.1284,
               0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326]
TURBO3_BOOK = [-2.1520, -1.3440, -0.7560, -0.2451, 0.2451, 0.7560, 1.3440, 2.1520]
NIBBLE_PAIRS = bytes(((2 * i) & 15) | (((2 * i + 1) & 15) << 4) for i in range(8))


def one_group(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(1, 1, 16)


def decode_group(data: bytes, fmt: str) -> np.ndarray:
    return decode(data, fmt, 1, 1, 16).reshape(16)


def test_nibble_pairs_are_the_expected_bytes():
    assert NIBBLE_PAIRS.hex() == "1032547698badcfe"


def test_nvfp4_group_decodes_to_the_e2m1_table_in_order():
    out = decode_group(NIBBLE_PAIRS + b"\x38", "nvfp4")
    assert out.tolist() == E2M1_TABLE
    assert np.signbit(out[8])


def test_turbo4_group_decodes_to_its_codebook_in_order():
    out = decode_group(NIBBLE_PAIRS + b"\x38", "turbo4")
    np.testing.assert_array_equal(out, np.array(TURBO4_BOOK, dtype=np.float32))


def test_turbo3_codes_up_then_down_decode_to_codebook_then_reverse():
    data = bytes.fromhex("88c6fa773905") + b"\x38"
    out = decode_group(data, "turbo3")
    book = np.array(TURBO3_BOOK, dtype=np.float32)
    np.testing.assert_array_equal(out, np.concatenate([book, book[::-1]]))


def test_turbo8_ones_with_bf16_one_scale_decode_to_ones():
    out = decode_group(b"\x38" * 16 + bytes([0x80, 0x3F]), "turbo8")
    assert out.tolist() == [1.0] * 16


@pytest.mark.parametrize(
    "fmt, data",
    [("turbo4", "88" * 8), ("turbo3", "244992244992"), ("turbo2", "aa" * 4)],
)
def test_all_zero_group_encoding(fmt, data):
    assert encode(one_group(np.zeros(16)), fmt).hex() == data + "00"


def test_all_zero_group_decodes_to_zero():
    for fmt in ("turbo4", "turbo3", "turbo2", "nvfp4", "turbo8"):
        out = decode(encode(one_group(np.zeros(16)), fmt), fmt, 1, 1, 16)
        assert not out.any(), fmt


def test_sixteen_ones_in_turbo4():
    assert encode(one_group(np.ones(16)), "turbo4").hex() == "ff" * 8 + "2c"


def test_a_value_on_a_bound_takes_the_upper_level_and_zero_the_first_positive():
    # amax equals the largest level, so u == x exactly: 0.2582 sits on bound 8 -> code 9.
    x = one_group([2.7326, 0.2582, 0.0, -0.0, -0.2582] + [0.0] * 11)
    codes = np.frombuffer(encode(x, "turbo4"), np.uint8)[:8]
    nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(16)
    assert nibbles[:5].tolist() == [15, 9, 8, 8, 7]


def test_nvfp4_rounds_ties_to_even_and_keeps_the_sign_of_minus_zero():
    x = one_group([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.0, -0.25, -5.5, 0.1, 4.9, -3, 1, 0])
    raw = encode(x, "nvfp4")
    assert raw[8] == 0x38  # e4m3(6 / 6) = 1.0
    nibbles = np.stack([np.frombuffer(raw[:8], np.uint8) & 15, np.frombuffer(raw[:8], np.uint8) >> 4], -1)
    assert nibbles.reshape(16).tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 8, 15, 0, 6, 13, 2, 0]


def test_nvfp4_saturates_scale_and_code():
    x = one_group([6000.0] + [-3000.0] + [0.0] * 14)
    raw = encode(x, "nvfp4")
    assert raw[8] == 0x7E  # 1000 saturates to 448
    assert raw[0] == 0x07 | (0x0F << 4)  # 6000/448 and -3000/448 saturate at +-6
    assert decode_group(raw, "nvfp4")[:2].tolist() == [2688.0, -2688.0]


def test_nvfp4_zero_scale_keeps_sign_bits_only():
    x = one_group([-1e-4, 1e-4] + [0.0] * 14)
    raw = encode(x, "nvfp4")
    assert raw.hex() == "08" + "00" * 7 + "00"


def test_turbo8_scale_is_bf16_of_amax_over_448():
    x = one_group(np.linspace(-3.0, 1.0, 16))
    raw = encode(x, "turbo8")
    s = np.float32(3.0) / np.float32(448.0)
    assert raw[16:] == np.array([s]).astype(ml_dtypes.bfloat16).tobytes()
    assert raw[0] == 0xFE  # -3 / s == -448 exactly


def test_turbo8_tiny_group_scale_floor():
    raw = encode(one_group(np.zeros(16)), "turbo8")
    assert raw == bytes(16) + np.array([1e-12], np.float32).astype(ml_dtypes.bfloat16).tobytes()


def test_fp8_saturates_and_divides_by_the_scale():
    x = np.array([1000.0, -1000.0, 448.0, 1.0, 0.0, -0.0, 3.0, 2.0], np.float32).reshape(1, 1, 8)
    assert encode(x, "fp8").hex() == "7efe7e380080" + "44" + "40"
    assert encode(x, "fp8", scale=2.0).hex() == "7efe76300080" + "3c" + "38"
    assert decode(encode(x, "fp8", scale=2.0), "fp8", 1, 1, 8, scale=2.0)[0, 0, 3] == 1.0


def test_bf16_is_little_endian_round_to_nearest_even():
    x = np.array([1.0, -2.0, 1.00390625, 1.01171875], np.float32).reshape(1, 1, 4)
    # 1 + 2^-8 ties to 1.0; 1 + 3 * 2^-8 ties up to 1 + 2^-6
    assert encode(x, "bf16").hex() == "803f" + "00c0" + "803f" + "823f"


def test_bf16_input_is_accepted():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 16)
    assert encode(x.astype(ml_dtypes.bfloat16), "turbo4") == encode(x, "turbo4")


# -- placement: every group and scale where FORMATS.md puts it ------------------------------

GROUP_FORMATS = {"nvfp4": (8, 1), "turbo4": (8, 1), "turbo3": (6, 1), "turbo2": (4, 1), "turbo8": (16, 2)}


@pytest.mark.parametrize("fmt", sorted(GROUP_FORMATS))
def test_grouped_block_places_each_group_and_scale(fmt):
    tokens, heads, head_dim = 5, 3, 48
    rng = np.random.default_rng(7)
    # every group a different magnitude, so a misplaced group or scale changes bytes
    x = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    x *= np.exp(rng.uniform(-3, 3, (tokens, heads, head_dim // 16, 1))).repeat(16, -1).reshape(x.shape[0], heads, -1)
    raw = encode(x, fmt, rotate=False)
    group_bytes, scale_size = GROUP_FORMATS[fmt]
    n = heads * head_dim
    row_bytes = n // 16 * group_bytes
    data_section = tokens * row_bytes
    assert len(raw) == data_section + tokens * n // 16 * scale_size
    assert data_section == side_data_bytes(KvCacheDtype.parse(fmt), tokens * n)
    for t in range(tokens):
        for h in range(heads):
            for j in range(head_dim // 16):
                g = h * head_dim // 16 + j
                alone = encode(x[t : t + 1, h : h + 1, 16 * j : 16 * j + 16], fmt, rotate=False)
                data_at = t * row_bytes + g * group_bytes
                scale_at = data_section + t * (n // 16) * scale_size + g * scale_size
                assert raw[data_at : data_at + group_bytes] == alone[:group_bytes], (t, h, j)
                assert raw[scale_at : scale_at + scale_size] == alone[group_bytes:], (t, h, j)
    out = decode(raw, fmt, tokens, heads, head_dim, unrotate=False)
    assert out.shape == (tokens, heads, head_dim)
    first = decode(encode(x[2:3, 1:2, 16:32], fmt, rotate=False), fmt, 1, 1, 16, unrotate=False)
    np.testing.assert_array_equal(out[2, 1, 16:32], first.reshape(16))


@pytest.mark.parametrize("fmt, size", [("bf16", 2), ("fp8", 1)])
def test_elementwise_block_is_token_major(fmt, size):
    tokens, heads, head_dim = 3, 2, 8
    x = (np.arange(tokens * heads * head_dim, dtype=np.float32) - 20).reshape(tokens, heads, head_dim) / 4
    raw = encode(x, fmt)
    for t in range(tokens):
        for h in range(heads):
            for d in range(head_dim):
                i = (t * heads + h) * head_dim + d
                assert raw[i * size : (i + 1) * size] == encode(x[t : t + 1, h : h + 1, d : d + 1], fmt)
    narrow = ml_dtypes.bfloat16 if fmt == "bf16" else ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(decode(raw, fmt, tokens, heads, head_dim), x.astype(narrow).astype(np.float32))


@pytest.mark.parametrize("fmt", ["turbo4", "turbo3", "turbo2", "turbo8"])
@pytest.mark.parametrize("head_dim", [128, 256, 512])
def test_turbo_rotates_each_head_vector_before_encoding(fmt, head_dim):
    from pagedkv.codecs import rotate

    x = np.random.default_rng(head_dim).standard_normal((2, 2, head_dim)).astype(np.float32)
    assert encode(x, fmt) == encode(rotate(x), fmt, rotate=False)
    raw = encode(x, fmt)
    stored = decode(raw, fmt, 2, 2, head_dim, unrotate=False)
    from pagedkv.codecs import unrotate

    np.testing.assert_array_equal(decode(raw, fmt, 2, 2, head_dim), unrotate(stored))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
def test_non_turbo_formats_never_rotate(fmt):
    x = np.random.default_rng(1).standard_normal((2, 1, 128)).astype(np.float32)
    assert encode(x, fmt) == encode(x, fmt, rotate=False)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "turbo4", "turbo8"])
def test_encode_of_zero_tokens_names_the_shape(fmt):
    with pytest.raises(ValueError, match=r"^values holds 0 tokens \(shape \(0, 2, 128\)\): a block side to encode needs at least one$"):
        encode(np.zeros((0, 2, 128), np.float32), fmt)
