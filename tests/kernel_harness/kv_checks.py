"""KV row kernel checks over the libcuda stub (kv_rows.cu against pagedkv.codecs through
HostBackend): each `kv_case_body` is the body of one subprocess (kernel_harness.stub.PRELUDE
first) that builds the same multi-layer cache on CudaBackend and HostBackend, seeds every
pool byte alike, writes the same token rows (device rows and slots on CudaBackend, the host
`kv_rows.write_tokens` on HostBackend) and asserts:

- at a grid of 2 CTAs (so each CTA loops over several token sides),
  every byte of every pool equals HostBackend's (so untouched slots and the bytes around
  the written rows are unchanged), under two CTA orders;
- the device read (float32 and BF16 output, with and without unrotation) equals the host
  decode bit for bit, -1 slots giving +0.0 rows.

Data: Gaussian rows with outlier channels, all-zero groups and rows, float32 denormals,
values at and past +-448 and a huge one; slots out of order with -1 among them.
"""

from __future__ import annotations

from .checks import ORDERS

CASES = {
    # name: (layer formats, (heads, head_dim) per layer, block_size, bf16 input, row padding,
    # block layout)
    "all_formats_hd128_bs16_f32": ("ALL", [(2, 128)], 16, False, 0, "NHD"),
    # a BF16 row stride of 132 elements (264 bytes: not 16-byte aligned) takes the chunk path;
    # the float32 outputs of the reads (528 bytes) the few-token one
    "all_formats_hd64_bs1_bf16_strided": ("ALL", [(2, 64)], 1, True, 4, "NHD"),
    # 16 heads: a warp of the 2-CTA grid gets 14 (token, head) units a side, so the one-path
    # kernels' batches (12 a write, 10 a read) run full and shift; nvfp4's 3 and 4 groups too
    "batched_hd128_16heads_bf16": (["nvfp4", "turbo4", "turbo3", "turbo2", "turbo8", "turbo4k_turbo3v"], [(16, 128)],
                                   16, True, 0, "NHD"),
    "turbo_hd256_hd512_bs32": (
        ["turbo4", "turbo3", "turbo2", "turbo8", "turbo4k_turbo3v", "fp8k_turbo2v", "nvfp4", "bf16k_turbo4v"],
        [(1, 256), (1, 512), (2, 256), (1, 512), (1, 512), (1, 256), (1, 512), (1, 256)],
        32, False, 16, "NHD",
    ),
    # HND blocks (a side runs as one one-head side per head chunk): every format at 3 heads;
    # 16 heads of 128 for the one-path kernels' full batches; mixed per-layer formats and
    # dims (1 head: HND is NHD's bytes; 4 heads of 64; rotated heads of 256 and 512) with
    # strided BF16 rows and blocks of one token
    "hnd_all_formats_hd128_bs16_f32": ("ALL", [(3, 128)], 16, False, 0, "HND"),
    "hnd_batched_hd128_16heads_bf16": (["nvfp4", "turbo4", "turbo8", "bf16", "fp8k_turbo2v"], [(16, 128)], 16, True, 8,
                                       "HND"),
    "hnd_mixed_dims_bs1_bf16_strided": (
        ["turbo4", "bf16", "nvfp4", "turbo8", "fp8k_turbo2v", "turbo3"],
        [(2, 256), (1, 64), (4, 64), (2, 512), (3, 64), (4, 128)],
        1, True, 24, "HND",
    ),
}

_BODY = '''
import os
import ml_dtypes
from pagedkv import HostBackend, KvCacheConfig, KvCacheDtype
from pagedkv.kv import rows as kv_rows
from pagedkv.codecs.floats import bf16_encode
from pagedkv.driver import CudaBackend
from pagedkv.driver.kv_kernels import KvSideArgs
from pagedkv.kv.pools import KvPools

STUB.stub_set_device(2, 9, 0)
STUB.stub_set_occupancy(1)   # 2 SMs x 1 CTA: every launch's grid-stride loop wraps
ORDERS = {orders!r}
FORMATS, DIMS, BLOCK_SIZE, BF16_IN, PAD, LAYOUT = {case!r}
if FORMATS == "ALL":
    FORMATS = [f.value for f in KvCacheDtype]
DIMS = DIMS * (len(FORMATS) // len(DIMS)) if len(DIMS) == 1 else DIMS
config = KvCacheConfig(block_size=BLOCK_SIZE, num_kv_heads=DIMS[0][0], head_dim=DIMS[0][1],
                       num_layers=len(FORMATS), dtype=FORMATS[0], layer_dtypes=tuple(FORMATS),
                       layer_dims=tuple(DIMS), layout=LAYOUT)
NUM_BLOCKS = max(3, 16 // BLOCK_SIZE)
TOKENS = 7
rng = np.random.default_rng(10)

def rows_for(heads, head_dim, seed):
    r = np.random.default_rng(seed)
    x = r.normal(size=(TOKENS, heads, head_dim)).astype(np.float32)
    x[:, :, 5] *= 60.0                       # outlier channel
    x[1, 0, :16] = 0.0                       # all-zero group
    x[6] = 0.0                               # all-zero row
    x[3, 0, 16:32] = np.float32(1e-40) * r.integers(-3, 4, 16)   # float32 denormals
    x[3, -1, -4:] = (448.0, -448.0, 500.0, -1e4)                  # at and past +-448
    x[4, 0, :16] *= np.float32(1e-8)         # a tiny group
    x[5, -1, 0] = 3.0e5                      # a huge value
    # round-to-nearest-even ties: E4M3 1.1875 (of x / 0.5 and x / 2.0), BF16 1 + 3 * 2^-8
    x[0, 0, 32:36] = (0.59375, 2.375, -0.59375, 1.01171875)
    if BF16_IN:
        x = x.astype(ml_dtypes.bfloat16)
    return x

slots_total = NUM_BLOCKS * BLOCK_SIZE
perm = rng.permutation(slots_total)[: TOKENS - 1].astype(np.int64)
SLOTS = np.insert(perm, 2, -1)               # out of order, one -1
K_SCALE, V_SCALE = 0.5, 2.0
data = {{layer: (rows_for(*DIMS[layer], 2 * layer), rows_for(*DIMS[layer], 2 * layer + 1))
        for layer in range(len(FORMATS))}}

def pool_bytes(backend, pools):
    out = []
    for layer in range(len(FORMATS)):
        for ptr, stride in ((pools.k_pool(layer), pools.k_stride(layer)), (pools.v_pool(layer), pools.v_stride(layer))):
            got = np.empty(NUM_BLOCKS * stride, np.uint8)
            backend.copy_d2h(ptr, got)
            out.append(got)
    return out

def seed_pools(backend, pools):
    r = np.random.default_rng(99)
    for layer in range(len(FORMATS)):
        for ptr, stride in ((pools.k_pool(layer), pools.k_stride(layer)), (pools.v_pool(layer), pools.v_stride(layer))):
            backend.copy_h2d(r.integers(0, 256, NUM_BLOCKS * stride, dtype=np.uint8), ptr)

host = HostBackend(1 << 26)
host_pools = KvPools(config, NUM_BLOCKS, host)
seed_pools(host, host_pools)
for layer, (k, v) in data.items():
    kv_rows.write_tokens(host_pools, layer, SLOTS, k, v, host, 0, K_SCALE, V_SCALE)
want_pools = pool_bytes(host, host_pools)
want_reads = {{(layer, unrot): kv_rows.read_tokens(host_pools, layer, SLOTS, host, unrot, K_SCALE, V_SCALE)
              for layer in range(len(FORMATS)) for unrot in (True, False)}}

def device_rows(gpu, x):
    """x copied to the device with PAD extra elements after every row: (ptr, row stride)."""
    t, h, d = x.shape
    flat = x.reshape(t, h * d)
    padded = np.zeros((t, h * d + PAD), dtype=flat.dtype)
    padded[:, : h * d] = flat
    ptr = gpu.alloc(padded.nbytes)
    gpu.copy_h2d(padded.view(np.uint8), ptr)
    return ptr, h * d + PAD

for order in ORDERS:
    os.environ["PAGEDKV_HARNESS_ORDER"] = order
    with CudaBackend() as gpu:
        pools = KvPools(config, NUM_BLOCKS, gpu)
        seed_pools(gpu, pools)
        slots = gpu.alloc(SLOTS.nbytes)
        gpu.copy_h2d(SLOTS, slots)
        stream = gpu.create_stream()
        for layer, (k, v) in data.items():
            heads, head_dim = DIMS[layer]
            k_fmt, v_fmt = config.dtype_for_layer(layer).kv_pair()
            (kp, ks), (vp, vs) = device_rows(gpu, k), device_rows(gpu, v)
            gpu.kv_write_rows(
                slots, TOKENS, heads, head_dim, BLOCK_SIZE, slots_total,
                KvSideArgs(k_fmt, pools.k_pool(layer), pools.k_stride(layer), kp, ks, BF16_IN, K_SCALE, layout=LAYOUT),
                KvSideArgs(v_fmt, pools.v_pool(layer), pools.v_stride(layer), vp, vs, BF16_IN, V_SCALE, layout=LAYOUT),
                stream)
            rec = launch(-1)[0]
            pair = {{k_fmt.value, v_fmt.value}}
            if pair <= {{"bf16", "fp8"}}:
                want = b"pagedkv_kv_write16"
            elif pair == {{"nvfp4"}}:
                want = b"pagedkv_kv_write_nvfp4"
            elif head_dim == 128 and pair <= {{"turbo4", "turbo3", "turbo2"}}:
                want = b"pagedkv_kv_write_turbo_h128"
            elif head_dim == 128 and pair == {{"turbo8"}}:
                want = b"pagedkv_kv_write_turbo8_h128"
            else:
                want = b"pagedkv_kv_write"
            assert rec.name == want and 1 <= rec.grid[0] <= 2, (rec.name, rec.grid[0])
        gpu.synchronize(stream)
        got_pools = pool_bytes(gpu, pools)
        for i, (got, want) in enumerate(zip(got_pools, want_pools)):
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, ("write", order, FORMATS[i // 2], "KV"[i % 2], "bytes", bad[:8].tolist(),
                                   got[bad[:8]].tolist(), want[bad[:8]].tolist())
        for layer in range(len(FORMATS)):
            heads, head_dim = DIMS[layer]
            k_fmt, v_fmt = config.dtype_for_layer(layer).kv_pair()
            n = heads * head_dim
            for unrot in (True, False):
                for out_bf16 in (False, True):
                    width = 2 if out_bf16 else 4
                    outs = [gpu.alloc(TOKENS * (n + PAD) * width) for _ in range(2)]
                    for o in outs:
                        gpu.copy_h2d(np.full(TOKENS * (n + PAD) * width, 0x5A, np.uint8), o)
                    gpu.kv_read_rows(
                        slots, TOKENS, heads, head_dim, BLOCK_SIZE, slots_total,
                        KvSideArgs(k_fmt, pools.k_pool(layer), pools.k_stride(layer), outs[0], n + PAD, out_bf16, K_SCALE, unrot,
                                   layout=LAYOUT),
                        KvSideArgs(v_fmt, pools.v_pool(layer), pools.v_stride(layer), outs[1], n + PAD, out_bf16, V_SCALE, unrot,
                                   layout=LAYOUT),
                        stream)
                    gpu.synchronize(stream)
                    for side, o, want in zip("KV", outs, want_reads[(layer, unrot)]):
                        raw = np.empty(TOKENS * (n + PAD) * width, np.uint8)
                        gpu.copy_d2h(o, raw)
                        rows = raw.view(np.uint16 if out_bf16 else np.uint32).reshape(TOKENS, n + PAD)
                        expect = want.reshape(TOKENS, n)
                        expect = bf16_encode(expect) if out_bf16 else expect.view(np.uint32)
                        bad = np.argwhere(rows[:, :n] != expect)
                        assert bad.size == 0, ("read", order, FORMATS[layer], side, unrot, out_bf16, bad[:4].tolist(),
                                               rows[:, :n][tuple(bad[:4].T)].tolist(), expect[tuple(bad[:4].T)].tolist())
                        assert (rows[:, n:] == (0x5A5A if out_bf16 else 0x5A5A5A5A)).all(), ("read padding", side)
                    for o in outs:
                        gpu.free(o)
        gpu.destroy_stream(stream)
print("CHECK kv ok")
'''


def kv_case_body(case: str, orders=ORDERS) -> str:
    """The subprocess body of KV case `case` (a key of CASES); prints `CHECK kv ok`."""
    return _BODY.format(orders=tuple(orders), case=CASES[case])
