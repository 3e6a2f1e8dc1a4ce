"""write_tokens / read_tokens (pagedkv.kv.rows) through the cache: every format, mixed layers,
placement, errors. Caches here hold every block, since only held blocks may be written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pagedkv import KvCacheConfig, KvCacheDtype, KvCacheError, PagedKvCache
from pagedkv.codecs import decode, encode
from pagedkv.core.dtype import side_data_bytes, side_scale_bytes

BLOCK = 4
ALL_FORMATS = list(KvCacheDtype)


def values(rng, tokens, heads, head_dim):
    return (rng.standard_normal((tokens, heads, head_dim)) * 2).astype(np.float32)


def codec_round_trip(x, fmt, scale=1.0, unrotate=True):
    return decode(encode(x, fmt, scale=scale), fmt, x.shape[0], x.shape[1], x.shape[2], scale=scale,
                  unrotate=unrotate)


@pytest.fixture
def make_cache(gpu):
    caches = []

    def make(**kw):
        cfg = KvCacheConfig(**{"block_size": BLOCK, "num_kv_heads": 2, "head_dim": 128, "num_layers": 1,
                               "dtype": "bf16", **kw})
        cache = PagedKvCache(cfg, 6, gpu)
        cache.alloc_blocks(6)
        caches.append(cache)
        cache.poison_blocks(range(6), gpu, gpu.default_stream())
        return cache

    yield make
    for cache in caches:
        cache.release(gpu)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=str)
def test_every_format_round_trips_through_mixed_layers(gpu, make_cache, fmt):
    # layer 0: the format under test at rotated dims; layer 1: another format, other dims;
    # layer 2: the format again at unrotated dims.
    other = KvCacheDtype.TURBO3 if fmt is not KvCacheDtype.TURBO3 else KvCacheDtype.BF16
    cache = make_cache(num_layers=3, dtype=fmt, layer_dtypes=(fmt, other, fmt),
                       layer_dims=((2, 128), (4, 32), (1, 64)), k_scale=0.5, v_scale=2.0)
    rng = np.random.default_rng(list(KvCacheDtype).index(fmt))
    slots = np.array([9, 2, -1, 3, 20, 8, 10], dtype=np.int64)
    stream = gpu.default_stream()
    written = {}
    for layer in range(3):
        heads, head_dim = cache.config().dims_for_layer(layer)
        k, v = values(rng, 7, heads, head_dim), values(rng, 7, heads, head_dim)
        cache.write_tokens(layer, slots, k, v, gpu, stream, k_scale=0.5, v_scale=2.0)
        written[layer] = (k, v)
    for layer in range(3):
        k, v = written[layer]
        k_fmt, v_fmt = cache.dtype_for_layer(layer).kv_pair()
        got_k, got_v = cache.read_tokens(layer, slots, gpu, k_scale=0.5, v_scale=2.0)
        keep = slots != -1
        np.testing.assert_array_equal(got_k[keep], codec_round_trip(k[keep], k_fmt, 0.5))
        np.testing.assert_array_equal(got_v[keep], codec_round_trip(v[keep], v_fmt, 2.0))
        assert not got_k[~keep].any() and not got_v[~keep].any()
        stored_k, _ = cache.read_tokens(layer, slots[keep], gpu, unrotate=False, k_scale=0.5, v_scale=2.0)
        np.testing.assert_array_equal(stored_k, codec_round_trip(k[keep], k_fmt, 0.5, unrotate=False))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=str)
def test_a_full_block_holds_exactly_the_codec_bytes(gpu, make_cache, fmt):
    cache = make_cache(dtype=fmt)
    k_fmt, v_fmt = fmt.kv_pair()
    rng = np.random.default_rng(11)
    k, v = values(rng, BLOCK, 2, 128), values(rng, BLOCK, 2, 128)
    order = np.array([2, 0, 3, 1])
    stream = gpu.default_stream()
    # two calls, tokens out of order: the block must still be the one-shot encoding
    cache.write_tokens(0, 4 * BLOCK + order[:2], k[order[:2]], v[order[:2]], gpu, stream)
    cache.write_tokens(0, 4 * BLOCK + order[2:], k[order[2:]], v[order[2:]], gpu, stream)
    raw_k, raw_v = cache.read_block(0, 4, gpu)
    assert raw_k.tobytes() == encode(k, k_fmt)
    assert raw_v.tobytes() == encode(v, v_fmt)


@pytest.mark.parametrize("fmt", ["turbo3", "bf16k_turbo2v", "turbo8", "fp8", "nvfp4"])
def test_only_the_touched_rows_and_their_scales_change(gpu, make_cache, fmt):
    cache = make_cache(dtype=fmt)
    k_fmt, _ = KvCacheDtype.parse(fmt).kv_pair()
    rng = np.random.default_rng(2)
    k, v = values(rng, 1, 2, 128), values(rng, 1, 2, 128)
    cache.write_tokens(0, [1 * BLOCK + 2], k, v, gpu, gpu.default_stream())
    raw_k, _ = cache.read_block(0, 1, gpu)
    token = encode(k, k_fmt)
    row, scale_row = side_data_bytes(k_fmt, 2 * 128), side_scale_bytes(k_fmt, 2 * 128)
    assert row + scale_row == len(token)
    expected = np.full(raw_k.size, 0xFF, np.uint8)
    expected[2 * row : 3 * row] = np.frombuffer(token[:row], np.uint8)
    if scale_row:
        at = BLOCK * row + 2 * scale_row
        expected[at : at + scale_row] = np.frombuffer(token[row:], np.uint8)
    np.testing.assert_array_equal(raw_k, expected)
    for block in (0, 2, 3):
        assert (cache.read_block(0, block, gpu)[0] == 0xFF).all()


def test_bf16_inputs_are_accepted(gpu, make_cache):
    cache = make_cache(dtype="turbo4")
    x = values(np.random.default_rng(0), 2, 2, 128)
    cache.write_tokens(0, [0, 1], x.astype(ml_dtypes.bfloat16), x.astype(ml_dtypes.bfloat16), gpu, 0)
    k, _ = cache.read_tokens(0, [0, 1], gpu)
    np.testing.assert_array_equal(k, codec_round_trip(x.astype(ml_dtypes.bfloat16).astype(np.float32), "turbo4"))


def test_v_aliases_k_writes_k_only_and_reads_v_as_k(gpu, make_cache):
    cache = make_cache(dtype="turbo4", v_aliases_k=True)
    rng = np.random.default_rng(3)
    k, v = values(rng, 3, 2, 128), values(rng, 3, 2, 128)
    cache.write_tokens(0, [5, 6, 7], k, v, gpu, 0)
    got_k, got_v = cache.read_tokens(0, [5, 6, 7], gpu)
    np.testing.assert_array_equal(got_k, codec_round_trip(k, "turbo4"))
    np.testing.assert_array_equal(got_v, got_k)
    cache.write_tokens(0, [8], k[:1], None, gpu, 0)
    np.testing.assert_array_equal(cache.read_tokens(0, [8], gpu)[1], got_k[:1])


def test_nothing_to_write_touches_nothing(gpu, make_cache):
    cache = make_cache(dtype="nvfp4")
    x = values(np.random.default_rng(0), 2, 2, 128)
    cache.write_tokens(0, [-1, -1], x, x, gpu, 0)
    cache.write_tokens(0, np.zeros(0, np.int64), x[:0], x[:0], gpu, 0)
    assert all((cache.read_block(0, b, gpu)[0] == 0xFF).all() for b in range(6))
    k, v = cache.read_tokens(0, [-1], gpu)
    assert k.shape == (1, 2, 128) and not k.any() and not v.any()


# -- errors: a clear exception and nothing written --------------------------------------------


def good(rng=None, tokens=2, heads=2, head_dim=128):
    return values(rng or np.random.default_rng(0), tokens, heads, head_dim)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"k": good(head_dim=64)}, ValueError, "[num_tokens, 2, 128]"),
        ({"v": good(heads=1)}, ValueError, "(2, 1, 128)"),
        ({"v": good(tokens=3)}, ValueError, "(3, 2, 128)"),
        ({"k": good().astype(np.float16)}, TypeError, "float16"),
        ({"v": np.where(np.arange(128) == 7, 1e39, good().astype(np.float64))}, ValueError, "v[0, 0, 7] = 1e+39 is beyond float32"),
        ({"v": good().tolist()}, TypeError, "numpy array"),
        ({"v": None}, TypeError, "numpy array"),
        ({"k": np.where(np.arange(128) == 5, np.nan, good()).astype(np.float32)}, ValueError, "nan"),
        ({"v": np.where(np.arange(128) == 5, np.inf, good()).astype(np.float32)}, ValueError, "inf"),
        ({"slots": [0, 24]}, IndexError, "slot 24"),
        ({"slots": [-2, 0]}, IndexError, "slot -2"),
        ({"slots": [3, 3]}, ValueError, "slot 3 appears more than once"),
        ({"slots": [0]}, ValueError, "1 slots for 2 tokens"),
        ({"slots": [[0, 1]]}, ValueError, "1-D"),
        ({"slots": [0.0, 1.0]}, TypeError, "float64"),
        ({"slots": [True, False]}, TypeError, "bool"),
        ({"layer": 3}, IndexError, "layer 3"),
        ({"k_scale": 0.0}, ValueError, "0.0"),
        ({"v_scale": float("inf")}, ValueError, "inf"),
        ({"stream": 99}, ValueError, "99"),
    ],
)
def test_bad_writes_raise_and_write_nothing(gpu, make_cache, kwargs, error, words):
    if kwargs.get("stream") == 99 and type(gpu).__name__ != "HostBackend":
        pytest.skip("stream validation is the host backend's")
    cache = make_cache(num_layers=2, dtype="turbo4k_turbo3v", layer_dtypes=("fp8", "turbo4k_turbo3v"))
    call = {"layer": 1, "slots": [0, 1], "k": good(), "v": good(), "stream": 0, "k_scale": 1.0, "v_scale": 1.0}
    call.update(kwargs)
    with pytest.raises(error) as info:
        cache.write_tokens(call["layer"], call["slots"], call["k"], call["v"], gpu, call["stream"],
                           k_scale=call["k_scale"], v_scale=call["v_scale"])
    assert words.lower() in str(info.value).lower()
    for layer in range(2):
        for block in range(6):
            raw_k, raw_v = cache.read_block(layer, block, gpu)
            assert (raw_k == 0xFF).all() and (raw_v == 0xFF).all()


def test_read_errors(gpu, make_cache):
    cache = make_cache(dtype="turbo2")
    with pytest.raises(IndexError, match="slot 24 outside the cache"):
        cache.read_tokens(0, [24], gpu)
    with pytest.raises(ValueError, match="scale"):
        cache.read_tokens(0, [1], gpu, k_scale=-1.0)


def test_released_cache_refuses_tokens(gpu):
    cfg = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="fp8")
    cache = PagedKvCache(cfg, 2, gpu)
    cache.alloc_blocks(2)
    cache.release(gpu)
    x = np.ones((1, 1, 16), np.float32)
    with pytest.raises(KvCacheError, match="released"):
        cache.write_tokens(0, [0], x, x, gpu, 0)
    with pytest.raises(KvCacheError, match="released"):
        cache.read_tokens(0, [0], gpu)


def test_copies_are_one_per_run_and_section():
    from pagedkv import HostBackend

    class CountingHost(HostBackend):
        """A real HostBackend that counts its host-to-device and device-to-host copies."""

        h2d = d2h = 0

        def copy_h2d(self, src, dst):
            self.h2d += 1
            super().copy_h2d(src, dst)

        def copy_d2h(self, src, dst):
            self.d2h += 1
            super().copy_d2h(src, dst)

    gpu = CountingHost(capacity_bytes=1 << 24)
    cfg = KvCacheConfig(block_size=BLOCK, num_kv_heads=2, head_dim=128, num_layers=1, dtype="bf16k_turbo4v")
    cache = PagedKvCache(cfg, 6, gpu)
    cache.alloc_blocks(6)
    x = values(np.random.default_rng(0), 8, 2, 128)
    slots = np.array([9, 8, 10, 11, 12, 13, 14, 2])  # runs: block 2 (8..11), block 3 (12..14), block 0 (2)
    cache.write_tokens(0, slots, x, x, gpu, 0)
    assert gpu.h2d == 3 * 1 + 3 * 2  # bf16 K: data only; turbo4 V: data and scales
    k, v = cache.read_tokens(0, slots, gpu)
    assert gpu.d2h == 3 * 1 + 3 * 2
    np.testing.assert_array_equal(k, codec_round_trip(x, "bf16"))
    cache.release(gpu)


def test_skipped_rows_may_hold_anything_and_bad_rows_are_named(gpu, make_cache):
    cache = make_cache(dtype="turbo4")
    x = values(np.random.default_rng(4), 3, 2, 128)
    x[1, 1, 7] = np.nan
    cache.write_tokens(0, [0, -1, 2], x, x, gpu, 0)
    k, _ = cache.read_tokens(0, [0, 2], gpu)
    np.testing.assert_array_equal(k, codec_round_trip(x[[0, 2]], "turbo4"))
    with pytest.raises(ValueError, match=r"k holds a non-finite value nan at index \(1, 1, 7\)"):
        cache.write_tokens(0, [5, 6, 7], x, x, gpu, 0)
    assert (cache.read_block(0, 1, gpu)[0] == 0xFF).all()


def test_unsigned_slots_beyond_int64_are_refused(gpu, make_cache):
    cache = make_cache(dtype="fp8")
    x = values(np.random.default_rng(0), 1, 2, 128)
    with pytest.raises(IndexError, match="18446744073709551615"):
        cache.write_tokens(0, np.array([2**64 - 1], np.uint64), x, x, gpu, 0)
    cache.write_tokens(0, np.array([3], np.uint32), x, x, gpu, 0)
    np.testing.assert_array_equal(cache.read_tokens(0, np.array([3], np.int32), gpu)[0], codec_round_trip(x, "fp8"))


# -- defect 4: only blocks the caller holds, and no shared (cached) block, are written -


def test_write_tokens_refuses_a_free_block_and_writes_nothing(gpu):
    cfg = KvCacheConfig(block_size=BLOCK, num_kv_heads=2, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 4, gpu)
    try:
        held = cache.alloc_blocks(2)
        cache.zero_blocks(range(4), gpu, 0)
        gpu.synchronize(0)
        x = np.ones((3, 2, 16), np.float32)
        with pytest.raises(KvCacheError, match=r"write into free block 2 \(count 0\): allocate it first"):
            cache.write_tokens(0, [held[0] * BLOCK, 2 * BLOCK + 1, held[1] * BLOCK], x, x, gpu, 0)
        for block in range(4):
            assert not cache.read_block(0, block, gpu)[0].any()
    finally:
        cache.release(gpu)


def test_write_tokens_refuses_a_block_the_prefix_cache_holds(gpu):
    from pagedkv import PrefixCache

    cfg = KvCacheConfig(block_size=BLOCK, num_kv_heads=2, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 4, gpu)
    try:
        prefix = PrefixCache(cache)
        blocks = cache.alloc_blocks(2)
        cache.zero_blocks(blocks, gpu, 0)
        x = np.ones((1, 2, 16), np.float32)
        cache.write_tokens(0, [blocks[1] * BLOCK], x, x, gpu, 0)  # held, not cached: fine
        prefix.insert([1, 2, 3, 4], blocks[:1])  # block 0 is now shared KV
        with pytest.raises(KvCacheError, match=r"write into block 0, which the prefix cache holds: shared KV is read-only, copy the block first"):
            cache.write_tokens(0, [blocks[0] * BLOCK + 3], x, x, gpu, 0)
        assert not cache.read_block(0, blocks[0], gpu)[0].any()
    finally:
        cache.release(gpu)
