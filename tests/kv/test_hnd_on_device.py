"""HND blocks on CudaBackend over the libcuda stub (kernels on the CPU harness) against
HostBackend, the reference, through the cache's API: per-layer `write_tokens` (device rows
and slots, -1 among them) and `plan_layer_writes` leave every pool byte equal to
HostBackend's HND cache, zero and poison fills too; `read_tokens` (repeated and -1 slots,
with and without unrotation) and `plan_layer_reads` equal HostBackend's host decode bit for
bit; the checksum events equal HostBackend's and those of an NHD cache holding the same
rows (the sums do not depend on the layout). Mixed per-layer formats and dims; the
kernel-level cases (every format, both CTA orders) are in tests/driver. bf16 and fp8 caches
whose head_dim is not a multiple of 16 give HostBackend's checksums in both layouts."""

from __future__ import annotations

from kernel_harness.stub import run_on_stub

BODY = '''
import ml_dtypes
from structlog.testing import capture_logs
from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend

FORMATS = ("turbo4", "bf16k_turbo3v", "nvfp4", "fp8", "turbo8")
DIMS = ((4, 128), (2, 64), (3, 64), (2, 256), (2, 128))
BLOCK, NB, TOKENS = 4, 5, 6
def config_of(layout):
    return KvCacheConfig(block_size=BLOCK, num_kv_heads=4, head_dim=128, num_layers=len(FORMATS), dtype=FORMATS[0],
                         layer_dtypes=FORMATS, layer_dims=DIMS, layout=layout, k_scale=0.5, v_scale=2.0)
rng = np.random.default_rng(23)
rows = {layer: [rng.normal(size=(TOKENS, *DIMS[layer])).astype(np.float32) for _ in "kv"] for layer in range(len(FORMATS))}
for layer in rows:
    rows[layer][0][:, :, 3] *= 500.0                                  # past +-448 after the fp8 scale
    rows[layer][1][1, 0, :16] = 0.0                                   # an all-zero group
bf16_rows = {layer: [x.astype(ml_dtypes.bfloat16) for x in rows[layer]] for layer in rows}
WRITE_SLOTS = np.array([5, 17, -1, 2, 9, 19], np.int64)
PLAN_SLOTS = np.array([0, 13, 4, 18, -1, 7], np.int64)
READ_SLOTS = np.array([17, 5, 5, -1, 19, 2], np.int64)   # a repeated slot and a -1 one

def pools_of(cache, gpu):
    out = []
    for layer in range(len(FORMATS)):
        for side in "kv":
            size = NB * getattr(cache, f"{side}_block_stride_bytes_for_layer")(layer)
            got = np.empty(size, np.uint8)
            gpu.copy_d2h(getattr(cache, f"{side}_pool_ptr")(layer), got)
            out.append(got)
    return out

def on(gpu, x):
    ptr = gpu.alloc(x.nbytes)
    gpu.copy_h2d(np.ascontiguousarray(x).view(np.uint8).reshape(-1), ptr)
    return DeviceArray(ptr, x.shape, x.dtype.name if x.dtype.name != "bfloat16" else "bfloat16")

def fill(cache, gpu, stream):
    cache.alloc_blocks(NB)
    cache.zero_blocks(list(range(NB)), gpu, stream)
    cache.poison_blocks([3], gpu, stream)
    for layer, (k, v) in rows.items():
        if isinstance(gpu, HostBackend):
            cache.write_tokens(layer, WRITE_SLOTS, k, v, gpu, stream)
        else:
            cache.write_tokens(layer, on(gpu, WRITE_SLOTS), on(gpu, bf16_rows[layer][0]) if layer % 2 else on(gpu, k),
                               on(gpu, v), gpu, stream)

def checksums(cache, gpu, stream):
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer([1, 4, 0, 2], 2, gpu, stream, "t")
    return [{k: e[k] for k in ("layer", "region", "side", "sum", "ssq", "sabs")} for e in logs
            if e["event"] == "kv_checksum"]

host = HostBackend(1 << 26)
want = PagedKvCache(config_of("HND"), NB, host)
fill(want, host, 0)
for layer in (1, 3):   # BF16 rows on the device: the host twin writes the same values
    want.write_tokens(layer, WRITE_SLOTS, bf16_rows[layer][0].astype(np.float32), rows[layer][1], host, 0)
want_sums = checksums(want, host, 0)
want_reads = {(layer, unrot): want.read_tokens(layer, READ_SLOTS, host, unrot) for layer in rows for unrot in (True, False)}
with CudaBackend() as gpu:
    stream = gpu.create_stream()
    cache = PagedKvCache(config_of("HND"), NB, gpu)
    fill(cache, gpu, stream)
    gpu.synchronize(stream)
    for i, (got, exp) in enumerate(zip(pools_of(cache, gpu), pools_of(want, host))):
        bad = np.flatnonzero(got != exp)
        assert bad.size == 0, ("write_tokens", FORMATS[i // 2], "kv"[i % 2], bad[:6].tolist())
    # the checksums: HostBackend's HND cache, and an NHD cache on the device holding the same rows
    got_sums = checksums(cache, gpu, stream)
    assert got_sums == want_sums, (got_sums, want_sums)
    nhd = PagedKvCache(config_of("NHD"), NB, gpu)
    fill(nhd, gpu, stream)
    assert checksums(nhd, gpu, stream) == want_sums
    assert any((a != b).any() for a, b in zip(pools_of(nhd, gpu), pools_of(cache, gpu)))   # the layouts differ
    nhd.release(gpu)
    # per-layer reads: repeated and -1 slots, float32 and BF16 outputs
    slots = on(gpu, READ_SLOTS)
    for layer in rows:
        shape = (TOKENS, *DIMS[layer])
        for unrot in (True, False):
            for dtype, width in (("float32", 4), ("bfloat16", 2)):
                outs = [DeviceArray(gpu.alloc(TOKENS * DIMS[layer][0] * DIMS[layer][1] * width), shape, dtype)
                        for _ in "kv"]
                cache.read_tokens(layer, slots, gpu, unrot, out_k=outs[0], out_v=outs[1], stream=stream)
                gpu.synchronize(stream)
                for o, exp in zip(outs, want_reads[(layer, unrot)]):
                    got = np.empty(shape, np.float32 if width == 4 else ml_dtypes.bfloat16)
                    gpu.copy_d2h(o.ptr, got.view(np.uint8).reshape(-1))
                    exp = exp if width == 4 else exp.astype(ml_dtypes.bfloat16)
                    assert got.tobytes() == exp.tobytes(), ("read_tokens", layer, unrot, dtype)
                    gpu.free(o.ptr)
    # the layer-table launches: one plan write of every layer, one plan read
    plan = cache.plan_layer_writes(range(len(FORMATS)), [on(gpu, rows[l][1]) for l in rows],
                                   [on(gpu, rows[l][0]) for l in rows], gpu)
    plan.write(on(gpu, PLAN_SLOTS), stream)
    for layer in rows:
        want.write_tokens(layer, PLAN_SLOTS, rows[layer][1], rows[layer][0], host, 0)
    gpu.synchronize(stream)
    for i, (got, exp) in enumerate(zip(pools_of(cache, gpu), pools_of(want, host))):
        bad = np.flatnonzero(got != exp)
        assert bad.size == 0, ("plan_layer_writes", FORMATS[i // 2], "kv"[i % 2], bad[:6].tolist())
    plan.close()
    outs = {(l, s): DeviceArray(gpu.alloc(TOKENS * DIMS[l][0] * DIMS[l][1] * 4), (TOKENS, *DIMS[l]), "float32")
            for l in rows for s in "kv"}
    rplan = cache.plan_layer_reads(range(len(FORMATS)), [outs[(l, "k")] for l in rows], [outs[(l, "v")] for l in rows], gpu)
    rplan.read(slots, stream)
    gpu.synchronize(stream)
    for layer in rows:
        exp = want.read_tokens(layer, READ_SLOTS, host)
        for side, e in zip("kv", exp):
            got = np.empty((TOKENS, *DIMS[layer]), np.float32)
            gpu.copy_d2h(outs[(layer, side)].ptr, got)
            assert got.tobytes() == e.tobytes(), ("plan_layer_reads", layer, side)
    rplan.close()
    cache.release(gpu)
    gpu.destroy_stream(stream)
print("CHECK hnd ok")
'''


def test_hnd_cache_on_the_device_equals_the_host_reference(stub_env):
    assert "CHECK hnd ok" in run_on_stub(stub_env, BODY, timeout=300)


NARROW_BODY = '''
from structlog.testing import capture_logs
from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend

BLOCK, NB = 4, 3
FORMATS, DIMS = ("bf16", "fp8"), ((2, 8), (8, 72))   # head_dim 8 and 72: not multiples of 16
rng = np.random.default_rng(31)
rows = {layer: [rng.normal(size=(NB * BLOCK, *DIMS[layer])).astype(np.float32) for _ in "kv"] for layer in range(2)}
SLOTS = np.arange(NB * BLOCK, dtype=np.int64)[::-1].copy()

def on(gpu, x):
    ptr = gpu.alloc(x.nbytes)
    gpu.copy_h2d(np.ascontiguousarray(x).view(np.uint8).reshape(-1), ptr)
    return DeviceArray(ptr, x.shape, x.dtype.name)

def events(layout, gpu, stream):
    cfg = KvCacheConfig(block_size=BLOCK, num_kv_heads=2, head_dim=8, num_layers=2, dtype="bf16", layer_dtypes=FORMATS,
                        layer_dims=DIMS, layout=layout)
    cache = PagedKvCache(cfg, NB, gpu)
    cache.alloc_blocks(NB)
    cache.zero_blocks(list(range(NB)), gpu, stream)
    for layer, (k, v) in rows.items():
        if isinstance(gpu, HostBackend):
            cache.write_tokens(layer, SLOTS, k, v, gpu, stream)
        else:
            cache.write_tokens(layer, on(gpu, SLOTS), on(gpu, k), on(gpu, v), gpu, stream)
    with capture_logs() as logs:
        cache.debug_kv_checksum_per_layer([2, 0, 1], 1, gpu, stream, "t")
        cache.debug_kv_per_block(1, [1, 2], gpu, stream, "t")
    cache.release(gpu)
    return [{k: v for k, v in e.items() if k != "log_level"} for e in logs
            if e["event"] in ("kv_checksum", "kv_block_checksum")]

host = HostBackend(1 << 24)
for layout in ("NHD", "HND"):
    want = events(layout, host, 0)
    assert len(want) == 2 * 2 * 2 + 2 and all(e.get("ssq", e.get("k_ssq")) > 0 for e in want), want
    with CudaBackend() as gpu:
        stream = gpu.create_stream()
        got = events(layout, gpu, stream)
        gpu.destroy_stream(stream)
    assert got == want, (layout, got, want)
print("CHECK narrow heads ok")
'''


def test_bf16_and_fp8_checksums_of_heads_not_a_multiple_of_16_equal_the_host_reference(stub_env):
    """bf16 and fp8 blocks hold values only, so their checksums take any head_dim: head_dim
    8 and 72 (not multiples of 16) in NHD and HND give HostBackend's events on the device."""
    assert "CHECK narrow heads ok" in run_on_stub(stub_env, NARROW_BODY, timeout=120)


REDUCE_ARGS_BODY = '''
from pagedkv import DeviceArray, HostBackend, KvCacheConfig, KvCacheDtype, PagedKvCache
from pagedkv.driver import CudaBackend

cfg = KvCacheConfig(block_size=4, num_kv_heads=3, head_dim=32, num_layers=1, dtype="nvfp4", layout="HND")
x = np.random.default_rng(0).normal(size=(8, 3, 32)).astype(np.float32)
x[:, 0] *= 100.0   # head 0 much larger: its scales differ from the others'
host = HostBackend(1 << 24)
want = PagedKvCache(cfg, 2, host)
want.alloc_blocks(2)
want.write_tokens(0, np.arange(8, dtype=np.int64), x, x, host, 0)
with CudaBackend() as gpu:
    s = gpu.create_stream()
    c = PagedKvCache(cfg, 2, gpu)
    c.alloc_blocks(2)
    c.write_tokens(0, np.arange(8, dtype=np.int64), x, x, gpu, s)
    gpu.synchronize(s)
    regions, row = c.pools().regions(), c.pools().region_index(0, "K")
    from pagedkv.kv.diagnostics import side_stats
    ref = side_stats(want.pools(), 0, "K", np.array([0, 1]), host, 0)
    got = gpu.reduce_kv_blocks(regions, row, [0, 1], KvCacheDtype.NVFP4, 4, 96, s, layout="HND", heads=3)
    assert got == ref and got.ssq > 0, (got, ref)
    launches = STUB.stub_launch_count()
    for kwargs, blocks, error in (
        (dict(layout="HND"), [0, 1], (ValueError, "heads must be given for layout HND")),
        (dict(layout="HND", heads=3), [2**30], (IndexError, "block 1073741824 out of range: region 0 holds 2 blocks")),
        (dict(layout="HND"), [2**29], (IndexError, "block 536870912 out of range")),
        (dict(), [2**31], (IndexError, "block 2147483648 out of range")),
    ):
        try:
            gpu.reduce_kv_blocks(regions, row, blocks, KvCacheDtype.NVFP4, 4, 96, s, **kwargs)
        except error[0] as err:
            assert error[1] in str(err), (kwargs, blocks, err)
        else:
            raise AssertionError(("accepted", kwargs, blocks))
    assert STUB.stub_launch_count() == launches
    c.release(gpu)
    gpu.destroy_stream(s)
print("CHECK reduce args ok")
'''


def test_reduce_kv_blocks_needs_heads_for_hnd_and_names_an_out_of_range_block_first(stub_env):
    """CudaBackend.reduce_kv_blocks on an HND nvfp4 pool: with heads it equals HostBackend's
    sums; without heads it raises ValueError naming it (no silent one-head sums); a block
    past the pool raises IndexError naming that block before any chunk-index limit, in both
    layouts; none of these launches anything."""
    assert "CHECK reduce args ok" in run_on_stub(stub_env, REDUCE_ARGS_BODY, timeout=120)
