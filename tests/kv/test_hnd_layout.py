"""layout="HND": every format's block bytes are the NHD bytes with each head's pieces moved
to its own chunk (pagedkv.core.layout), through write/read tokens, views, checksums and the
host tier; NHD stays the default."""

from __future__ import annotations

import numpy as np
import pytest
import structlog

from pagedkv import HostBackend, KvCacheConfig, KvCacheDtype, PagedKvCache
from pagedkv.core.layout import SideLayout
from pagedkv.tiers.host_tier import HostTier

ALL_FORMATS = list(KvCacheDtype)
BLOCK = 4
BLOCKS = 6


def _pair(fmt, heads=3, head_dim=32, **kw):
    gpu = HostBackend(capacity_bytes=1 << 26)
    caches = []
    for layout in ("NHD", "HND"):
        config = KvCacheConfig(block_size=BLOCK, num_kv_heads=heads, head_dim=head_dim, num_layers=2, dtype=fmt,
                               layout=layout, layer_dims=((heads, head_dim), (1, 16)), k_scale=0.5, v_scale=2.0,
                               **kw)
        cache = PagedKvCache(config, BLOCKS, gpu)
        cache.alloc_blocks(BLOCKS)
        cache.init_blocks(range(BLOCKS), gpu, 0)
        caches.append(cache)
    return gpu, caches


def _write_both(gpu, caches, seed):
    rng = np.random.default_rng(seed)
    slots = np.array([9, 2, -1, 3, 20, 8, 10, 11, 0], dtype=np.int64)
    for layer in range(2):
        heads, head_dim = caches[0].config().dims_for_layer(layer)
        k = (rng.standard_normal((slots.size, heads, head_dim)) * 2).astype(np.float32)
        v = (rng.standard_normal((slots.size, heads, head_dim)) * 2).astype(np.float32)
        for cache in caches:
            cache.write_tokens(layer, slots, k, v, gpu, 0, k_scale=0.5, v_scale=2.0)
    return slots


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=str)
def test_hnd_blocks_are_the_nhd_blocks_head_major(fmt):
    gpu, (nhd, hnd) = _pair(fmt)
    slots = _write_both(gpu, (nhd, hnd), ALL_FORMATS.index(fmt))
    for layer in range(2):
        for side in ("K", "V"):
            geometry = hnd.config().side_layout(layer, side)
            for block in range(BLOCKS):
                a = nhd.read_block(layer, block, gpu)[side == "V"]
                b = hnd.read_block(layer, block, gpu)[side == "V"]
                assert np.array_equal(geometry.from_nhd(a), b), (layer, side, block)
                assert np.array_equal(geometry.to_nhd(b), a)
        k_nhd, v_nhd = nhd.read_tokens(layer, slots, gpu, k_scale=0.5, v_scale=2.0)
        k_hnd, v_hnd = hnd.read_tokens(layer, slots, gpu, k_scale=0.5, v_scale=2.0)
        assert np.array_equal(k_nhd, k_hnd) and np.array_equal(v_nhd, v_hnd)
    # one head: the two layouts are the same bytes
    assert np.array_equal(nhd.read_block(1, 2, gpu)[0], hnd.read_block(1, 2, gpu)[0])
    assert not np.array_equal(nhd.read_block(0, 2, gpu)[0], hnd.read_block(0, 2, gpu)[0])


def test_hnd_head_chunk_is_one_head_nhd_block():
    # head h's chunk of an HND turbo4 block is what a 1-head NHD cache holds for head h
    gpu, (_, hnd) = _pair("turbo4", heads=2, head_dim=16)
    one = PagedKvCache(KvCacheConfig(block_size=BLOCK, num_kv_heads=1, head_dim=16, num_layers=1, dtype="turbo4"),
                       2, gpu)
    one.alloc_blocks(2)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((BLOCK, 2, 16)).astype(np.float32)
    hnd.write_tokens(0, np.arange(4, 8), k, k, gpu, 0)
    chunk = BLOCK * (8 + 1)
    for head in range(2):
        one.write_tokens(0, np.arange(4), k[:, head : head + 1], k[:, head : head + 1], gpu, 0)
        assert np.array_equal(hnd.read_block(0, 1, gpu)[0][head * chunk : (head + 1) * chunk],
                              one.read_block(0, 0, gpu)[0])


def test_layout_offsets_worked_example():
    g = SideLayout(KvCacheDtype.TURBO4, 4, 2, 16, "NHD")
    h = SideLayout(KvCacheDtype.TURBO4, 4, 2, 16, "HND")
    assert (g.data_offset(2, 1), g.scale_offset(2, 1)) == (40, 69)
    assert (h.data_offset(2, 1), h.scale_offset(2, 1), h.chunk_bytes) == (52, 70, 36)
    offs, sizes, _ = h.pieces(range(1, 2))
    assert offs.tolist() == [36, 44, 52, 60, 68, 69, 70, 71] and sizes.tolist() == [8] * 4 + [1] * 4


def test_views_are_head_major():
    gpu, (nhd, hnd) = _pair("bf16", heads=3, head_dim=16)
    _write_both(gpu, (nhd, hnd), 1)
    a, b = nhd.k_view(0, gpu).host_array(), hnd.k_view(0, gpu).host_array()
    assert a.shape == (BLOCKS, BLOCK, 3, 16) and b.shape == (BLOCKS, 3, BLOCK, 16)
    assert np.array_equal(a.transpose(0, 2, 1, 3).view(np.uint16), b.view(np.uint16))
    gpu, (nhd, hnd) = _pair("turbo3", heads=3, head_dim=32)
    _write_both(gpu, (nhd, hnd), 2)
    for part in ("data_view", "scale_view"):
        a = getattr(nhd.v_view(0, gpu), part)().host_array()
        b = getattr(hnd.v_view(0, gpu), part)().host_array()
        assert b.shape == (BLOCKS, 3, BLOCK, a.shape[2] // 3)
        assert np.array_equal(a.reshape(BLOCKS, BLOCK, 3, -1).transpose(0, 2, 1, 3), b)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "turbo3", "nvfp4", "turbo4k_turbo8v"])
def test_checksums_are_the_same_in_both_layouts(fmt):
    gpu, caches = _pair(fmt)
    _write_both(gpu, caches, 5)
    events = []
    for cache in caches:
        with structlog.testing.capture_logs() as logs:
            cache.debug_kv_checksum_per_layer(list(range(BLOCKS)), 2, gpu, 0, tag="t")
        events.append([(e["layer"], e["side"], e["region"], e["sum"], e["ssq"], e["sabs"]) for e in logs
                       if e["event"] == "kv_checksum"])
    assert events[0] == events[1] and len(events[0]) == 8
    assert any(e[4] != 0 for e in events[0])


def test_host_tier_round_trips_hnd_blocks():
    gpu, (_, hnd) = _pair("turbo4k_turbo3v")
    _write_both(gpu, (hnd,), 7)
    before = [hnd.read_block(layer, b, gpu) for layer in range(2) for b in range(BLOCKS)]
    tier = HostTier(hnd, 8, gpu)
    host = tier.alloc(BLOCKS)[::-1]
    tier.swap_out(list(range(BLOCKS)), host, 0).wait()
    hnd.poison_blocks(range(BLOCKS), gpu, 0)
    tier.swap_in(host, list(range(BLOCKS)), 0).wait()
    after = [hnd.read_block(layer, b, gpu) for layer in range(2) for b in range(BLOCKS)]
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(before, after))


def test_host_tier_format_keeps_hnd():
    # a tier in a smaller format transcodes HND blocks into HND tier blocks (the same
    # bytes a tier of an HND bf16 cache gives, head-major)
    gpu, (nhd, hnd) = _pair("bf16", heads=2, head_dim=32)
    _write_both(gpu, (nhd, hnd), 8)
    tiers = [HostTier(c, 8, gpu, format="turbo4") for c in (nhd, hnd)]
    hosts = [tier.alloc(2) for tier in tiers]
    for tier, host in zip(tiers, hosts):
        tier.swap_out([2, 3], host, 0).wait()
    geometry = SideLayout(KvCacheDtype.TURBO4, BLOCK, 2, 32, "HND")
    a, b = tiers[0].block_rows(hosts[0][1])[0], tiers[1].block_rows(hosts[1][1])[0]
    assert np.array_equal(geometry.from_nhd(a), b) and not np.array_equal(a, b)


def test_config_refuses_bad_layout_and_nhd_stays_default():
    base = dict(block_size=4, num_kv_heads=2, head_dim=16, num_layers=1, dtype="bf16")
    assert KvCacheConfig(**base).layout == "NHD"
    assert KvCacheConfig(**base) == KvCacheConfig(**base, layout="NHD")
    with pytest.raises(ValueError, match="layout must be one of NHD, HND, got 'nhd'"):
        KvCacheConfig(**base, layout="nhd")


def test_device_sides_carry_their_layout_into_the_launch():
    """A KvSideArgs names its pool's layout (a bad one refused, naming it); the layer table
    packs it as the side's hnd flag; the grid counts an HND side's units head by head (each
    one-head side rounding up), as kv_rows.cu's kv_launch runs it."""
    from pagedkv.driver.kv_kernels import KvKernels, KvLayer, KvSideArgs, layers_units, side_units

    with pytest.raises(ValueError, match="layout must be one of NHD, HND, got 'hnd'"):
        KvSideArgs(KvCacheDtype.BF16, 0, 64, 0, 32, layout="hnd")
    sides = [KvSideArgs(KvCacheDtype.BF16, 4096, 2048, 8192, 512, layout=layout) for layout in ("HND", "NHD")]
    raw = KvKernels().kv_layer_table([(4, 128, *sides)])
    entry = KvLayer.from_buffer_copy(raw)
    assert [side.hnd for side in entry.side] == [1, 0]
    assert (side_units(0, 4, 128, -1, 3), side_units(0, 4, 128, -1, 3, hnd=True)) == (3, 4)   # 3 x 32 chunks; 4 x ceil(24 / 32)
    assert side_units(3, 4, 128, 0, 3, hnd=True) == side_units(3, 4, 128, 0, 3) == 12        # rotated: a (token, head) a warp
    assert layers_units((KvLayer * 1).from_buffer_copy(raw)) == (-(-(4 * 8 + 32) // 32), 5)   # per token, fixed
    # kv_launch counts (side, head chunk) in one int: the driver refuses what would not fit
    with pytest.raises(ValueError, match="heads is 65536, more than a row launch's 65535"):
        KvKernels().kv_layer_table([(65536, 16, *sides)])
    with pytest.raises(ValueError, match="a layer table of 16384 layers is more than a row launch's 16383"):
        KvKernels().kv_layer_table([(4, 128, *sides)] * 16384)


def test_disk_layout_records_hnd_and_refuses_the_other_layout():
    from pagedkv.tiers import disk_layout

    rows = [{"layer": 0, "side": "K", "dtype": "bf16", "num_kv_heads": 2, "head_dim": 16, "stride": 256}]
    nhd = disk_layout.describe(rows, 4, False, None, None)
    hnd = disk_layout.describe(rows, 4, False, None, None, "HND")
    assert "block_layout" not in nhd and hnd["block_layout"] == "HND"
    assert disk_layout.differences(nhd, hnd) == ["block_layout: here 'NHD', directory 'HND'"]
    assert disk_layout.differences(hnd, dict(hnd)) == []


def test_layer_launches_refuse_more_layers_than_the_side_counter_holds():
    """kv_write_layers / kv_read_layers take num_layers apart from the table: past
    MAX_LAUNCH_LAYERS (2 * layers sides no longer fit kv_launch's counter) or negative, it
    is refused naming it before anything is launched; the limit itself is launched."""
    import threading

    from pagedkv.driver.kv_kernels import MAX_LAUNCH_LAYERS, KvKernels

    class Recording(KvKernels):
        def __init__(self):
            self._lock, self.launched = threading.Lock(), []
            self._launchers = {name: self._launcher(name) for name in ("pagedkv_kv_write", "pagedkv_kv_read")}

        def _launcher(self, name):
            outer = self

            class Launcher:
                def launch(self, grid, handle, **fields):
                    outer.launched.append((name, fields["num_layers"]))

            return Launcher()

        def _stream(self, stream):
            return stream

        def _enter(self):
            pass

        def _grid(self, name, units):
            return 1

    backend = Recording()
    assert MAX_LAUNCH_LAYERS == 16383
    for call in (backend.kv_write_layers, backend.kv_read_layers):
        for bad, error in ((16384, "num_layers is 16384, more than a layer launch's 16383"),
                           (2**20, "num_layers is 1048576, more than"),
                           (-1, "num_layers must be a non-negative int, got -1")):
            with pytest.raises(ValueError, match=error):
                call(4096, bad, 8192, 1, 16, 64, 0)
            with pytest.raises(ValueError, match=error):   # refused with no tokens too
                call(4096, bad, 8192, 0, 16, 64, 0)
        call(4096, MAX_LAUNCH_LAYERS, 8192, 1, 16, 64, 0)
    assert backend.launched == [("pagedkv_kv_write", 16383), ("pagedkv_kv_read", 16383)]
