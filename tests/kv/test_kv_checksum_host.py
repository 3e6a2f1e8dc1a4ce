"""Host side of the every-format checksums: the float32 fixed-point layout of
pagedkv.core.exact_sum (words -> float64 == float_stats == math.fsum), the geometry check of
CudaBackend.reduce_kv_blocks, and diagnostics handing every side to a backend's
`reduce_kv_blocks` when it has one (the kernels themselves run in
test_kv_checksums_on_stub.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheDtype, PagedKvCache
from pagedkv.backends.protocol import BlockRegions
from pagedkv.core.exact_sum import (
    F32_RESULT_WORDS,
    F32_SSQ_DIGITS,
    F32_SUM_DIGITS,
    FLAG_NAN,
    FLAG_NEG_INF,
    FLAG_POS_INF,
    float_stats,
    stats_from_f32_words,
)


def f32_integers(values: np.ndarray) -> tuple[int, int, int]:
    """(sum, sum of squares, sum of |x|) of finite float32 values as exact integers in units
    2**-149 and 2**-298, the way the kernel adds them: m * 2**s per value."""
    total = squares = absolute = 0
    for bits in np.asarray(values, np.float32).view(np.uint32).tolist():
        e, f = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        m, s = (f | 0x800000, e - 1) if e else (f, 0)
        v = m << s
        total += -v if bits >> 31 else v
        absolute += v
        squares += (m * m) << (2 * s)
    return total, squares, absolute


def carry_save(value: int, digits: int, rng) -> list[int]:
    """`value` as `digits` 32-bit digits held in signed int64 words with random deferred carries."""
    words = [(value >> (32 * i)) & 0xFFFFFFFF for i in range(digits - 1)] + [value >> (32 * (digits - 1))]
    for i in range(digits - 1):
        k = int(rng.integers(-1000, 1000))
        words[i] += k << 32
        words[i + 1] -= k
    return words


def words_of(values: np.ndarray, rng, flags: int = 0) -> list[int]:
    total, squares, absolute = f32_integers(values)
    return (carry_save(total, F32_SUM_DIGITS, rng) + carry_save(absolute, F32_SUM_DIGITS, rng)
            + carry_save(squares, F32_SSQ_DIGITS, rng) + [flags])


def test_float32_words_round_once_to_fsum():
    rng = np.random.default_rng(1)
    max32 = np.finfo(np.float32).max
    cases = [
        rng.normal(size=500).astype(np.float32),
        np.array([max32, max32, -max32, 1e-45, -3e-45, 2.0**-126, 7.5], np.float32),   # extremes, denormals
        np.array([1.0, 2.0**-149, -1.0], np.float32),          # only the smallest denormal remains
        (rng.integers(1, 1 << 23, 64) * 2.0**-149).astype(np.float32) * rng.choice([-1, 1], 64).astype(np.float32),
        np.array([0.0, -0.0], np.float32),
    ]
    for values in cases:
        got = stats_from_f32_words(words_of(values, rng))
        x = values.astype(np.float64)
        assert tuple(got) == tuple(float_stats(values)) == (
            math.fsum(x) + 0.0, math.fsum(x * x) + 0.0, math.fsum(np.abs(x)) + 0.0), values
    assert math.copysign(1.0, stats_from_f32_words(words_of(np.array([-0.0], np.float32), rng)).sum) == 1.0
    assert stats_from_f32_words(words_of(cases[2], rng)).sum == 2.0**-149


@pytest.mark.parametrize("flags, want", [
    (FLAG_NAN | FLAG_POS_INF, (math.nan,) * 3),
    (FLAG_POS_INF, (math.inf, math.inf, math.inf)),
    (FLAG_NEG_INF, (-math.inf, math.inf, math.inf)),
    (FLAG_POS_INF | FLAG_NEG_INF, (math.nan, math.inf, math.inf)),
])
def test_float32_words_flags_follow_float_stats(flags, want):
    got = stats_from_f32_words(words_of(np.array([1.5], np.float32), np.random.default_rng(0), flags))
    assert [repr(g) for g in got] == [repr(w) for w in want]


def test_float32_words_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match=f"a float32 reduction result has {F32_RESULT_WORDS} words, got 36"):
        stats_from_f32_words([0] * 36)


def test_checksum_geometry_is_checked_before_any_launch():
    from pagedkv.driver.kv_kernels import check_kv_side_row

    regions = BlockRegions.from_rows([(4096, 2304, 2304), (65536, 512, 512)])   # nvfp4 / fp8 of 16 x 32 values
    assert check_kv_side_row(regions, 0, KvCacheDtype.NVFP4, 16, 256) == (0, 4096, 2304, KvCacheDtype.NVFP4)
    assert check_kv_side_row(regions, 1, KvCacheDtype.FP8, 16, 32)[:3] == (1, 65536, 512)
    with pytest.raises(IndexError, match="region 2 out of range"):
        check_kv_side_row(regions, 2, KvCacheDtype.FP8, 16, 32)
    with pytest.raises(ValueError, match="fmt must be a side format .* got <KvCacheDtype.TURBO4K_TURBO3V"):
        check_kv_side_row(regions, 0, KvCacheDtype.TURBO4K_TURBO3V, 16, 256)
    with pytest.raises(ValueError, match="fmt must be a side format .* got 'fp8'"):
        check_kv_side_row(regions, 1, "fp8", 16, 32)
    with pytest.raises(ValueError, match="row_elements must be a multiple of 16, got 40"):
        check_kv_side_row(regions, 1, KvCacheDtype.FP8, 16, 40)
    with pytest.raises(ValueError, match="block_size"):
        check_kv_side_row(regions, 1, KvCacheDtype.FP8, 0, 32)
    with pytest.raises(ValueError, match="region 1 holds 512-byte blocks; turbo8 of 16 x 32 values is 576 bytes"):
        check_kv_side_row(regions, 1, KvCacheDtype.TURBO8, 16, 32)


def test_hnd_blocks_go_to_the_checksum_kernel_as_their_head_chunks():
    """kv_kernels.checksum_chunks: an HND block of a grouped format is handed over as its
    head chunks (each an NHD block of one head), chunk h of block b at b * stride + h *
    chunk; NHD, one head and bf16 / fp8 keep their blocks (any head_dim); bad geometry is
    refused naming it."""
    from pagedkv.core.layout import SideLayout
    from pagedkv.driver.kv_kernels import checksum_chunks

    nvfp4 = KvCacheDtype.NVFP4
    chunk = SideLayout(nvfp4, 16, 4, 32, "HND").chunk_bytes   # 16 x (16 + 2) = 288
    blocks = np.array([2, 0], np.int64)
    got, stride, row = checksum_chunks(blocks, nvfp4, 16, 128, 4 * chunk, "HND", 4)
    assert (got.tolist(), stride, row) == ([8, 9, 10, 11, 0, 1, 2, 3], chunk, 32)
    got, stride, _ = checksum_chunks(blocks, nvfp4, 16, 128, 8 * chunk, "HND", 4)   # blocks 2 strides apart
    assert (got.tolist(), stride) == ([16, 17, 18, 19, 0, 1, 2, 3], chunk)
    for args in ((nvfp4, "NHD", 4), (nvfp4, "HND", 1), (KvCacheDtype.FP8, "HND", 4), (KvCacheDtype.BF16, "HND", 4)):
        fmt, layout, heads = args
        got, stride, row = checksum_chunks(blocks, fmt, 16, 128, 4 * chunk, layout, heads)
        assert (got.tolist(), stride, row) == ([2, 0], 4 * chunk, 128), args
    # blocks that are not split take any head_dim: bf16 / fp8 heads of 8 or 72 values, NHD and HND
    for fmt in (KvCacheDtype.BF16, KvCacheDtype.FP8):
        for layout in ("NHD", "HND"):
            for heads, row in ((2, 16), (8, 576)):
                got, stride, got_row = checksum_chunks(blocks, fmt, 4, row, 640, layout, heads)
                assert (got.tolist(), stride, got_row) == ([2, 0], 640, row), (fmt, layout, heads)
    with pytest.raises(ValueError, match="layout must be one of NHD, HND, got 'nhd'"):
        checksum_chunks(blocks, nvfp4, 16, 128, 4 * chunk, "nhd", 4)
    with pytest.raises(ValueError, match="heads must split 128 values a token into heads of a multiple of 16, got 3"):
        checksum_chunks(blocks, nvfp4, 16, 128, 4 * chunk, "HND", 3)
    with pytest.raises(ValueError, match="heads"):
        checksum_chunks(blocks, nvfp4, 16, 128, 4 * chunk, "HND", 0)
    # heads None: NHD does not need it, HND does (its chunks cannot be placed without it)
    got, stride, row = checksum_chunks(blocks, nvfp4, 16, 128, 4 * chunk, "NHD", None)
    assert (got.tolist(), stride, row) == ([2, 0], 4 * chunk, 128)
    for fmt in (nvfp4, KvCacheDtype.BF16):
        with pytest.raises(ValueError, match="heads must be given for layout HND .*got None"):
            checksum_chunks(blocks, fmt, 16, 128, 4 * chunk, "HND", None)
    with pytest.raises(ValueError, match="an HND block stride of 1160 bytes is not a whole number of 288-byte head chunks"):
        checksum_chunks(blocks, nvfp4, 16, 128, 4 * chunk + 8, "HND", 4)
    with pytest.raises(ValueError, match="head chunk index 2147483651 is above the kernels' limit 2147483647"):
        checksum_chunks(np.array([2**29], np.int64), nvfp4, 16, 128, 4 * chunk, "HND", 4)


class DeviceReducing(HostBackend):
    """A HostBackend with the optional `reduce_kv_blocks` in its original NHD-only form
    (seven positional arguments, no layout / heads; here the host decode of the one side),
    recording each call; copy_d2h calls are recorded too."""

    def __init__(self):
        super().__init__(capacity_bytes=1 << 26)
        self.calls = []

    def copy_d2h(self, src, dst):
        self.calls.append("copy_d2h")
        super().copy_d2h(src, dst)

    def reduce_kv_blocks(self, regions, region, blocks, fmt, block_size, row_elements, stream):
        return self._reduce(regions, region, blocks, fmt, block_size, row_elements, "NHD", 1)

    def _reduce(self, regions, region, blocks, fmt, block_size, row_elements, layout, heads):
        from pagedkv.codecs import decode
        from pagedkv.core.dtype import side_bytes
        from pagedkv.core.layout import SideLayout

        self.calls.append(("reduce_kv", region, tuple(int(b) for b in blocks), fmt.value, block_size, row_elements))
        nbytes = side_bytes(fmt, block_size * row_elements)
        geometry = SideLayout(fmt, block_size, heads, row_elements // heads, layout)
        values = [decode(geometry.to_nhd(self.view(int(regions.bases[region]) + int(b) * int(regions.strides[region]),
                                                   nbytes)),
                         fmt, block_size, heads, row_elements // heads, unrotate=False) for b in blocks]
        return float_stats(np.concatenate([np.zeros(0, np.float32)] + [v.ravel() for v in values]))


class HndDeviceReducing(DeviceReducing):
    """DeviceReducing whose `reduce_kv_blocks` takes the `layout=` / `heads=` keywords an HND
    cache passes, recorded with each call."""

    def reduce_kv_blocks(self, regions, region, blocks, fmt, block_size, row_elements, stream, *, layout, heads):
        self.calls.append(("placement", layout, heads))
        return self._reduce(regions, region, blocks, fmt, block_size, row_elements, layout, heads)


def test_diagnostics_hand_every_side_to_reduce_kv_blocks():
    gpu = DeviceReducing()
    cfg = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype="bf16",
                        layer_dtypes=("nvfp4", "bf16k3v"))
    cache = PagedKvCache(cfg, 3, gpu)
    cache.alloc_blocks(3)
    rng = np.random.default_rng(2)
    for layer in range(2):
        cache.write_tokens(layer, np.arange(12, dtype=np.int64), rng.normal(size=(12, 2, 16)).astype(np.float32),
                           rng.normal(size=(12, 2, 16)).astype(np.float32), gpu, 0)
    plain = HostBackend(1 << 26)
    twin = PagedKvCache(cfg, 3, plain)
    twin.alloc_blocks(3)
    for layer in range(2):
        for side in "kv":
            ptr = getattr(cache, f"{side}_pool_ptr")(layer)
            size = 3 * getattr(cache, f"{side}_block_stride_bytes_for_layer")(layer)
            plain.copy_h2d(gpu.view(ptr, size), getattr(twin, f"{side}_pool_ptr")(layer))
    from structlog.testing import capture_logs

    gpu.calls.clear()
    with capture_logs() as got:
        cache.debug_kv_checksum_per_layer([2, 0], 1, gpu, 0, "t")
        cache.debug_kv_per_block(1, [1], gpu, 0, "t")
    assert gpu.calls == [
        ("reduce_kv", 0, (2,), "nvfp4", 4, 32), ("reduce_kv", 1, (2,), "nvfp4", 4, 32),
        ("reduce_kv", 0, (0,), "nvfp4", 4, 32), ("reduce_kv", 1, (0,), "nvfp4", 4, 32),
        ("reduce_kv", 2, (2,), "bf16", 4, 32), ("reduce_kv", 3, (2,), "turbo3", 4, 32),
        ("reduce_kv", 2, (0,), "bf16", 4, 32), ("reduce_kv", 3, (0,), "turbo3", 4, 32),
        ("reduce_kv", 2, (1,), "bf16", 4, 32), ("reduce_kv", 3, (1,), "turbo3", 4, 32),
    ], gpu.calls
    with capture_logs() as want:   # no reduce_kv_blocks: BF16 reduced, the rest decoded on the host
        twin.debug_kv_checksum_per_layer([2, 0], 1, plain, 0, "t")
        twin.debug_kv_per_block(1, [1], plain, 0, "t")
    assert got == want and len(got) == 2 * 2 * 2 + 1
    cache.release(gpu)
    twin.release(plain)


def test_an_hnd_cache_hands_layout_and_heads_to_reduce_kv_blocks():
    """An NHD cache calls `reduce_kv_blocks` with its seven positional arguments only (an
    NHD-only backend keeps working: the test above); an HND cache adds layout="HND" and the
    layer's heads, whose sums equal HostBackend's; a backend whose method lacks the keywords
    gets TypeError on an HND cache instead of NHD sums of HND blocks."""
    from structlog.testing import capture_logs

    cfg = KvCacheConfig(block_size=4, num_kv_heads=3, head_dim=16, num_layers=2, dtype="nvfp4",
                        layer_dtypes=("nvfp4", "turbo3"), layer_dims=((3, 16), (2, 32)), layout="HND")
    rng = np.random.default_rng(5)
    rows = {layer: [rng.normal(size=(8, *cfg.dims_for_layer(layer))).astype(np.float32) for _ in "kv"] for layer in (0, 1)}
    for layer in rows:
        rows[layer][0][:, 0] *= 50.0   # head 0's scales differ from the others'

    def events(gpu):
        cache = PagedKvCache(cfg, 2, gpu)
        cache.alloc_blocks(2)
        for layer, (k, v) in rows.items():
            cache.write_tokens(layer, np.arange(8, dtype=np.int64), k, v, gpu, 0)
        try:
            with capture_logs() as logs:
                cache.debug_kv_checksum_per_layer([1, 0], 1, gpu, 0, "t")
        finally:
            cache.release(gpu)
        return logs

    gpu = HndDeviceReducing()
    got = events(gpu)
    assert [c for c in gpu.calls if c[0] == "placement"] == [("placement", "HND", 3)] * 4 + [("placement", "HND", 2)] * 4
    assert got == events(HostBackend(1 << 26)) and len(got) == 2 * 2 * 2
    with pytest.raises(TypeError, match="layout"):
        events(DeviceReducing())
