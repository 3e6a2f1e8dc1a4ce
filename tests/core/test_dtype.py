"""KvCacheDtype: names, aliases, K/V pairs and bits per element, checked against hand-written tables."""

import pytest

from pagedkv import KvCacheDtype as D
from pagedkv import accepted_names

SYMMETRIC = {
    "bf16": D.BF16,
    "fp8": D.FP8,
    "nvfp4": D.NVFP4,
    "turbo4": D.TURBO4,
    "turbo3": D.TURBO3,
    "turbo2": D.TURBO2,
    "turbo8": D.TURBO8,
}

# canonical name -> (member, short alias, K side, V side)
ASYMMETRIC = {
    "turbo4k_turbo3v": (D.TURBO4K_TURBO3V, "turbo4k3v", D.TURBO4, D.TURBO3),
    "turbo4k_turbo8v": (D.TURBO4K_TURBO8V, "turbo4k8v", D.TURBO4, D.TURBO8),
    "turbo3k_turbo8v": (D.TURBO3K_TURBO8V, "turbo3k8v", D.TURBO3, D.TURBO8),
    "bf16k_turbo4v": (D.BF16K_TURBO4V, "bf16k4v", D.BF16, D.TURBO4),
    "bf16k_turbo3v": (D.BF16K_TURBO3V, "bf16k3v", D.BF16, D.TURBO3),
    "fp8k_turbo4v": (D.FP8K_TURBO4V, "fp8k4v", D.FP8, D.TURBO4),
    "fp8k_turbo3v": (D.FP8K_TURBO3V, "fp8k3v", D.FP8, D.TURBO3),
    "bf16k_turbo2v": (D.BF16K_TURBO2V, "bf16k2v", D.BF16, D.TURBO2),
    "fp8k_turbo2v": (D.FP8K_TURBO2V, "fp8k2v", D.FP8, D.TURBO2),
}

SIDE_BITS = {D.BF16: 16, D.FP8: 8, D.NVFP4: 4.5, D.TURBO4: 4.5, D.TURBO3: 3.5, D.TURBO2: 2.5, D.TURBO8: 9}


def test_sixteen_members():
    assert len(D) == 16
    assert set(D) == set(SYMMETRIC.values()) | {row[0] for row in ASYMMETRIC.values()}


@pytest.mark.parametrize("name", sorted(SYMMETRIC))
def test_parse_symmetric(name):
    fmt = D.parse(name)
    assert fmt is SYMMETRIC[name]
    assert str(fmt) == name
    assert fmt.canonical_name == name
    assert fmt.kv_pair() == (fmt, fmt)
    assert not fmt.is_asymmetric()


@pytest.mark.parametrize("name", sorted(ASYMMETRIC))
def test_parse_asymmetric_long_and_short(name):
    member, alias, k, v = ASYMMETRIC[name]
    assert D.parse(name) is member
    assert D.parse(alias) is member
    assert str(D.parse(alias)) == name
    assert member.canonical_name == name
    assert member.kv_pair() == (k, v)
    assert member.is_asymmetric()
    assert not member.is_wht_rotated()


@pytest.mark.parametrize(
    "spelling, expected",
    [("BF16", D.BF16), ("Turbo4K3V", D.TURBO4K_TURBO3V), ("TURBO4K_TURBO3V", D.TURBO4K_TURBO3V), ("  fp8k2v ", D.FP8K_TURBO2V)],
)
def test_parse_ignores_case_and_surrounding_space(spelling, expected):
    assert D.parse(spelling) is expected


def test_parse_member_returns_it():
    assert D.parse(D.TURBO3K_TURBO8V) is D.TURBO3K_TURBO8V


@pytest.mark.parametrize("bad", ["fp16", "turbo5", "turbo4k_turbo3", "", "bf16k_bf16v", "turbo4k2v"])
def test_unknown_name_lists_every_accepted_name(bad):
    with pytest.raises(ValueError) as info:
        D.parse(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in list(SYMMETRIC) + list(ASYMMETRIC) + [row[1] for row in ASYMMETRIC.values()]:
        assert name in message


def test_parse_non_string_is_type_error():
    with pytest.raises(TypeError, match="16"):
        D.parse(16)


def test_accepted_names_exactly():
    expected = list(SYMMETRIC) + list(ASYMMETRIC) + [row[1] for row in ASYMMETRIC.values()]
    assert sorted(accepted_names()) == sorted(expected)
    assert len(accepted_names()) == len(set(accepted_names())) == 25


def test_wht_rotated_is_symmetric_turbo_only():
    rotated = {fmt for fmt in D if fmt.is_wht_rotated()}
    assert rotated == {D.TURBO4, D.TURBO3, D.TURBO2, D.TURBO8}


@pytest.mark.parametrize("fmt", list(D), ids=str)
def test_side_bits(fmt):
    k, v = ASYMMETRIC[str(fmt)][2:] if fmt.is_asymmetric() else (fmt, fmt)
    assert fmt.side_bits() == (SIDE_BITS[k], SIDE_BITS[v])
    assert fmt.bits_per_element() == (SIDE_BITS[k] + SIDE_BITS[v]) / 2


def test_side_bits_table_values():
    assert [D.parse(n).side_bits()[0] for n in ("bf16", "fp8", "nvfp4", "turbo4", "turbo3", "turbo2", "turbo8")] == [
        16, 8, 4.5, 4.5, 3.5, 2.5, 9,
    ]
    assert D.BF16K_TURBO2V.side_bits() == (16, 2.5)
    assert D.TURBO4K_TURBO8V.side_bits() == (4.5, 9)


def test_is_grouped():
    assert not D.BF16.is_grouped()
    assert not D.FP8.is_grouped()
    assert all(D.parse(n).is_grouped() for n in ("nvfp4", "turbo4", "turbo3", "turbo2", "turbo8"))
    assert all(row[0].is_grouped() for row in ASYMMETRIC.values())


def test_side_formats_is_the_one_table():
    from pagedkv import SIDE_FORMATS, SideFormat
    from pagedkv.core.dtype import side_spec

    assert SIDE_FORMATS == {
        D.BF16: SideFormat(16, 0, False, "bf16"),
        D.FP8: SideFormat(8, 0, False, "e4m3"),
        D.NVFP4: SideFormat(4, 1, False, "nvfp4"),
        D.TURBO4: SideFormat(4, 1, True, "turbo"),
        D.TURBO3: SideFormat(3, 1, True, "turbo"),
        D.TURBO2: SideFormat(2, 1, True, "turbo"),
        D.TURBO8: SideFormat(8, 2, True, "turbo8"),
    }
    assert [SIDE_FORMATS[f].bits for f in SIDE_FORMATS] == [16.0, 8.0, 4.5, 4.5, 3.5, 2.5, 9.0]
    assert [f for f in SIDE_FORMATS if SIDE_FORMATS[f].grouped] == [D.NVFP4, D.TURBO4, D.TURBO3, D.TURBO2, D.TURBO8]
    assert [f for f in D if f.is_wht_rotated()] == [D.TURBO4, D.TURBO3, D.TURBO2, D.TURBO8]
    with pytest.raises(ValueError, match="turbo4k_turbo3v is not a side format; use kv_pair"):
        side_spec(D.TURBO4K_TURBO3V)
