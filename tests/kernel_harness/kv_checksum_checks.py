"""Exact checksum kernel checks over the libcuda stub (pagedkv_kv_checksum_* of
nvrtc_src/kv_rows.cu against the host decode of pagedkv.codecs): each `checksum_case_body`
is the body of one subprocess (kernel_harness.stub.PRELUDE first) that builds the same
multi-layer pools on CudaBackend and HostBackend with the same bytes and asserts, under two
CTA orders, that the `kv_checksum` and `kv_block_checksum` events of pagedkv.kv.diagnostics
are identical on both backends (CudaBackend reducing every format on the device,
HostBackend decoding on the host) and equal to math.fsum over `codecs.decode` of each
block's bytes (exact_sum's rules where a value is NaN or inf).

Pool bytes, per side (block: content): 6: zeros, except a turbo8 side's random bytes with
BF16 scales below 2^-126 (float32 denormal values: their sums are tiny, so a dropped
denormal shows); 0, 1: token rows encoded by the host codec
(Gaussian with an outlier channel, all-zero groups, float32 denormals, values at and past
+-448, a huge one); 2: random bytes with bit 6 of every byte clear (every decode finite,
float32 denormal products among them); 3: random bytes with bit 0 clear (no E4M3 NaN;
turbo8 products may overflow to inf); 4: any random bytes (NaN codes); 4 also gets a
row with NaN and -inf inputs, 5 (else encoded rows) one with a +inf, written by the device
write kernel (the host codec refuses them).
At 2 SMs one CTA per SM, so the partial pass loops over several blocks per CTA.
"""

from __future__ import annotations

from .checks import ORDERS

CASES = {
    # name: (layer formats, (heads, head_dim) per layer, block_size[, block layout: NHD])
    "all_formats_hd128_bs16": ("ALL", [(2, 128)], 16),
    "all_formats_hd64_hd48_bs1": ("ALL", [(2, 64), (1, 48)], 1),
    # HND blocks: the grouped formats' blocks go to the kernel as their head chunks
    "hnd_all_formats_hd64_hd48_bs16": ("ALL", [(3, 64), (2, 48)], 16, "HND"),
    "turbo_hd256_hd512_bs32": (
        ["turbo4", "turbo3", "turbo2", "turbo8", "nvfp4", "fp8", "turbo4k_turbo3v", "fp8k_turbo2v"],
        [(1, 256), (1, 512), (1, 256), (1, 512), (1, 256), (1, 512), (1, 512), (1, 256)],
        32,
    ),
    # the mutation test's case: every decoder family at one dim, one CTA order
    "mutation_small": (["nvfp4", "turbo8", "fp8k_turbo3v", "turbo2", "bf16k_turbo4v"], [(1, 64)], 16),
}

_BODY = '''
import math
import os
from structlog.testing import capture_logs
from pagedkv import HostBackend, KvCacheConfig, KvCacheDtype
from pagedkv.kv import diagnostics
from pagedkv.kv import rows as kv_rows
from pagedkv.codecs import decode
from pagedkv.core.dtype import side_bytes, side_data_bytes
from pagedkv.core.exact_sum import float_stats
from pagedkv.driver import CudaBackend
from pagedkv.driver.kv_kernels import KvSideArgs
from pagedkv.kv.pools import KvPools

SMS = {sms}
STUB.stub_set_device(SMS, 9, 0)
if SMS == 2:
    STUB.stub_set_occupancy(1)   # 2 CTAs: the partial pass's grid-stride loop wraps
ORDERS = {orders!r}
FORMATS, DIMS, BLOCK_SIZE, LAYOUT = {case!r}
if FORMATS == "ALL":
    FORMATS = [f.value for f in KvCacheDtype]
DIMS = [DIMS[i % len(DIMS)] for i in range(len(FORMATS))]
config = KvCacheConfig(block_size=BLOCK_SIZE, num_kv_heads=DIMS[0][0], head_dim=DIMS[0][1],
                       num_layers=len(FORMATS), dtype=FORMATS[0], layer_dtypes=tuple(FORMATS),
                       layer_dims=tuple(DIMS), layout=LAYOUT)
NB = 7
SETS = (([1, 2, 0, 3, 1], 2), ([4, 5, 0], 1), ([6, 6], 1))   # (blocks, boundary) of checksum_per_layer
PER_BLOCK = [0, 2, 5, 6]                                      # blocks of per_block, every layer

def rows_for(heads, head_dim, seed):
    r = np.random.default_rng(seed)
    x = (r.normal(size=(2 * BLOCK_SIZE, heads, head_dim)) * 2).astype(np.float32)
    x[:, :, 5] *= 60.0                                             # outlier channel
    x[0, 0, :16] = 0.0                                             # all-zero group
    x[-1, 0, 16:32] = np.float32(1e-40) * r.integers(-3, 4, 16)    # float32 denormals
    x[-1, -1, -4:] = (448.0, -448.0, 500.0, -1e4)                  # at and past +-448
    x[0, -1, 0] = 3.0e5                                            # a huge value
    return x

def sides(pools, layer):
    return ((pools.k_pool(layer), pools.k_stride(layer)), (pools.v_pool(layer), pools.v_stride(layer)))

def host_pools_bytes(host):
    pools = KvPools(config, NB, host)
    r = np.random.default_rng(7)
    for layer in range(len(FORMATS)):
        for (ptr, stride), mask in zip(sides(pools, layer), (0xBF, 0xFE)):
            raw = r.integers(0, 256, NB * stride, dtype=np.uint8)
            raw[2 * stride : 3 * stride] &= 0xBF
            raw[3 * stride : 4 * stride] &= 0xFE
            raw[6 * stride : 7 * stride] = 0
            host.copy_h2d(raw, ptr)
        for side, (ptr, stride) in zip(config.dtype_for_layer(layer).kv_pair(), sides(pools, layer)):
            if side.value == "turbo8":   # block 6: BF16 scales below 2^-126, so most values are float32 denormals
                n = BLOCK_SIZE * DIMS[layer][0] * DIMS[layer][1]
                data = side_data_bytes(side, n)
                tiny = r.integers(0, 256, side_bytes(side, n), dtype=np.uint8) & 0xBF
                tiny[data + 1 :: 2] &= 0x80
                host.copy_h2d(tiny, ptr.offset(6 * stride))
        slots = np.r_[np.arange(2 * BLOCK_SIZE), np.arange(5 * BLOCK_SIZE, 6 * BLOCK_SIZE)].astype(np.int64)
        k = np.concatenate([rows_for(*DIMS[layer], 2 * layer), rows_for(*DIMS[layer], 2 * layer)[:BLOCK_SIZE]])
        v = np.concatenate([rows_for(*DIMS[layer], 2 * layer + 1), rows_for(*DIMS[layer], 2 * layer + 1)[:BLOCK_SIZE]])
        kv_rows.write_tokens(pools, layer, slots, k, v, host, 0)
    return pools

def nonfinite_rows(heads, head_dim):
    """Token 0 (to block 5) with a +inf, token 1 (to block 4) with a NaN and a -inf."""
    x = rows_for(heads, head_dim, 5)[:2]
    x[0, -1, 7] = np.inf
    x[1, 0, 3] = np.nan
    x[1, 0, 20] = -np.inf
    return x

def same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

def events_equal(got, want, what):
    assert len(got) == len(want), (what, len(got), len(want))
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(same(g[k], w[k]) for k in g), (what, g, w)

def reference(host, pools, layer, side, blocks):
    """(sum, ssq, sabs) from math.fsum over codecs.decode of each block (no unrotation)."""
    fmt = config.dtype_for_layer(layer).kv_pair()["KV".index(side)]
    heads, head_dim = DIMS[layer]
    nbytes = side_bytes(fmt, BLOCK_SIZE * heads * head_dim)
    ptr, stride = sides(pools, layer)["KV".index(side)]
    nhd = config.side_layout(layer, side).to_nhd   # the codecs decode NHD bytes
    x = np.concatenate([np.zeros(0, np.float32)] + [
        decode(nhd(host.view(ptr.offset(b * stride), nbytes)), fmt, BLOCK_SIZE, heads, head_dim, unrotate=False).ravel()
        for b in blocks]).astype(np.float64)
    if np.isfinite(x).all():
        return (math.fsum(x.tolist()) + 0.0, math.fsum((x * x).tolist()) + 0.0, math.fsum(np.abs(x).tolist()) + 0.0)
    return tuple(float_stats(x.astype(np.float32)))

def run_diagnostics(backend, pools, stream):
    with capture_logs() as logs:
        for blocks, boundary in SETS:
            diagnostics.checksum_per_layer(pools, blocks, boundary, backend, stream, "c")
        for layer in range(len(FORMATS)):
            diagnostics.per_block(pools, layer, PER_BLOCK, backend, stream, "b")
    return logs

np.seterr(all="ignore")   # garbage bytes decode to inf and NaN on the host too
host = HostBackend(1 << 26)
hpools = host_pools_bytes(host)
finite_prefix = 0
for order in ORDERS:
    os.environ["PAGEDKV_HARNESS_ORDER"] = order
    with CudaBackend() as gpu:
        pools = KvPools(config, NB, gpu)
        stream = gpu.create_stream()
        slots = gpu.alloc(16)
        gpu.copy_h2d(np.array([5 * BLOCK_SIZE, 4 * BLOCK_SIZE], np.int64), slots)
        for layer in range(len(FORMATS)):
            for (hp, stride), (gp, _) in zip(sides(hpools, layer), sides(pools, layer)):
                gpu.copy_h2d(host.view(hp, NB * stride), gp)
            heads, head_dim = DIMS[layer]
            rows = nonfinite_rows(heads, head_dim)
            rp = gpu.alloc(rows.nbytes)
            gpu.copy_h2d(rows, rp)
            k_fmt, v_fmt = config.dtype_for_layer(layer).kv_pair()
            gpu.kv_write_rows(slots, 2, heads, head_dim, BLOCK_SIZE, NB * BLOCK_SIZE,
                              KvSideArgs(k_fmt, pools.k_pool(layer), pools.k_stride(layer), rp, heads * head_dim,
                                         layout=LAYOUT),
                              KvSideArgs(v_fmt, pools.v_pool(layer), pools.v_stride(layer), rp, heads * head_dim,
                                         layout=LAYOUT),
                              stream)
            gpu.synchronize(stream)
            gpu.free(rp)
            for (hp, stride), (gp, _) in zip(sides(hpools, layer), sides(pools, layer)):
                gpu.copy_d2h(gp, host.view(hp, NB * stride))   # the host pools now hold the device bytes
        if order == ORDERS[0]:   # the stub keeps the first 1024 launch records
            layer = next(i for i, f in enumerate(FORMATS) if config.dtype_for_layer(i).kv_pair()[1].value != "bf16")
            v_fmt = config.dtype_for_layer(layer).kv_pair()[1]
            got_direct = gpu.reduce_kv_blocks(pools.regions(), pools.region_index(layer, "V"), [1, 2, 0, 3, 1], v_fmt,
                                              BLOCK_SIZE, DIMS[layer][0] * DIMS[layer][1], stream, layout=LAYOUT,
                                              heads=DIMS[layer][0])
            (part, _), (fin, _) = launch(-2), launch(-1)
            assert (part.name, fin.name, fin.grid[0]) == (b"pagedkv_kv_checksum_partial", b"pagedkv_kv_checksum_final", 1)
            assert part.grid[0] == (2 if SMS == 2 else 5), part.grid[0]
            assert all(same(a, b) for a, b in zip(got_direct, reference(host, hpools, layer, "V", [1, 2, 0, 3, 1])))
        first_launch = STUB.stub_launch_count()
        got = run_diagnostics(gpu, pools, stream)
        reductions = len(FORMATS) * (len(SETS) * 2 * 2 + len(PER_BLOCK) * 2)
        assert STUB.stub_launch_count() - first_launch == 2 * reductions, "two launches a side reduction"
        want = run_diagnostics(host, hpools, 0)
        events_equal(got, want, order)
        # every event against math.fsum over the host decode
        per_layer = [e for e in got if e["event"] == "kv_checksum"]
        assert len(per_layer) == len(SETS) * len(FORMATS) * 2 * 2
        i = 0
        for blocks, boundary in SETS:
            for layer in range(len(FORMATS)):
                for region, idx in (("prefix", blocks[:boundary]), ("suffix", blocks[boundary:])):
                    for side in "KV":
                        e = per_layer[i]
                        i += 1
                        assert (e["layer"], e["region"], e["side"]) == (layer, region, side), e
                        ref = reference(host, hpools, layer, side, idx)
                        assert all(same(a, b) for a, b in zip((e["sum"], e["ssq"], e["sabs"]), ref)), (e, ref)
                        if blocks is SETS[0][0] and region == "prefix":
                            assert math.isfinite(e["sum"]) and e["ssq"] > 0, e
                            finite_prefix += 1
        per_block = [e for e in got if e["event"] == "kv_block_checksum"]
        assert len(per_block) == len(FORMATS) * len(PER_BLOCK)
        for e in per_block:
            for side in "KV":
                ref = reference(host, hpools, e["layer"], side, [e["phys"]])[1]
                assert same(e[side.lower() + "_ssq"], ref), (e, side, ref)
        gpu.free(slots)
        gpu.destroy_stream(stream)
        pools.release(gpu)
assert finite_prefix == len(ORDERS) * len(FORMATS) * 2
print("CHECK checksum ok")
'''


def checksum_case_body(case: str, sms: int, orders=ORDERS) -> str:
    """The subprocess body of checksum case `case` (a key of CASES) on a stub of `sms` SMs;
    prints `CHECK checksum ok` when every assertion held."""
    return _BODY.format(orders=tuple(orders), case=(*CASES[case], "NHD")[:4], sms=sms)
