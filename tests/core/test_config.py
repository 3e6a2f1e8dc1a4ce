"""KvCacheConfig byte sizes, worked out by hand from the DESIGN.md table, and its validation."""

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from pagedkv import KvCacheConfig, KvCacheDtype as D, PagedKvCache

# Bytes of one block side of e elements, straight from the DESIGN.md table (data + scales).
def table_bytes(fmt: str, e: int) -> int:
    return {
        "bf16": 2 * e,
        "fp8": e,
        "nvfp4": e // 2 + e // 16,
        "turbo4": e // 2 + e // 16,
        "turbo3": 3 * e // 8 + e // 16,
        "turbo2": e // 4 + e // 16,
        "turbo8": e + 2 * e // 16,
    }[fmt]


# The same at e = 16 * 8 * 128 = 16384, as literal numbers (so the helper above is checked too).
E = 16 * 8 * 128
LITERAL = {"bf16": 32768, "fp8": 16384, "nvfp4": 9216, "turbo4": 9216, "turbo3": 7168, "turbo2": 5120, "turbo8": 18432}
# The smallest grouped block side: 16 elements.
LITERAL_16 = {"bf16": 32, "fp8": 16, "nvfp4": 9, "turbo4": 9, "turbo3": 7, "turbo2": 5, "turbo8": 18}

ASYM = {
    "turbo4k_turbo3v": ("turbo4", "turbo3"),
    "turbo4k_turbo8v": ("turbo4", "turbo8"),
    "turbo3k_turbo8v": ("turbo3", "turbo8"),
    "bf16k_turbo4v": ("bf16", "turbo4"),
    "bf16k_turbo3v": ("bf16", "turbo3"),
    "fp8k_turbo4v": ("fp8", "turbo4"),
    "fp8k_turbo3v": ("fp8", "turbo3"),
    "bf16k_turbo2v": ("bf16", "turbo2"),
    "fp8k_turbo2v": ("fp8", "turbo2"),
}


def cfg(dtype="bf16", layers=4, block_size=16, heads=8, head_dim=128, **kw):
    return KvCacheConfig(
        block_size=block_size, num_kv_heads=heads, head_dim=head_dim, num_layers=layers, dtype=dtype, **kw
    )


def test_table_helper_matches_literals():
    assert {f: table_bytes(f, E) for f in LITERAL} == LITERAL
    assert {f: table_bytes(f, 16) for f in LITERAL_16} == LITERAL_16


@pytest.mark.parametrize("fmt", sorted(LITERAL))
def test_symmetric_sizes(fmt):
    c = cfg(fmt, layers=3)
    side = LITERAL[fmt]
    assert c.cache_stride_elements() == E
    for layer in range(3):
        assert c.k_block_bytes_for_layer(layer) == side
        assert c.v_block_bytes_for_layer(layer) == side
        assert c.block_bytes_for_layer(layer) == side
        assert c.dtype_for_layer(layer) is D.parse(fmt)
        assert c.dims_for_layer(layer) == (8, 128)
    assert c.block_bytes() == side
    assert c.block_bytes_kv() == 2 * side
    assert c.block_bytes_kv_all_layers() == 3 * 2 * side
    assert not c.has_mixed_formats()


@pytest.mark.parametrize("fmt", sorted(LITERAL_16))
def test_symmetric_sizes_at_sixteen_elements(fmt):
    c = cfg(fmt, layers=1, block_size=1, heads=1, head_dim=16)
    assert c.block_bytes() == LITERAL_16[fmt]
    assert c.block_bytes_kv_all_layers() == 2 * LITERAL_16[fmt]


@pytest.mark.parametrize("name", sorted(ASYM))
def test_asymmetric_sizes(name):
    k, v = ASYM[name]
    c = cfg(name, layers=2)
    for layer in range(2):
        assert c.k_block_bytes_for_layer(layer) == LITERAL[k]
        assert c.v_block_bytes_for_layer(layer) == LITERAL[v]
        assert c.block_bytes_for_layer(layer) == LITERAL[k]
    assert c.block_bytes() == LITERAL[k]
    assert c.block_bytes_kv() == 2 * LITERAL[k]
    assert c.block_bytes_kv_all_layers() == 2 * (LITERAL[k] + LITERAL[v])
    assert c.has_mixed_formats()


def test_block_bytes_kv_is_exactly_twice_block_bytes_for_every_format():
    for fmt in D:
        c = cfg(fmt, layers=1)
        assert c.block_bytes_kv() == 2 * c.block_bytes()


def test_mixed_formats_and_dims():
    # layer 0: bf16 at (2, 64); layer 1: turbo4k_turbo3v at (4, 32); layer 2: global fp8 at (1, 256);
    # layer 3: global fp8 at the global dims (8, 128).
    c = cfg(
        "fp8",
        layers=4,
        layer_dtypes=["bf16", D.TURBO4K_TURBO3V],
        layer_dims=[(2, 64), (4, 32), (1, 256)],
    )
    e0, e1, e2, e3 = 16 * 2 * 64, 16 * 4 * 32, 16 * 1 * 256, 16 * 8 * 128
    assert (e0, e1, e2, e3) == (2048, 2048, 4096, 16384)
    assert [c.dtype_for_layer(i) for i in range(4)] == [D.BF16, D.TURBO4K_TURBO3V, D.FP8, D.FP8]
    assert [c.dims_for_layer(i) for i in range(4)] == [(2, 64), (4, 32), (1, 256), (8, 128)]
    k = [2 * 2048, 2048 // 2 + 2048 // 16, 4096, 16384]
    v = [2 * 2048, 3 * 2048 // 8 + 2048 // 16, 4096, 16384]
    assert k == [4096, 1152, 4096, 16384] and v == [4096, 896, 4096, 16384]
    assert [c.k_block_bytes_for_layer(i) for i in range(4)] == k
    assert [c.v_block_bytes_for_layer(i) for i in range(4)] == v
    assert [c.block_bytes_for_layer(i) for i in range(4)] == k
    assert c.block_bytes_kv_all_layers() == sum(k) + sum(v) == 51200
    # global accessors use the global dtype and dims only
    assert c.block_bytes() == 16384
    assert c.block_bytes_kv() == 32768
    assert c.cache_stride_elements() == 16384
    assert c.has_mixed_formats()
    assert c.layer_dtypes == (D.BF16, D.TURBO4K_TURBO3V)
    assert c.layer_dims == ((2, 64), (4, 32), (1, 256))


def test_only_dims_differ_is_mixed():
    assert cfg("bf16", layers=2, layer_dims=[(2, 64)]).has_mixed_formats()
    assert not cfg("bf16", layers=2, layer_dims=[(8, 128)]).has_mixed_formats()


def test_v_aliases_k():
    c = cfg("turbo8", layers=3, v_aliases_k=True)
    assert [c.k_block_bytes_for_layer(i) for i in range(3)] == [18432] * 3
    assert [c.v_block_bytes_for_layer(i) for i in range(3)] == [0] * 3
    assert c.block_bytes_kv_all_layers() == 3 * 18432
    assert c.block_bytes() == 18432
    assert c.block_bytes_kv() == 2 * 18432


def test_v_aliases_k_with_mixed_layers():
    c = cfg("bf16", layers=2, layer_dtypes=["fp8"], layer_dims=[(1, 16)], v_aliases_k=True)
    assert c.block_bytes_kv_all_layers() == 16 * 1 * 16 + 2 * 16 * 8 * 128


def test_v_aliases_k_refuses_asymmetric_layer():
    with pytest.raises(ValueError, match=r"layer 1.*turbo4k_turbo3v"):
        cfg("bf16", layers=2, layer_dtypes=["bf16", "turbo4k3v"], v_aliases_k=True)


def test_grouped_accessors():
    c = cfg("bf16")
    assert c.nvfp4_data_bytes() == E // 2 == 8192
    assert c.nvfp4_scale_bytes() == E // 16 == 1024
    assert c.turbo4_data_bytes() == 8192
    assert c.turbo4_scale_bytes() == 1024
    assert c.turbo3_data_bytes() == 3 * E // 8 == 6144
    assert c.turbo3_scale_bytes() == 1024
    assert c.turbo2_data_bytes() == E // 4 == 4096
    assert c.turbo2_scale_bytes() == 1024
    assert c.turbo8_data_bytes() == E == 16384
    assert c.turbo8_scale_bytes() == 2 * E // 16 == 2048


def test_grouped_accessors_never_truncate():
    c = cfg("bf16", block_size=1, heads=1, head_dim=8)  # 8 elements: half a group
    assert c.block_bytes() == 16
    for accessor in ("nvfp4_scale_bytes", "turbo3_data_bytes", "turbo8_scale_bytes"):
        with pytest.raises(ValueError, match="8 elements"):
            getattr(c, accessor)()


def test_dtype_given_by_name_alias_or_member():
    assert cfg("turbo4k3v").dtype is D.TURBO4K_TURBO3V
    assert cfg(D.FP8).dtype is D.FP8
    assert cfg("BF16").dtype is D.BF16


def test_config_is_frozen():
    c = cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 32


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_dim", "num_layers"])
@pytest.mark.parametrize("value", [0, -1, 16.0, True, None])
def test_non_positive_or_non_int_size_names_field(field, value):
    kw = dict(block_size=16, num_kv_heads=8, head_dim=128, num_layers=2, dtype="bf16")
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        KvCacheConfig(**kw)


@pytest.mark.parametrize("value", [0, -3])
def test_cache_blocks_per_seq_must_be_positive(value):
    with pytest.raises(ValueError, match="cache_blocks_per_seq"):
        cfg(cache_blocks_per_seq=value)
    assert cfg(cache_blocks_per_seq=4).cache_blocks_per_seq == 4


def test_unknown_dtype_name():
    with pytest.raises(ValueError, match="'fp4'"):
        cfg("fp4")
    with pytest.raises(ValueError, match="'int8'"):
        cfg("bf16", layer_dtypes=["bf16", "int8"])


def test_layer_dtypes_longer_than_num_layers():
    with pytest.raises(ValueError, match=r"layer_dtypes has 3 entries but num_layers is 2"):
        cfg("bf16", layers=2, layer_dtypes=["bf16", "fp8", "fp8"])


def test_layer_dims_longer_than_num_layers():
    with pytest.raises(ValueError, match=r"layer_dims has 2 entries but num_layers is 1"):
        cfg("bf16", layers=1, layer_dims=[(8, 128), (8, 128)])


@pytest.mark.parametrize(
    "dims, match",
    [((0, 128), r"layer_dims\[1\] num_kv_heads"), ((8, -2), r"layer_dims\[1\] head_dim"), ((8,), r"layer_dims\[1\]"), (7, r"layer_dims\[1\]")],
)
def test_bad_layer_dims_entry_names_it(dims, match):
    with pytest.raises(ValueError, match=match):
        cfg("bf16", layers=2, layer_dims=[(8, 128), dims])


@pytest.mark.parametrize("fmt", ["nvfp4", "turbo4", "turbo3", "turbo2", "turbo8", "bf16k_turbo4v", "fp8k_turbo2v"])
def test_grouped_format_needs_head_dim_multiple_of_16(fmt):
    # 1 x 3 x 8 = 24 elements: turbo3 would silently floor 24/16 scales; it must refuse.
    with pytest.raises(ValueError, match=r"layer 0: .*head_dim is 8, not a multiple of 16"):
        cfg(fmt, layers=1, block_size=1, heads=3, head_dim=8)
    # 16 x 1 x 8 = 128 elements groups evenly, but each group would straddle two heads
    with pytest.raises(ValueError, match=r"layer 0: .*head_dim is 8, not a multiple of 16"):
        cfg(fmt, layers=1, block_size=16, heads=1, head_dim=8)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_ungrouped_format_takes_any_element_count(fmt):
    c = cfg(fmt, layers=1, block_size=1, heads=3, head_dim=8)
    assert c.block_bytes() == table_bytes(fmt, 24)


def test_grouped_check_names_the_offending_layer_from_layer_dtypes():
    with pytest.raises(ValueError, match=r"^layer 2: turbo2 "):
        cfg("bf16", layers=3, block_size=1, heads=1, head_dim=8, layer_dtypes=["bf16", "fp8", "turbo2"])


def test_grouped_check_names_the_offending_layer_from_layer_dims():
    with pytest.raises(ValueError, match=r"^layer 1: turbo4 .*head_dim is 8, not a multiple of 16"):
        cfg("turbo4", layers=3, block_size=1, heads=1, head_dim=16, layer_dims=[(1, 16), (1, 8)])


@pytest.mark.parametrize("layer", [4, -1, 100])
def test_layer_index_out_of_range(layer):
    c = cfg(layers=4)
    for accessor in (c.dtype_for_layer, c.dims_for_layer, c.k_block_bytes_for_layer, c.v_block_bytes_for_layer, c.block_bytes_for_layer):
        with pytest.raises(IndexError, match=f"layer {layer} out of range"):
            accessor(layer)


# -- property: per-layer totals and compute_num_blocks agree with the table -----------

SIDE_OF = dict(ASYM, **{f: (f, f) for f in LITERAL})


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16, 32]),
    dims=st.lists(st.tuples(st.integers(1, 8), st.sampled_from([16, 32, 64, 80, 128, 256])), min_size=1, max_size=5),
    fmts=st.lists(st.sampled_from(sorted(SIDE_OF)), min_size=1, max_size=5),
    extra_layers=st.integers(0, 3),
    available=st.integers(0, 1 << 34),
)
def test_totals_match_the_table(block_size, dims, fmts, extra_layers, available):
    layers = max(len(dims), len(fmts)) + extra_layers
    c = KvCacheConfig(
        block_size=block_size, num_kv_heads=dims[0][0], head_dim=dims[0][1], num_layers=layers,
        dtype=fmts[0], layer_dtypes=fmts, layer_dims=dims,
    )
    total = 0
    for layer in range(layers):
        heads, head_dim = dims[layer] if layer < len(dims) else dims[0]
        k, v = SIDE_OF[fmts[layer] if layer < len(fmts) else fmts[0]]
        e = block_size * heads * head_dim
        assert c.k_block_bytes_for_layer(layer) == table_bytes(k, e)
        assert c.v_block_bytes_for_layer(layer) == table_bytes(v, e)
        total += table_bytes(k, e) + table_bytes(v, e)
    assert c.block_bytes_kv_all_layers() == total
    n = PagedKvCache.compute_num_blocks(c, available)
    assert n * total <= available < (n + 1) * total


# -- defect 11: grouped formats and sizes refused at construction ----------------------


def test_grouped_format_with_head_dim_100_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"^layer 0: turbo4 .*head_dim is 100, not a multiple of 16"):
        KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=100, num_layers=2, dtype="turbo4")
    # an asymmetric format with one grouped side is refused too; bf16 and fp8 take any head_dim
    with pytest.raises(ValueError, match=r"^layer 0: bf16k_turbo4v .*head_dim is 100"):
        KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=100, num_layers=2, dtype="bf16k_turbo4v")
    assert KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=100, num_layers=2, dtype="fp8").block_bytes() == 12800


@pytest.mark.parametrize(
    "field, bound",
    [("block_size", 2**16), ("num_kv_heads", 2**12), ("head_dim", 2**14), ("num_layers", 2**12)],
)
def test_sizes_past_their_bound_are_refused_at_once(field, bound):
    base = dict(block_size=16, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    for value in (bound + 1, 2**63):
        with pytest.raises(ValueError, match=f"^{field} is {value}, past the bound of {bound}$"):
            KvCacheConfig(**{**base, field: value})
    at_bound = KvCacheConfig(**{**base, field: bound})
    assert getattr(at_bound, field) == bound


def test_layer_dims_and_window_past_their_bound_are_refused():
    base = dict(block_size=16, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")
    with pytest.raises(ValueError, match=r"^layer_dims\[1\] head_dim is 9223372036854775808, past the bound of 16384$"):
        KvCacheConfig(**base, layer_dims=[(1, 16), (1, 2**63)])
    with pytest.raises(ValueError, match=r"^layer_dims\[0\] num_kv_heads is 4097, past the bound of 4096$"):
        KvCacheConfig(**base, layer_dims=[(4097, 16)])
    with pytest.raises(ValueError, match=r"^cache_blocks_per_seq is 2147483649, past the bound of 2147483648$"):
        KvCacheConfig(**base, cache_blocks_per_seq=2**31 + 1)
