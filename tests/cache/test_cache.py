"""PagedKvCache bookkeeping, geometry and memory round trips, on every backend (`gpu`)."""

import numpy as np
import pytest
from structlog.testing import capture_logs

from pagedkv import (
    KvCacheConfig,
    KvCacheDtype as D,
    KvCacheError,
    KvCacheExhausted,
    PagedKvCache,
    RefCountError,
)

# block_size 4 x 2 heads x head_dim 16 = 128 elements per block side
E = 128
BF16_SIDE = 2 * E  # 256 bytes


def make(gpu, dtype="bf16", layers=2, blocks=8, **kw):
    config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=layers, dtype=dtype, **kw)
    return PagedKvCache(config, blocks, gpu)


@pytest.fixture
def cache(gpu):
    c = make(gpu)
    yield c
    c.release(gpu)


# -- allocation and reference counts --------------------------------------------------


def test_fresh_cache_state(cache):
    assert cache.num_blocks() == 8
    assert cache.num_free_blocks() == 8
    assert [cache.ref_count(b) for b in range(8)] == [0] * 8
    cache.check_invariants()


def test_alloc_order_and_lifo_reuse(cache):
    assert [cache.alloc_block() for _ in range(3)] == [0, 1, 2]
    assert [cache.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert cache.num_free_blocks() == 5
    assert cache.dec_ref(1) is True
    assert cache.dec_ref(0) is True
    assert cache.alloc_block() == 0  # last freed, first reused
    assert cache.alloc_block() == 1
    assert cache.alloc_block() == 3  # then the untouched ones, in order
    cache.check_invariants()


def test_exhaustion(cache):
    got = [cache.alloc_block() for _ in range(8)]
    assert got == list(range(8))
    with pytest.raises(KvCacheExhausted, match=r"asked for 1 block\(s\) but 0 of 8 are free"):
        cache.alloc_block()
    assert cache.try_alloc_block() is None
    cache.free_block(5)
    assert cache.try_alloc_block() == 5
    assert cache.ref_count(5) == 1
    cache.check_invariants()


def test_alloc_blocks_order_matches_alloc_block(gpu):
    a, b = make(gpu), make(gpu)
    for c in (a, b):
        c.alloc_blocks(4)
        c.free_block(2)
        c.free_block(0)
    assert a.alloc_blocks(4) == [b.alloc_block() for _ in range(4)] == [0, 2, 4, 5]
    assert [a.ref_count(x) for x in range(8)] == [b.ref_count(x) for x in range(8)] == [1] * 6 + [0] * 2
    a.check_invariants()


def test_alloc_blocks_all_or_nothing(cache):
    assert cache.alloc_blocks(6) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(KvCacheExhausted, match=r"asked for 3 block\(s\) but 2 of 8 are free"):
        cache.alloc_blocks(3)
    assert cache.num_free_blocks() == 2
    assert [cache.ref_count(b) for b in (6, 7)] == [0, 0]
    assert cache.alloc_blocks(0) == []
    assert cache.alloc_blocks(2) == [6, 7]
    cache.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.0, True, None])
def test_alloc_blocks_rejects_bad_count(cache, bad):
    with pytest.raises(ValueError, match="number of blocks"):
        cache.alloc_blocks(bad)
    assert cache.num_free_blocks() == 8


def test_inc_and_dec_ref(cache):
    b = cache.alloc_block()
    cache.inc_ref(b)
    cache.inc_ref(b)
    assert cache.ref_count(b) == 3
    assert cache.dec_ref(b) is False
    assert cache.dec_ref(b) is False
    assert cache.num_free_blocks() == 7
    assert cache.dec_ref(b) is True
    assert cache.ref_count(b) == 0 and cache.num_free_blocks() == 8
    assert cache.alloc_block() == b
    cache.check_invariants()


def test_inc_ref_of_free_block_is_refused(cache):
    with pytest.raises(RefCountError, match="inc_ref of free block 3"):
        cache.inc_ref(3)
    assert cache.ref_count(3) == 0 and cache.num_free_blocks() == 8


def test_dec_ref_at_zero_raises_logs_and_leaves_free_list_alone(cache):
    b = cache.alloc_block()
    assert cache.dec_ref(b) is True
    with capture_logs() as logs:
        with pytest.raises(RefCountError, match=f"dec_ref of block {b} at count 0"):
            cache.dec_ref(b)
    errors = [e for e in logs if e["event"] == "kv_dec_ref_at_zero"]
    assert len(errors) == 1 and errors[0]["log_level"] == "error" and errors[0]["block"] == b
    assert cache.num_free_blocks() == 8
    cache.check_invariants()
    assert cache.alloc_blocks(8) == list(range(8))  # the block is handed out once, not twice


def test_free_block_is_one_decrement(cache):
    b = cache.alloc_block()
    cache.inc_ref(b)
    cache.free_block(b)
    assert cache.ref_count(b) == 1 and cache.num_free_blocks() == 7
    cache.free_block(b)
    assert cache.ref_count(b) == 0 and cache.num_free_blocks() == 8


def test_free_blocks_returns_them_in_allocation_order(cache):
    table = cache.alloc_blocks(4)
    cache.inc_ref(table[2])
    cache.free_blocks(table)
    assert [cache.ref_count(b) for b in table] == [0, 0, 1, 0]
    assert cache.alloc_blocks(3) == [0, 1, 3]
    cache.check_invariants()


def test_free_blocks_checks_every_index_first(cache):
    table = cache.alloc_blocks(3)
    with pytest.raises(IndexError, match="block 8 out of range"):
        cache.free_blocks([table[0], table[1], 8])
    assert [cache.ref_count(b) for b in table] == [1, 1, 1]


def test_return_evicted_block(cache, held_set):
    cache.attach_prefix_cache(held_set)
    b = cache.alloc_block()
    cache.inc_ref(b)  # the prefix cache's own reference
    held_set.held.add(b)
    cache.return_evicted_block(b)
    assert cache.ref_count(b) == 1 and cache.num_free_blocks() == 7
    cache.return_evicted_block(b)
    assert cache.ref_count(b) == 0 and cache.num_free_blocks() == 8
    with capture_logs() as logs:
        assert cache.return_evicted_block(b) is None  # at zero: a warning, nothing else
    assert [(e["event"], e["log_level"], e["block"]) for e in logs] == [("kv_return_evicted_at_zero", "warning", b)]
    assert cache.num_free_blocks() == 8
    held_set.held.discard(b)
    cache.check_invariants()
    assert cache.alloc_blocks(8) == list(range(8))


# -- bad indices ----------------------------------------------------------------------

BLOCK_CALLS = {
    "inc_ref": lambda c, g, b: c.inc_ref(b),
    "dec_ref": lambda c, g, b: c.dec_ref(b),
    "free_block": lambda c, g, b: c.free_block(b),
    "free_blocks": lambda c, g, b: c.free_blocks([0, b]),
    "return_evicted_block": lambda c, g, b: c.return_evicted_block(b),
    "ref_count": lambda c, g, b: c.ref_count(b),
    "block_history": lambda c, g, b: c.block_history(b),
    "zero_block": lambda c, g, b: c.zero_block(b, g, g.default_stream()),
    "poison_block": lambda c, g, b: c.poison_block(b, g, g.default_stream()),
    "init_block": lambda c, g, b: c.init_block(b, g, g.default_stream()),
    "zero_blocks": lambda c, g, b: c.zero_blocks([1, b], g, g.default_stream()),
    "poison_blocks": lambda c, g, b: c.poison_blocks([b], g, g.default_stream()),
    "init_blocks": lambda c, g, b: c.init_blocks([2, b], g, g.default_stream()),
    "copy_blocks_src": lambda c, g, b: c.copy_blocks([(b, 1)], g, g.default_stream()),
    "copy_blocks_dst": lambda c, g, b: c.copy_blocks([(1, b)], g, g.default_stream()),
    "k_cache_ptr": lambda c, g, b: c.k_cache_ptr(0, b),
    "v_cache_ptr": lambda c, g, b: c.v_cache_ptr(1, b),
    "read_block": lambda c, g, b: c.read_block(0, b, g),
    "write_block": lambda c, g, b: c.write_block(0, b, b"k", b"v", g),
    "debug_kv_per_block": lambda c, g, b: c.debug_kv_per_block(0, [0, b], g, g.default_stream(), "t"),
    "debug_kv_checksum_per_layer": lambda c, g, b: c.debug_kv_checksum_per_layer([b], 1, g, g.default_stream(), "t"),
}


@pytest.mark.parametrize("name", sorted(BLOCK_CALLS))
@pytest.mark.parametrize("bad", [8, -1, -8, -9, 1 << 40])
def test_block_index_out_of_range(gpu, cache, name, bad):
    cache.alloc_blocks(2)
    before = [cache.ref_count(b) for b in range(8)]
    with pytest.raises(IndexError, match=f"block {bad} out of range for a cache of 8 blocks"):
        BLOCK_CALLS[name](cache, gpu, bad)
    assert [cache.ref_count(b) for b in range(8)] == before
    cache.check_invariants()


@pytest.mark.parametrize("bad", [1.0, "1", True, None])
def test_block_index_must_be_int(cache, bad):
    for call in (cache.ref_count, cache.dec_ref, cache.inc_ref, cache.return_evicted_block):
        with pytest.raises(TypeError, match="block index must be an int"):
            call(bad)


def test_numpy_block_index_is_accepted(cache):
    b = cache.alloc_block()
    assert cache.ref_count(np.int64(b)) == 1
    assert cache.dec_ref(np.int32(b)) is True


LAYER_CALLS = {
    "k_cache_ptr": lambda c, g, l: c.k_cache_ptr(l, 0),
    "v_cache_ptr": lambda c, g, l: c.v_cache_ptr(l, 0),
    "k_pool_ptr": lambda c, g, l: c.k_pool_ptr(l),
    "v_pool_ptr": lambda c, g, l: c.v_pool_ptr(l),
    "read_block": lambda c, g, l: c.read_block(l, 0, g),
    "write_block": lambda c, g, l: c.write_block(l, 0, b"k", b"v", g),
    "dtype_for_layer": lambda c, g, l: c.dtype_for_layer(l),
    "block_stride_bytes_for_layer": lambda c, g, l: c.block_stride_bytes_for_layer(l),
    "k_block_stride_bytes_for_layer": lambda c, g, l: c.k_block_stride_bytes_for_layer(l),
    "v_block_stride_bytes_for_layer": lambda c, g, l: c.v_block_stride_bytes_for_layer(l),
    "region_index": lambda c, g, l: c.region_index(l, "K"),
    "debug_kv_per_block": lambda c, g, l: c.debug_kv_per_block(l, [0], g, g.default_stream(), "t"),
}


@pytest.mark.parametrize("name", sorted(LAYER_CALLS))
@pytest.mark.parametrize("bad", [2, -1, -3])
def test_layer_index_out_of_range(gpu, cache, name, bad):
    before = [cache.read_block(layer, 0, gpu) for layer in range(2)]  # fresh memory: any bytes
    with pytest.raises(IndexError, match=f"layer {bad} out of range for a cache of 2 layers"):
        LAYER_CALLS[name](cache, gpu, bad)
    for layer, (k, v) in enumerate(before):  # nothing written anywhere (a wrapped -1 would hit layer 1)
        k_now, v_now = cache.read_block(layer, 0, gpu)
        assert np.array_equal(k_now, k) and np.array_equal(v_now, v), layer


# -- geometry -------------------------------------------------------------------------


def test_geometry_bf16(gpu, cache):
    assert cache.cache_stride() == E
    assert cache.block_stride_bytes() == BF16_SIDE
    assert cache.block_size() == 4 and cache.num_layers() == 2
    assert cache.dtype() is D.BF16 and cache.dtype_for_layer(1) is D.BF16
    assert cache.config() == KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype="bf16")
    pools = [cache.k_pool_ptr(0), cache.v_pool_ptr(0), cache.k_pool_ptr(1), cache.v_pool_ptr(1)]
    assert len(set(pools)) == 4 and not any(p.is_null for p in pools)
    for layer in range(2):
        assert cache.block_stride_bytes_for_layer(layer) == BF16_SIDE
        assert cache.k_block_stride_bytes_for_layer(layer) == BF16_SIDE
        assert cache.v_block_stride_bytes_for_layer(layer) == BF16_SIDE
        for b in (0, 3, 7):
            assert cache.k_cache_ptr(layer, b) == cache.k_pool_ptr(layer) + b * BF16_SIDE
            assert cache.v_cache_ptr(layer, b) == cache.v_pool_ptr(layer) + b * BF16_SIDE
    assert cache.nvfp4_data_bytes() == E // 2 == 64
    assert cache.turbo4_data_bytes() == 64
    assert cache.turbo4_scale_bytes() == E // 16 == 8
    assert cache.turbo3_data_bytes() == 3 * E // 8 == 48
    assert cache.turbo2_data_bytes() == E // 4 == 32
    assert cache.turbo8_data_bytes() == E == 128


def test_geometry_asymmetric_and_mixed(gpu):
    # layer 0 turbo4k_turbo3v at global dims; layer 1 bf16 at (1, 16): 64 elements
    c = make(gpu, "turbo4k3v", layers=2, blocks=4, layer_dtypes=[D.TURBO4K_TURBO3V, "bf16"], layer_dims=[(2, 16), (1, 16)])
    k0, v0 = E // 2 + E // 16, 3 * E // 8 + E // 16
    assert (k0, v0) == (72, 56)
    assert [c.k_block_stride_bytes_for_layer(i) for i in range(2)] == [72, 128]
    assert [c.v_block_stride_bytes_for_layer(i) for i in range(2)] == [56, 128]
    assert c.block_stride_bytes_for_layer(0) == 72
    assert c.block_stride_bytes() == 72
    assert c.v_cache_ptr(0, 3) == c.v_pool_ptr(0) + 3 * 56
    assert c.k_cache_ptr(1, 3) == c.k_pool_ptr(1) + 3 * 128
    k, v = c.read_block(0, 2, gpu)
    assert (k.dtype, k.size, v.size) == (np.uint8, 72, 56)
    k, v = c.read_block(1, 2, gpu)
    assert (k.size, v.size) == (128, 128)
    c.release(gpu)


# -- memory: write, read, zero, poison, copy ------------------------------------------


def fill_random(cache, gpu, rng):
    """Allocate every free block (only held blocks may be written), write random bytes to
    every block of every layer; return {(layer, block): (k, v)}."""
    cache.alloc_blocks(cache.num_free_blocks())
    contents = {}
    for layer in range(cache.num_layers()):
        for b in range(cache.num_blocks()):
            k = rng.integers(0, 256, cache.k_block_stride_bytes_for_layer(layer), dtype=np.uint8)
            v = rng.integers(0, 256, cache.v_block_stride_bytes_for_layer(layer), dtype=np.uint8)
            cache.write_block(layer, b, k, v, gpu)
            contents[layer, b] = (k, v)
    return contents


def assert_contents(cache, gpu, expected):
    for (layer, b), (k, v) in expected.items():
        got_k, got_v = cache.read_block(layer, b, gpu)
        np.testing.assert_array_equal(got_k, k, err_msg=f"layer {layer} block {b} K")
        np.testing.assert_array_equal(got_v, v, err_msg=f"layer {layer} block {b} V")


def test_write_read_round_trip(gpu, cache):
    contents = fill_random(cache, gpu, np.random.default_rng(0))
    assert_contents(cache, gpu, contents)


def test_write_accepts_bytes_and_partial_data(gpu, cache):
    contents = fill_random(cache, gpu, np.random.default_rng(1))
    cache.write_block(1, 5, b"\x01\x02\x03", bytearray(b"\x09"), gpu)
    k, v = contents[1, 5]
    k, v = k.copy(), v.copy()
    k[:3] = [1, 2, 3]
    v[0] = 9
    contents[1, 5] = (k, v)
    # typed arrays are written as their raw bytes
    halfs = np.arange(BF16_SIDE // 2, dtype=np.uint16)
    cache.write_block(0, 2, halfs, None, gpu)  # None leaves V alone
    contents[0, 2] = (halfs.view(np.uint8), contents[0, 2][1])
    cache.write_block(0, 3, None, halfs, gpu)
    contents[0, 3] = (contents[0, 3][0], halfs.view(np.uint8))
    assert_contents(cache, gpu, contents)


@pytest.mark.parametrize("side", ["K", "V"])
def test_write_block_too_long_writes_nothing(gpu, cache, side):
    contents = fill_random(cache, gpu, np.random.default_rng(2))
    ok, long = bytes(BF16_SIDE), bytes(BF16_SIDE + 1)
    k_data, v_data = (long, ok) if side == "K" else (ok, long)
    with pytest.raises(ValueError, match=f"layer 1 {side} data is 257 bytes, longer than the 256-byte block"):
        cache.write_block(1, 4, k_data, v_data, gpu)
    assert_contents(cache, gpu, contents)


def test_zero_and_poison_blocks(gpu, cache):
    s = gpu.default_stream()
    contents = fill_random(cache, gpu, np.random.default_rng(3))
    zeros, poison = np.zeros(BF16_SIDE, np.uint8), np.full(BF16_SIDE, 0xFF, np.uint8)
    cache.zero_block(6, gpu, s)
    cache.poison_block(1, gpu, s)
    cache.zero_blocks([0, 4], gpu, s)
    cache.poison_blocks([7, 3], gpu, s)
    gpu.synchronize(s)
    for layer in range(2):
        for b in (6, 0, 4):
            contents[layer, b] = (zeros, zeros)
        for b in (1, 7, 3):
            contents[layer, b] = (poison, poison)
    assert_contents(cache, gpu, contents)  # blocks 2 and 5 untouched
    cache.zero_blocks([], gpu, s)
    cache.poison_blocks(np.array([], dtype=np.int64), gpu, s)
    assert_contents(cache, gpu, contents)


def test_poison_covers_asymmetric_and_mixed_layers(gpu):
    c = make(gpu, "fp8", layers=3, blocks=3, layer_dtypes=["turbo3k8v", "bf16k2v"], layer_dims=[(1, 16)])
    fill_random(c, gpu, np.random.default_rng(4))
    c.poison_block(1, gpu, gpu.default_stream())
    c.zero_block(2, gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    for layer in range(3):
        for b, byte in ((1, 0xFF), (2, 0)):
            k, v = c.read_block(layer, b, gpu)
            assert k.size == c.k_block_stride_bytes_for_layer(layer) and (k == byte).all()
            assert v.size == c.v_block_stride_bytes_for_layer(layer) and (v == byte).all()
        k, v = c.read_block(layer, 0, gpu)
        assert not ((k == 0xFF).all() or (k == 0).all())
    c.release(gpu)


def test_copy_blocks(gpu, cache):
    contents = fill_random(cache, gpu, np.random.default_rng(5))
    cache.copy_blocks([(0, 5), (2, 6)], gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    for layer in range(2):
        contents[layer, 5] = contents[layer, 0]
        contents[layer, 6] = contents[layer, 2]
    assert_contents(cache, gpu, contents)
    with pytest.raises(ValueError, match="pairs"):
        cache.copy_blocks([(0, 1, 2)], gpu, gpu.default_stream())
    with pytest.raises(ValueError, match="both a source and a destination"):
        cache.copy_blocks([(0, 1), (1, 2)], gpu, gpu.default_stream())


def test_init_block_zeroes_by_default(gpu, env_flags):
    env_flags(METRALE_KV_POISON="0")
    c = make(gpu, blocks=4)
    c.poison_blocks([0, 1, 2, 3], gpu, gpu.default_stream())
    c.init_block(2, gpu, gpu.default_stream())
    c.init_blocks([0], gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    for layer in range(2):
        assert [int(c.read_block(layer, b, gpu)[1].max()) for b in range(4)] == [0, 255, 0, 255]
    c.release(gpu)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " True "])
def test_init_block_poisons_when_flag_on(gpu, env_flags, value):
    env_flags(METRALE_KV_POISON=value)
    c = make(gpu, blocks=4)
    c.zero_blocks(range(4), gpu, gpu.default_stream())  # device memory starts undefined
    c.init_block(3, gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    for layer in range(2):
        k, v = c.read_block(layer, 3, gpu)
        assert (k == 0xFF).all() and (v == 0xFF).all()
        k, v = c.read_block(layer, 2, gpu)
        assert not k.any() and not v.any()
    c.release(gpu)


@pytest.mark.parametrize("value", ["0", "false", "yes", "2", ""])
def test_init_block_poison_flag_other_values_zero(gpu, env_flags, value):
    env_flags(METRALE_KV_POISON=value)
    c = make(gpu, blocks=2)
    c.poison_block(0, gpu, gpu.default_stream())
    c.init_block(0, gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    assert not c.read_block(0, 0, gpu)[0].any()
    c.release(gpu)


def test_poison_flag_is_read_once(gpu, env_flags, monkeypatch):
    env_flags(METRALE_KV_POISON="0")
    monkeypatch.setenv("METRALE_KV_POISON", "1")  # changed after the flags were read: ignored
    c = make(gpu, blocks=2)
    c.poison_block(0, gpu, gpu.default_stream())
    c.init_block(0, gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    assert not c.read_block(1, 0, gpu)[1].any()
    c.release(gpu)


def test_block_regions_rows(gpu, cache):
    regions = cache.block_regions()
    assert len(regions) == 4
    for layer in range(2):
        k_row, v_row = cache.region_index(layer, "K"), cache.region_index(layer, "V")
        assert (k_row, v_row) == (2 * layer, 2 * layer + 1)
        assert int(regions.bases[k_row]) == cache.k_pool_ptr(layer)
        assert int(regions.bases[v_row]) == cache.v_pool_ptr(layer)
        assert int(regions.strides[k_row]) == int(regions.nbytes[k_row]) == BF16_SIDE
    with pytest.raises(ValueError, match="side must be 'K' or 'V', got 'k'"):
        cache.region_index(0, "k")


def test_block_regions_rows_aliased(gpu):
    c = make(gpu, "fp8", layers=3, blocks=2, v_aliases_k=True)
    assert len(c.block_regions()) == 3
    assert [c.region_index(l, s) for l in range(3) for s in "KV"] == [0, 0, 1, 1, 2, 2]
    c.release(gpu)


# -- input strictness and all-or-nothing refcount errors ----------------------------------


def test_free_blocks_listing_a_block_too_often_changes_nothing(cache):
    a, b = cache.alloc_blocks(2)
    cache.inc_ref(b)
    cache.free_block(a)  # a is free now; listing it again is a refcount bug
    with pytest.raises(RefCountError, match=f"dec_ref of block {a} at count 0"):
        cache.free_blocks([a, b])
    assert (cache.ref_count(a), cache.ref_count(b)) == (0, 2)
    with pytest.raises(RefCountError, match=f"dec_ref of block {b} at count 0"):
        cache.free_blocks([b, b, b])  # referenced twice, listed three times
    assert cache.ref_count(b) == 2
    cache.free_blocks([b, b])
    assert cache.ref_count(b) == 0 and cache.num_free_blocks() == 8
    cache.check_invariants()


def test_bools_are_not_block_indices(cache, gpu):
    for blocks in ([True, 1], [0, False]):
        with pytest.raises(TypeError, match="block index must be an int, got (True|False)"):
            cache.zero_blocks(blocks, gpu, gpu.default_stream())
    with pytest.raises(TypeError, match="block index must be an int, got True"):
        cache.ref_count(True)


def test_numpy_integers_are_indices_and_counts(gpu):
    c = make(gpu, blocks=np.int64(4))
    try:
        assert c.num_blocks() == 4 and type(c.num_blocks()) is int
        assert c.alloc_blocks(np.int64(2)) == [0, 1]
        assert c.k_cache_ptr(np.int64(1), np.int32(1)) == c.k_pool_ptr(1) + BF16_SIDE
        assert c.dtype_for_layer(np.int8(0)) is D.BF16
        with pytest.raises(TypeError, match="layer index must be an int, got 1.0"):
            c.k_pool_ptr(1.0)
        with pytest.raises(IndexError, match="layer -1 out of range for a cache of 2 layers"):
            c.k_pool_ptr(np.int64(-1))
    finally:
        c.release(gpu)


# -- defect 4: write_block and copy_blocks write only held, unshared blocks -----------


def test_write_block_refuses_a_free_block(gpu, cache):
    cache.zero_blocks(range(8), gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    with pytest.raises(RefCountError, match=r"write into free block 3 \(count 0\): allocate it first"):
        cache.write_block(0, 3, b"\x01", b"\x02", gpu)
    assert not any(cache.read_block(0, 3, gpu)[0]) and not any(cache.read_block(0, 3, gpu)[1])


def test_write_block_and_copy_blocks_refuse_a_cached_block(gpu, cache):
    from pagedkv import PrefixCache

    prefix = PrefixCache(cache)
    blocks = cache.alloc_blocks(3)
    cache.zero_blocks(range(8), gpu, gpu.default_stream())  # device memory starts undefined
    gpu.synchronize(gpu.default_stream())
    cache.write_block(0, blocks[0], b"\x07", None, gpu)
    prefix.insert([1, 2, 3, 4], blocks[:1])
    with pytest.raises(KvCacheError, match=f"write into block {blocks[0]}, which the prefix cache holds"):
        cache.write_block(1, blocks[0], b"\x09", None, gpu)
    with pytest.raises(KvCacheError, match=f"write into block {blocks[0]}, which the prefix cache holds"):
        cache.copy_blocks([(blocks[1], blocks[0])], gpu, gpu.default_stream())
    with pytest.raises(RefCountError, match=r"write into free block 5 \(count 0\)"):
        cache.copy_blocks([(blocks[1], 5)], gpu, gpu.default_stream())
    # copy-on-write: the cached block is a fine source
    cache.copy_blocks([(blocks[0], blocks[2])], gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    assert cache.read_block(0, blocks[2], gpu)[0][0] == 7
    assert cache.read_block(1, blocks[0], gpu)[0][0] == 0 and not cache.read_block(0, 5, gpu)[0].any()
