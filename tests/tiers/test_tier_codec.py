"""HostTier(format=...): host blocks in a smaller pagedkv format, encoded on the device (the
KV row kernels, or the host codecs on HostBackend) before the copy and decoded after it.
A host block holds exactly `encode(tier, decode(device, x))`, a block swapped back in
exactly `encode(device, decode(tier, host))`, for every device format and the tier formats
smaller than it; through a disk tier too."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import KvCacheConfig, KvCacheDtype, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.backends.capabilities import backend_supports
from pagedkv.codecs import decode, encode
from pagedkv.tiers.host_tier import HostTier

BS, HEADS, DIM = 4, 2, 32
TIER_FORMATS = ("fp8", "turbo4k_turbo3v", "turbo2")


@pytest.fixture
def gpu(gpu):
    if not backend_supports(gpu, "host_tier"):
        pytest.skip(f"{type(gpu).__name__} does not state 'host_tier'")
    return gpu


def _config(fmt, layers=2, **kw) -> KvCacheConfig:
    return KvCacheConfig(block_size=BS, num_kv_heads=HEADS, head_dim=DIM, num_layers=layers, dtype=fmt, **kw)


def _pairs():
    size = lambda f: _config(f, 1).block_bytes_kv_all_layers()  # noqa: E731
    for device in KvCacheDtype:
        for tier in TIER_FORMATS:
            if tier != str(device) and size(tier) <= size(device):
                yield str(device), tier


def _side(data: np.ndarray, src: str, dst: str) -> bytes:
    return encode(decode(data.tobytes(), src, BS, HEADS, DIM), dst)


def _write(cache, gpu, blocks, seed):
    rng = np.random.default_rng(seed)
    for layer in range(cache.num_layers()):
        for b in blocks:
            x = rng.normal(size=(2, BS, HEADS, DIM)).astype(np.float32)
            cache.write_tokens(layer, np.arange(BS) + b * BS, x[0], x[1], gpu, gpu.default_stream())


def test_every_pairing_is_the_host_codecs_both_ways(gpu):
    """Every pairing on the host; on a device backend (the stub's CPU harness is slow) every
    device format with its first tier format, which runs the same kernels."""
    from pagedkv import HostBackend

    stream = gpu.default_stream()
    pairs = list(_pairs())
    if not isinstance(gpu, HostBackend):
        pairs = list({device: (device, tier) for device, tier in reversed(pairs)}.values())
    for device_fmt, tier_fmt in pairs:
        cache = PagedKvCache(_config(device_fmt, 1), 6, gpu)
        tier = HostTier(cache, 3, gpu, format=tier_fmt, staging_blocks=2)  # 3 blocks: chunks of 2 and 1
        try:
            blocks = cache.alloc_blocks(3)
            _write(cache, gpu, blocks, 7)
            hosts = tier.alloc(3)
            tier.swap_out(blocks, hosts, stream).wait()
            dk, dv = KvCacheDtype.parse(device_fmt).kv_pair()
            tk, tv = KvCacheDtype.parse(tier_fmt).kv_pair()
            for layer in range(1):
                for b, h in zip(blocks, hosts):
                    k, v = cache.read_block(layer, b, gpu)
                    hk, hv = tier.read_block(layer, h)
                    assert hk.tobytes() == _side(k, str(dk), str(tk)), (device_fmt, tier_fmt, layer, "K down")
                    assert hv.tobytes() == _side(v, str(dv), str(tv)), (device_fmt, tier_fmt, layer, "V down")
            back = cache.alloc_blocks(3)
            tier.swap_in(hosts, back, stream).wait()
            for layer in range(1):
                for b, h in zip(back, hosts):
                    k, v = cache.read_block(layer, b, gpu)
                    hk, hv = tier.read_block(layer, h)
                    assert k.tobytes() == _side(hk, str(tk), str(dk)), (device_fmt, tier_fmt, layer, "K up")
                    assert v.tobytes() == _side(hv, str(tv), str(dv)), (device_fmt, tier_fmt, layer, "V up")
            assert tier.format_name() == tier_fmt
            assert tier.block_bytes() == _config(tier_fmt, 1).block_bytes_kv_all_layers()
        finally:
            tier.release(gpu)
            cache.release(gpu)


def test_a_layer_in_its_own_format_is_copied_byte_for_byte(gpu):
    cache = PagedKvCache(_config("bf16", layer_dtypes=("bf16", "turbo3")), 4, gpu)
    tier = HostTier(cache, 2, gpu, format=("fp8", None))
    try:
        blocks = cache.alloc_blocks(2)
        _write(cache, gpu, blocks, 3)
        tier.swap_out(blocks, tier.alloc(2), gpu.default_stream()).wait()
        assert tier.format_name() == "fp8,turbo3"
        for b, h in zip(blocks, (0, 1)):
            k, v = cache.read_block(1, b, gpu)
            hk, hv = tier.read_block(1, h)
            assert np.array_equal(k, hk) and np.array_equal(v, hv)
            assert tier.read_block(0, h)[0].nbytes == cache.read_block(0, b, gpu)[0].nbytes // 2
    finally:
        tier.release(gpu)
        cache.release(gpu)


def test_a_larger_tier_format_or_a_wrong_layer_count_is_refused(host):
    cache = PagedKvCache(_config("turbo3"), 2, host)
    try:
        with pytest.raises(ValueError, match=r"tier format fp8 of layer 0 takes 512 bytes a block, more than its "
                                             r"device format turbo3 \(224\)"):
            HostTier(cache, 2, host, format="fp8")
        with pytest.raises(ValueError, match="format lists 1 layer formats for a cache of 2 layers"):
            HostTier(cache, 2, host, format=("turbo2",))
        assert host.live_bytes() == cache.config().block_bytes_kv_all_layers() * 2  # nothing left behind
    finally:
        cache.release(host)


def test_through_a_lossy_host_tier_and_the_disk_a_block_comes_back_with_the_stated_error(host, tmp_path):
    from pagedkv.tiers.disk_tier import DiskTier

    config = _config("bf16")
    cache = PagedKvCache(config, 4, host)
    tier = HostTier(cache, 3, host, format="fp8")
    disk = DiskTier(tmp_path, 1 << 20)
    prefix = PrefixCache(cache, host_tier=tier, disk_tier=disk)
    table = SequenceTable(cache, prefix, host)
    try:
        first = list(range(3 * BS + 1))
        table.add("a", first)
        _write(cache, host, table.blocks("a")[:3], 11)
        want = [[cache.read_block(layer, b, host) for layer in range(2)] for b in table.blocks("a")[:3]]
        table.free("a")
        for chain in (1, 2):  # push it down: device -> host (fp8) -> disk
            table.add(f"o{chain}", [chain * 1000 + t for t in range(3 * BS + 1)])
            table.free(f"o{chain}")
            cache.free_blocks(cache.alloc_blocks(4))
        assert prefix.match(first).disk_num_tokens == 12
        with pytest.raises(ValueError, match="DiskTier\\(format='turbo2'\\) stores the host tier's blocks, which hold 'fp8'"):
            DiskTier(tmp_path / "other", 1 << 20, format="turbo2").bind(tier)
        assert table.add("b", first) == 12
        for i, b in enumerate(table.blocks("b")[:3]):
            for layer in range(2):
                k, v = cache.read_block(layer, b, host)
                assert k.tobytes() == _side(np.frombuffer(_side(want[i][layer][0], "bf16", "fp8"), np.uint8), "fp8", "bf16")
                assert v.tobytes() == _side(np.frombuffer(_side(want[i][layer][1], "bf16", "fp8"), np.uint8), "fp8", "bf16")
                assert not np.array_equal(k, want[i][layer][0])  # lossy: not the original bytes
        prefix.check_invariants()
    finally:
        table.release(host)
        prefix.close()
        disk.close()
        tier.release(host)
        cache.release(host)


def test_values_a_tier_format_refuses_are_dropped_not_raised_into_the_step(host):
    from structlog.testing import capture_logs

    cache = PagedKvCache(_config("bf16"), 4, host)
    tier = HostTier(cache, 4, host, format="fp8")
    prefix = PrefixCache(cache, host_tier=tier)
    table = SequenceTable(cache, prefix, host)
    try:
        table.add("a", list(range(3 * BS + 1)))
        cache.fill_blocks(table.blocks("a")[:3], 0xFF, host, 0)  # BF16 NaN everywhere
        table.free("a")
        with capture_logs() as logs:
            cache.free_blocks(cache.alloc_blocks(4))  # evicts: the host codec refuses NaN
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["prefix_cache_demotion_refused"]
        assert prefix.num_host_blocks() == 0 and tier.num_free_blocks() == 4
        prefix.check_invariants()
    finally:
        table.release(host)
        prefix.close()
        tier.release(host)
        cache.release(host)
