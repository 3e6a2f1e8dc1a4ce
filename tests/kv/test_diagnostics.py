"""Checksum diagnostics: structlog events whose sums are checked against ml_dtypes/numpy sums."""

import math

import ml_dtypes
import numpy as np
import pytest
from structlog.testing import capture_logs

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache

BLOCKS = 6
EVENT_KEYS = {"event", "log_level", "component", "tag", "layer", "region", "side", "nblk", "sum", "ssq", "sabs"}


def make(gpu, dtype="bf16", layers=3, **kw):
    cfg = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=layers, dtype=dtype, **kw)
    cache = PagedKvCache(cfg, BLOCKS, gpu)
    cache.alloc_blocks(BLOCKS)  # only held blocks may be written
    return cache


def bf16_values(n, rng, dyadic=True):
    """n BF16 values; dyadic ones (multiples of 1/4 up to 16) make every float64 sum exact."""
    raw = rng.integers(-64, 65, n) / 4.0 if dyadic else rng.standard_normal(n) * 2
    return raw.astype(ml_dtypes.bfloat16)


def write_known(cache, gpu, seed=0, dyadic=True):
    """Fill every BF16 side of every block with known values; return {(layer, side, block): values}."""
    rng = np.random.default_rng(seed)
    known = {}
    for layer in range(cache.num_layers()):
        k_fmt, v_fmt = cache.dtype_for_layer(layer).kv_pair()
        for b in range(cache.num_blocks()):
            k = v = None
            if str(k_fmt) == "bf16":
                k = known[layer, "K", b] = bf16_values(cache.k_block_stride_bytes_for_layer(layer) // 2, rng, dyadic)
            if str(v_fmt) == "bf16" and not cache.config().v_aliases_k:
                v = known[layer, "V", b] = bf16_values(cache.v_block_stride_bytes_for_layer(layer) // 2, rng, dyadic)
            cache.write_block(layer, b, k, v, gpu)
    return known


def expected_sums(known, layer, side, blocks):
    if not blocks:
        return 0.0, 0.0, 0.0
    v = np.concatenate([known[layer, side, b].astype(np.float64) for b in blocks])
    return float(v.sum()), float((v * v).sum()), float(np.abs(v).sum())


def checksum_events(logs):
    return [e for e in logs if e["event"] == "kv_checksum"]


def test_bf16_values_round_trip_through_the_cache(gpu):
    cache = make(gpu, layers=1)
    known = write_known(cache, gpu)
    k, v = cache.read_block(0, 3, gpu)
    np.testing.assert_array_equal(k.view(ml_dtypes.bfloat16), known[0, "K", 3])
    np.testing.assert_array_equal(v.view(ml_dtypes.bfloat16), known[0, "V", 3])
    cache.release(gpu)


def test_checksum_events_exact(gpu):
    cache = make(gpu)
    known = write_known(cache, gpu)
    blocks = [4, 1, 5, 2]
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer(blocks, 2, gpu, gpu.default_stream(), "step7")
    events = checksum_events(logs)
    assert len(logs) == len(events) == 3 * 2 * 2
    expected_order = [(l, r, s) for l in range(3) for r in ("prefix", "suffix") for s in ("K", "V")]
    assert [(e["layer"], e["region"], e["side"]) for e in events] == expected_order
    for e in events:
        assert set(e) == EVENT_KEYS
        assert e["tag"] == "step7" and e["log_level"] == "info"
        region_blocks = blocks[:2] if e["region"] == "prefix" else blocks[2:]
        assert e["nblk"] == 2
        assert (e["sum"], e["ssq"], e["sabs"]) == expected_sums(known, e["layer"], e["side"], region_blocks)
        assert all(isinstance(e[k], float) for k in ("sum", "ssq", "sabs"))
    cache.release(gpu)


def test_checksum_normal_values(gpu):
    cache = make(gpu, layers=2)
    known = write_known(cache, gpu, seed=9, dyadic=False)
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer([0, 1, 2, 3, 4, 5], 4, gpu, gpu.default_stream(), "n")
    for e in checksum_events(logs):
        region_blocks = [0, 1, 2, 3] if e["region"] == "prefix" else [4, 5]
        want = expected_sums(known, e["layer"], e["side"], region_blocks)
        assert (e["sum"], e["ssq"], e["sabs"]) == pytest.approx(want, rel=1e-12, abs=1e-12)
    cache.release(gpu)


@pytest.mark.parametrize("boundary, prefix_len", [(-3, 0), (0, 0), (1, 1), (3, 3), (4, 3), (100, 3)])
def test_boundary_clamps_to_the_list(gpu, boundary, prefix_len):
    cache = make(gpu, layers=1)
    known = write_known(cache, gpu, seed=2)
    blocks = [3, 0, 5]
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer(blocks, boundary, gpu, gpu.default_stream(), "b")
    events = {(e["region"], e["side"]): e for e in checksum_events(logs)}
    assert len(events) == 4
    for (region, side), e in events.items():
        region_blocks = blocks[:prefix_len] if region == "prefix" else blocks[prefix_len:]
        assert e["nblk"] == len(region_blocks)
        assert (e["sum"], e["ssq"], e["sabs"]) == expected_sums(known, 0, side, region_blocks)
    cache.release(gpu)


@pytest.mark.parametrize("boundary", [1.7, True, "1"])
def test_boundary_must_be_an_int(gpu, boundary):
    cache = make(gpu, layers=1)
    with capture_logs() as logs, pytest.raises(TypeError, match=f"boundary_idx must be an int, got {boundary!r}"):
        cache.debug_kv_checksum_per_layer([0, 1], boundary, gpu, gpu.default_stream(), "b")
    assert checksum_events(logs) == []
    cache.release(gpu)


def test_checksum_zeroed_and_poisoned_blocks(gpu):
    cache = make(gpu, layers=1)
    cache.zero_blocks([0, 1], gpu, gpu.default_stream())
    cache.poison_block(2, gpu, gpu.default_stream())
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer([0, 1, 2], 2, gpu, gpu.default_stream(), "z")
    events = checksum_events(logs)
    for e in events:
        if e["region"] == "prefix":
            assert (e["sum"], e["ssq"], e["sabs"]) == (0.0, 0.0, 0.0)
        else:  # BF16 0xFFFF is a NaN: poison shows in every sum
            assert np.isnan(e["sum"]) and np.isnan(e["ssq"]) and np.isnan(e["sabs"])
    cache.release(gpu)


def decoded_sums(cache, gpu, layer, side, blocks):
    """math.fsum over the values read_tokens decodes (no unrotation, fp8 scale 1) of every
    slot of `blocks`: the reference the checksums must equal exactly."""
    if not blocks:
        return 0.0, 0.0, 0.0
    bs = cache.config().block_size
    slots = np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in blocks]).astype(np.int64)
    k, v = cache.read_tokens(layer, slots, gpu, unrotate=False)
    x = (k if side == "K" else v).astype(np.float64).ravel()
    return math.fsum(x) + 0.0, math.fsum(x * x) + 0.0, math.fsum(np.abs(x)) + 0.0


def write_random_tokens(cache, gpu, seed):
    rng = np.random.default_rng(seed)
    bs = cache.config().block_size
    slots = np.arange(cache.num_blocks() * bs, dtype=np.int64)
    for layer in range(cache.num_layers()):
        heads, head_dim = cache.config().dims_for_layer(layer)
        k = (rng.standard_normal((slots.size, heads, head_dim)) * 3).astype(np.float32)
        v = (rng.standard_normal((slots.size, heads, head_dim)) * 3).astype(np.float32)
        k[0, 0, :16] = 0.0  # an all-zero group
        cache.write_tokens(layer, slots, k, v, gpu, gpu.default_stream())


def test_every_format_is_checksummed_exactly(gpu):
    formats = ["fp8", "bf16", "turbo4", "nvfp4", "turbo8", "turbo3", "turbo2", "fp8k_turbo2v"]
    cache = make(gpu, "bf16", layers=len(formats), layer_dtypes=formats)
    write_random_tokens(cache, gpu, seed=3)
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer([1, 2, 4], 1, gpu, gpu.default_stream(), "w")
    assert [e["log_level"] for e in logs] == ["info"] * (len(formats) * 4)
    events = checksum_events(logs)
    assert [(e["layer"], e["region"], e["side"]) for e in events] == [
        (layer, region, side) for layer in range(len(formats)) for region in ("prefix", "suffix") for side in "KV"]
    for e in events:
        region_blocks = [1] if e["region"] == "prefix" else [2, 4]
        want = decoded_sums(cache, gpu, e["layer"], e["side"], region_blocks)
        assert (e["sum"], e["ssq"], e["sabs"]) == want, (formats[e["layer"]], e["side"], e["region"])
        assert e["ssq"] > 0
    cache.release(gpu)


def test_no_warning_when_layer0_is_bf16(gpu):
    cache = make(gpu, "fp8", layers=2, layer_dtypes=["bf16"])
    write_known(cache, gpu)
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer([0], 1, gpu, gpu.default_stream(), "x")
    assert [e["log_level"] for e in logs] == ["info"] * 8
    assert {e["layer"] for e in logs} == {0, 1}
    cache.release(gpu)


def test_mixed_formats_and_dims(gpu):
    # layer 0 bf16 at (1, 16) (64 values a side), layer 1 bf16k_turbo4v (K only), layer 2 global bf16
    cache = make(gpu, "bf16", layers=3, layer_dtypes=["bf16", "bf16k4v"], layer_dims=[(1, 16)])
    cache.init_blocks(list(range(BLOCKS)), gpu, gpu.default_stream())  # layer 1's V is never written: zeros, not stale memory
    known = write_known(cache, gpu, seed=4)
    assert known[0, "K", 0].size == 64 and known[2, "K", 0].size == 128
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer([5, 3, 1], 1, gpu, gpu.default_stream(), "m")
    events = checksum_events(logs)
    assert [(e["layer"], e["region"], e["side"]) for e in events] == [
        (0, "prefix", "K"), (0, "prefix", "V"), (0, "suffix", "K"), (0, "suffix", "V"),
        (1, "prefix", "K"), (1, "prefix", "V"), (1, "suffix", "K"), (1, "suffix", "V"),
        (2, "prefix", "K"), (2, "prefix", "V"), (2, "suffix", "K"), (2, "suffix", "V"),
    ]
    for e in events:
        region_blocks = [5] if e["region"] == "prefix" else [3, 1]
        if (e["layer"], e["side"]) == (1, "V"):  # turbo4: decoded values
            want = decoded_sums(cache, gpu, 1, "V", region_blocks)
        else:
            want = expected_sums(known, e["layer"], e["side"], region_blocks)
        assert (e["sum"], e["ssq"], e["sabs"]) == want
    cache.release(gpu)


def test_aliased_v_is_checksummed_once(gpu):
    cache = make(gpu, "bf16", layers=2, v_aliases_k=True)
    known = write_known(cache, gpu, seed=5)
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer([0, 2], 1, gpu, gpu.default_stream(), "a")
    events = checksum_events(logs)
    assert len(logs) == len(events) == 4 and {e["side"] for e in events} == {"K"}
    for e in events:
        region_blocks = [0] if e["region"] == "prefix" else [2]
        assert (e["sum"], e["ssq"], e["sabs"]) == expected_sums(known, e["layer"], "K", region_blocks)
    cache.release(gpu)


class CountingBackend(HostBackend):
    """A HostBackend that logs which of its entry points were called, in order."""

    def __init__(self):
        super().__init__(capacity_bytes=1 << 26)
        self.calls = []

    def synchronize(self, stream):
        self.calls.append("synchronize")
        super().synchronize(stream)

    def reduce_bf16_blocks(self, regions, region, blocks, stream):
        self.calls.append("reduce")
        return super().reduce_bf16_blocks(regions, region, blocks, stream)

    def copy_d2h(self, src, dst):
        self.calls.append("copy_d2h")
        super().copy_d2h(src, dst)


def test_checksum_synchronises_then_reduces_on_the_backend():
    gpu = CountingBackend()
    cache = make(gpu, "bf16", layers=3, layer_dtypes=["bf16", "bf16k3v"])
    s = gpu.create_stream()
    cache.debug_kv_checksum_per_layer([0, 1, 2], 2, gpu, s, "c")
    # BF16 sides reduce on the backend; layer 1's turbo3 V is read back block by block
    bf16_layer = ["reduce"] * 4
    layer1 = ["reduce", "copy_d2h", "copy_d2h", "reduce", "copy_d2h"]
    assert gpu.calls == ["synchronize"] + bf16_layer + layer1 + bf16_layer
    cache.release(gpu)


def test_per_block_events(gpu):
    cache = make(gpu, layers=2)
    known = write_known(cache, gpu, seed=6)
    blocks = [5, 0, 3, 0]
    with capture_logs() as logs:
        cache.debug_kv_per_block(1, blocks, gpu, gpu.default_stream(), "pb")
    assert [e["event"] for e in logs] == ["kv_block_checksum"] * 4
    for logical, (e, phys) in enumerate(zip(logs, blocks)):
        assert set(e) == {"event", "log_level", "component", "tag", "layer", "logical", "phys", "k_ssq", "v_ssq"}
        assert (e["tag"], e["layer"], e["logical"], e["phys"]) == ("pb", 1, logical, phys)
        assert e["k_ssq"] == expected_sums(known, 1, "K", [phys])[1]
        assert e["v_ssq"] == expected_sums(known, 1, "V", [phys])[1]
    cache.release(gpu)


def test_per_block_covers_every_format(gpu):
    cache = make(gpu, "bf16", layers=3, layer_dtypes=["fp8", "bf16k2v"])
    write_random_tokens(cache, gpu, seed=7)
    with capture_logs() as logs:
        cache.debug_kv_per_block(0, [1, 2], gpu, gpu.default_stream(), "fp8")
    assert [(e["phys"], e["k_ssq"], e["v_ssq"]) for e in logs] == [
        (b, decoded_sums(cache, gpu, 0, "K", [b])[1], decoded_sums(cache, gpu, 0, "V", [b])[1]) for b in (1, 2)]
    with capture_logs() as logs:
        cache.debug_kv_per_block(1, [2], gpu, gpu.default_stream(), "asym")
    assert [(e["phys"], e["k_ssq"], e["v_ssq"]) for e in logs] == [
        (2, decoded_sums(cache, gpu, 1, "K", [2])[1], decoded_sums(cache, gpu, 1, "V", [2])[1])]
    cache.release(gpu)


def test_bad_block_raises_before_any_event(gpu):
    cache = make(gpu, layers=2)
    with capture_logs() as logs:
        with pytest.raises(IndexError, match=f"block {BLOCKS} out of range"):
            cache.debug_kv_checksum_per_layer([0, 1, BLOCKS], 1, gpu, gpu.default_stream(), "bad")
        with pytest.raises(IndexError, match="block -1 out of range"):
            cache.debug_kv_per_block(0, [0, 1, -1], gpu, gpu.default_stream(), "bad")
    assert logs == []
    cache.release(gpu)
