"""The fp8 scales are part of the cache: KvCacheConfig carries them, every write and read of
the cache uses them, and the transfer layout and a disk tier directory compare them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.codecs.side import decode, encode
from pagedkv.tiers.disk_layout import DiskLayoutMismatch, describe, differences
from pagedkv.tiers.transfer_layout import LAYOUT_VERSION, layout_differences, layout_of

FP8 = dict(block_size=4, num_kv_heads=1, head_dim=16, num_layers=2, dtype="fp8", layer_dtypes=("fp8", "bf16"))


def _cache(gpu, **kw):
    cache = PagedKvCache(KvCacheConfig(**{**FP8, **kw}), 4, gpu)
    cache.alloc_blocks(4)
    return cache


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), 1e-50, 1e39, True, "2", None])
def test_a_bad_scale_is_refused_naming_the_field(bad):
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name} must be a finite positive number"):
            KvCacheConfig(**FP8, **{name: bad})


def test_the_config_scales_default_to_one_and_are_reported():
    assert KvCacheConfig(**FP8).kv_scales() == (1.0, 1.0)
    config = KvCacheConfig(**FP8, k_scale=0.5, v_scale=2)
    assert config.kv_scales() == (0.5, 2.0) and type(config.v_scale) is float
    assert config.has_fp8_side() and not KvCacheConfig(**dict(FP8, dtype="bf16", layer_dtypes=())).has_fp8_side()
    assert KvCacheConfig(**dict(FP8, layer_dtypes=("bf16", "fp8k_turbo2v"))).has_fp8_side()


def test_writes_and_reads_use_the_config_scales():
    gpu = HostBackend(1 << 24)
    cache = _cache(gpu, k_scale=0.5, v_scale=2.0)
    try:
        rng = np.random.default_rng(5)
        k = rng.standard_normal((3, 1, 16)).astype(np.float32) * 4
        v = rng.standard_normal((3, 1, 16)).astype(np.float32) * 4
        slots = np.array([0, 5, 9], np.int64)
        cache.write_tokens(0, slots, k, v, gpu, 0)
        for i, slot in enumerate(slots):
            raw_k, raw_v = cache.read_block(0, int(slot) // 4, gpu)
            row = slice((int(slot) % 4) * 16, (int(slot) % 4 + 1) * 16)
            assert raw_k[row].tobytes() == encode(k[i : i + 1], "fp8", scale=0.5)
            assert raw_v[row].tobytes() == encode(v[i : i + 1], "fp8", scale=2.0)
        got_k, got_v = cache.read_tokens(0, slots, gpu)
        np.testing.assert_array_equal(got_k, decode(encode(k, "fp8", scale=0.5), "fp8", 3, 1, 16, scale=0.5))
        np.testing.assert_array_equal(got_v, decode(encode(v, "fp8", scale=2.0), "fp8", 3, 1, 16, scale=2.0))
        # the same scales given explicitly are the same call
        again_k, again_v = cache.read_tokens(0, slots, gpu, k_scale=0.5, v_scale=np.float32(2.0))
        assert np.array_equal(again_k, got_k) and np.array_equal(again_v, got_v)
    finally:
        cache.release(gpu)


def test_another_scale_given_to_a_call_is_refused_naming_both_and_writes_nothing():
    gpu = HostBackend(1 << 24)
    cache = _cache(gpu, k_scale=0.5)
    try:
        before = [cache.read_block(0, b, gpu) for b in range(4)]
        rows = np.ones((1, 1, 16), np.float32)
        with pytest.raises(ValueError, match=r"k_scale 0\.25 differs from the cache's k_scale 0\.5"):
            cache.write_tokens(0, [1], rows, rows, gpu, 0, k_scale=0.25)
        with pytest.raises(ValueError, match=r"v_scale 3\.0 differs from the cache's v_scale 1\.0"):
            cache.write_tokens(0, [1], rows, rows, gpu, 0, v_scale=3.0)
        with pytest.raises(ValueError, match=r"k_scale 1\.0 differs from the cache's k_scale 0\.5"):
            cache.read_tokens(0, [1], gpu, k_scale=1.0)
        with pytest.raises(ValueError, match=r"k_scale 2 differs"):
            cache.plan_layer_writes([0], [], [], gpu, k_scale=2)
        for bad in ("0.5", "abc", float("nan"), True):  # never a number by accident, always named
            with pytest.raises(ValueError, match="k_scale must be a finite positive number"):
                cache.write_tokens(0, [1], rows, rows, gpu, 0, k_scale=bad)
        after = [cache.read_block(0, b, gpu) for b in range(4)]
        assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(before, after))
    finally:
        cache.release(gpu)


def test_transfer_peers_with_other_fp8_scales_differ_naming_both_values():
    gpu = HostBackend(1 << 24)
    a, b, c = _cache(gpu), _cache(gpu, k_scale=0.5, v_scale=2.0), _cache(gpu, v_scale=2.0)
    plain = [PagedKvCache(KvCacheConfig(**dict(FP8, dtype="bf16", layer_dtypes=()), k_scale=s), 2, gpu) for s in (1, 4)]
    try:
        assert LAYOUT_VERSION == 3
        assert (layout_of(b)["k_scale"], layout_of(b)["v_scale"]) == (0.5, 2.0)
        assert layout_differences(layout_of(a), layout_of(a)) == []
        assert layout_differences(layout_of(a), layout_of(b)) == ["k_scale: here 1.0, peer 0.5",
                                                                   "v_scale: here 1.0, peer 2.0"]
        assert layout_differences(layout_of(c), layout_of(a)) == ["v_scale: here 2.0, peer 1.0"]
        # no layer stores fp8: the scales mean nothing and are not compared
        assert layout_differences(layout_of(plain[0]), layout_of(plain[1])) == []
    finally:
        for cache in (a, b, c, *plain):
            cache.release(gpu)


def test_a_disk_layout_records_fp8_scales_only_when_they_matter():
    rows = [{"layer": 0, "side": "K", "dtype": "fp8", "num_kv_heads": 1, "head_dim": 16, "stride": 64}]
    bf16_rows = [dict(rows[0], dtype="bf16", stride=128)]
    plain = describe(rows, 4, False, None, None)
    assert "fp8_scales" not in plain  # an fp8 directory at the default scales reads as before
    assert describe(rows, 4, False, None, None, fp8_scales=(1.0, 1.0)) == plain
    assert "fp8_scales" not in describe(bf16_rows, 4, False, None, None, fp8_scales=(0.5, 2.0))
    scaled = describe(rows, 4, False, None, None, fp8_scales=(0.5, 2.0))
    assert scaled["fp8_scales"] == [0.5, 2.0]
    assert differences(scaled, plain) == ["fp8_scales (k_scale, v_scale): here [0.5, 2.0], directory [1.0, 1.0]"]
    assert differences(plain, scaled) == ["fp8_scales (k_scale, v_scale): here [1.0, 1.0], directory [0.5, 2.0]"]
    assert differences(scaled, scaled) == []


def test_a_disk_directory_written_under_other_fp8_scales_is_refused(tmp_path):
    from pagedkv import DiskTier, HostTier, PrefixCache

    def open_world(**scales):
        gpu = HostBackend(1 << 24)
        cache = PagedKvCache(KvCacheConfig(**FP8, **scales), 4, gpu)
        tier = HostTier(cache, 2, gpu)
        disk = DiskTier(str(tmp_path), 1 << 20)
        try:
            prefix = PrefixCache(cache, host_tier=tier, disk_tier=disk)
        except BaseException:
            disk.close()
            tier.release(gpu)
            cache.release(gpu)
            raise
        return gpu, cache, tier, disk, prefix

    gpu, cache, tier, disk, prefix = open_world(k_scale=0.5)
    prefix.close()
    disk.close()
    tier.release(gpu)
    cache.release(gpu)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    with pytest.raises(DiskLayoutMismatch, match=r"fp8_scales \(k_scale, v_scale\): here \[1\.0, 1\.0\], "
                                                 r"directory \[0\.5, 1\.0\]"):
        open_world()
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before
    world = open_world(k_scale=0.5)  # the same scales open it again
    world[4].close()
    world[3].close()
    world[2].release(world[0])
    world[1].release(world[0])
