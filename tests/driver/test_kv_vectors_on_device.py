"""The byte vectors of the formats tests (tests/codecs/test_codecs_vectors.py, FORMATS.md's worked
examples) through the device KV kernels (kv_rows.cu on the kernel harness, over the libcuda
stub): the bytes a device write stores are the vectors' bytes (and the host codec's), and
the device decode of the vectors' bytes gives the vectors' values bit for bit (float32 and
BF16 outputs), as the host decode does.

One group per token: block_size 1, one head of head_dim 16 (no rotation at that head_dim),
so a block side holds exactly what `encode` returns for one group: its data row, then its
scale row. bf16/fp8 vectors shorter than 16 values are padded with zeros."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kernel_harness.stub import run_on_stub
from pagedkv.codecs import decode, encode

FORMATS = ("bf16", "fp8", "nvfp4", "turbo4", "turbo3", "turbo2", "turbo8")


def _pad(values) -> list[float]:
    return [float(x) for x in values] + [0.0] * (16 - len(values))


def _nibbles(codes) -> str:
    return bytes(codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(8)).hex()


_FP8_IN = [1000.0, -1000.0, 448.0, 1.0, 0.0, -0.0, 3.0, 2.0]
_BF16_TINY = np.array([1e-12], np.float32).astype(ml_dtypes.bfloat16).tobytes().hex()

ENCODE_VECTORS = {
    # format: [(16 input values, stored bytes hex (K side, scale 1) or None: the host's bytes only)]
    "bf16": [(_pad([1.0, -2.0, 1.00390625, 1.01171875]), "803f" "00c0" "803f" "823f" + "0000" * 12)],
    "fp8": [(_pad(_FP8_IN), "7efe7e380080" "44" "40" + "00" * 8)],
    "nvfp4": [
        ([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.0, -0.25, -5.5, 0.1, 4.9, -3, 1, 0],
         _nibbles([7, 0, 2, 2, 4, 4, 6, 6, 8, 8, 15, 0, 6, 13, 2, 0]) + "38"),
        (_pad([6000.0, -3000.0]), "f7" + "00" * 7 + "7e"),
        (_pad([-1e-4, 1e-4]), "08" + "00" * 7 + "00"),
    ],
    "turbo4": [
        (_pad([]), "88" * 8 + "00"),
        ([1.0] * 16, "ff" * 8 + "2c"),
        (_pad([2.7326, 0.2582, 0.0, -0.0, -0.2582]), None),
    ],
    "turbo3": [(_pad([]), "244992244992" + "00")],
    "turbo2": [(_pad([]), "aa" * 4 + "00")],
    "turbo8": [(_pad([]), "00" * 16 + _BF16_TINY), ([float(x) for x in np.linspace(-3.0, 1.0, 16)], None)],
}
"""The encode vectors of tests/codecs/test_codecs_vectors.py, by format."""

FP8_V_SCALE2 = "7efe76300080" "3c" "38" + "00" * 8
"""fp8 of _FP8_IN divided by a scale of 2 (the V side of the fp8 layer)."""

_NIBBLE_PAIRS = bytes(((2 * i) & 15) | (((2 * i + 1) & 15) << 4) for i in range(8)).hex()
_TURBO3_BOOK = [-2.1520, -1.3440, -0.7560, -0.2451, 0.2451, 0.7560, 1.3440, 2.1520]

DECODE_VECTORS = {
    # format: [(stored bytes hex, the 16 values they decode to)]
    "nvfp4": [(_NIBBLE_PAIRS + "38", [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]),
              ("f7" + "00" * 7 + "7e", _pad([2688.0, -2688.0]))],
    "turbo4": [(_NIBBLE_PAIRS + "38", [-2.7326, -2.0690, -1.6180, -1.2562, -0.9423, -0.6568, -0.3880, -0.1284,
                                       0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326])],
    "turbo3": [("88c6fa773905" + "38", _TURBO3_BOOK + _TURBO3_BOOK[::-1])],
    "turbo8": [("38" * 16 + "803f", [1.0] * 16)],
}
"""The decode vectors of tests/codecs/test_codecs_vectors.py, by format."""


def test_the_vector_tables_are_the_host_codecs():
    """The tables above hold what the host codecs give (so the device test below compares
    the device with the formats tests' own vectors)."""
    for fmt, cases in ENCODE_VECTORS.items():
        for values, want in cases:
            raw = encode(np.asarray(values, np.float32).reshape(1, 1, 16), fmt)
            assert want is None or raw.hex() == want, (fmt, values)
    assert encode(np.asarray(_pad(_FP8_IN), np.float32).reshape(1, 1, 16), "fp8", scale=2.0).hex() == FP8_V_SCALE2
    for fmt, cases in DECODE_VECTORS.items():
        for raw, values in cases:
            got = decode(bytes.fromhex(raw), fmt, 1, 1, 16)
            assert np.array_equal(got.reshape(16).view(np.uint32), np.asarray(values, np.float32).view(np.uint32)), fmt


_BODY = '''
import ml_dtypes
from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.codecs import decode, encode
from pagedkv.driver import CudaBackend
FORMATS, ENCODE, FP8_V_SCALE2, DECODE = {formats!r}, {encode!r}, {fp8_v!r}, {decode!r}
config = KvCacheConfig(block_size=1, num_kv_heads=1, head_dim=16, num_layers=len(FORMATS), dtype="bf16",
                       layer_dtypes=FORMATS, v_scale=2.0)  # (only the fp8 layer's V side uses it)
NUM_BLOCKS = 8
DECODE_AT = 4   # decode vectors go to blocks 4..
host = HostBackend(1 << 24)

def block_bytes(cache, gpu, layer, side, block, n):
    stride = getattr(cache, f"{{side}}_block_stride_bytes_for_layer")(layer)
    ptr = getattr(cache, f"{{side}}_pool_ptr")(layer) + block * stride
    if gpu is host:
        return bytes(host.view(ptr, n))
    out = np.empty(n, np.uint8)
    gpu.copy_d2h(ptr, out)
    return out.tobytes()

def put(gpu, a):
    p = gpu.alloc(max(a.nbytes, 16))
    gpu.copy_h2d(np.ascontiguousarray(a).view(np.uint8).ravel(), p)
    return p

with CudaBackend() as gpu:
    stream = gpu.create_stream()
    caches = {{"cuda": PagedKvCache(config, NUM_BLOCKS, gpu), "host": PagedKvCache(config, NUM_BLOCKS, host)}}
    for cache in caches.values():
        cache.alloc_blocks(NUM_BLOCKS)
    checked = 0
    for layer, fmt in enumerate(FORMATS):
        values = np.asarray([v for v, _ in ENCODE[fmt]], np.float32).reshape(-1, 1, 16)
        wants = [w for _, w in ENCODE[fmt]]
        v_scale = 2.0 if fmt == "fp8" else 1.0
        inputs = [(values, "float32")]
        if fmt == "turbo4":   # BF16 rows too (test_bf16_input_is_accepted): exact in BF16, same bytes
            inputs.append((np.arange(16, dtype=np.float32).reshape(1, 1, 16), "bfloat16"))
        at = 0
        for rows, dtype in inputs:
            s = np.arange(at, at + rows.shape[0], dtype=np.int64)
            dev_rows = rows.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else rows
            dk = DeviceArray(put(gpu, dev_rows), rows.shape, dtype)
            ds = DeviceArray(put(gpu, s), s.shape, "int64")
            caches["cuda"].write_tokens(layer, ds, dk, dk, gpu, stream)
            caches["host"].write_tokens(layer, s, rows, rows, host, 0)
            gpu.synchronize(stream)
            for i in range(rows.shape[0]):
                want = encode(rows[i : i + 1], fmt).hex()
                want_v = encode(rows[i : i + 1], fmt, scale=v_scale).hex()
                if dtype == "float32" and wants[i] is not None:
                    assert want == wants[i], (fmt, i)
                    if fmt == "fp8":
                        assert want_v == FP8_V_SCALE2
                n_bytes = len(want) // 2
                for side, expect in (("k", want), ("v", want_v)):
                    got = block_bytes(caches["cuda"], gpu, layer, side, at + i, n_bytes).hex()
                    assert got == expect, ("device write", fmt, dtype, side, i, got, expect)
                    assert block_bytes(caches["host"], host, layer, side, at + i, n_bytes).hex() == expect
                    checked += 1
            gpu.free(dk.ptr); gpu.free(ds.ptr)
            at += rows.shape[0]
        # decode: the vectors' bytes stored in blocks DECODE_AT.., read back on the device
        cases = DECODE.get(fmt, [])
        if not cases:
            continue
        slots = np.arange(DECODE_AT, DECODE_AT + len(cases), dtype=np.int64)
        for i, (raw, _) in enumerate(cases):
            raw = np.frombuffer(bytes.fromhex(raw), np.uint8)
            for side in "kv":
                stride = getattr(caches["cuda"], f"{{side}}_block_stride_bytes_for_layer")(layer)
                gpu.copy_h2d(raw, getattr(caches["cuda"], f"{{side}}_pool_ptr")(layer) + (DECODE_AT + i) * stride)
        ds = DeviceArray(put(gpu, slots), slots.shape, "int64")
        for out_dtype, width in (("float32", 4), ("bfloat16", 2)):
            outs = [DeviceArray(gpu.alloc(len(cases) * 16 * width), (len(cases), 1, 16), out_dtype) for _ in "kv"]
            caches["cuda"].read_tokens(layer, ds, gpu, unrotate=True, out_k=outs[0], out_v=outs[1], stream=stream)
            gpu.synchronize(stream)
            for side, out in zip("kv", outs):
                got = np.empty(len(cases) * 16, np.uint32 if width == 4 else np.uint16)
                gpu.copy_d2h(out.ptr, got)
                for i, (raw, values) in enumerate(cases):
                    want = np.asarray(values, np.float32)
                    host_values = decode(bytes.fromhex(raw), fmt, 1, 1, 16).reshape(16)
                    assert np.array_equal(host_values.view(np.uint32), want.view(np.uint32)), fmt
                    if fmt == "fp8" and side == "v":  # the config's v_scale (x2: exact)
                        want = want * np.float32(2.0)
                    want_bits = want.view(np.uint32) if width == 4 else want.astype(ml_dtypes.bfloat16).view(np.uint16)
                    assert np.array_equal(got[16 * i : 16 * i + 16], want_bits), ("device decode", fmt, out_dtype, side, i,
                                                                                    got[16 * i : 16 * i + 16].tolist())
                    checked += 1
            for o in outs:
                gpu.free(o.ptr)
        gpu.free(ds.ptr)
    for cache, backend in ((caches["cuda"], gpu), (caches["host"], host)):
        cache.release(backend)
    gpu.destroy_stream(stream)
print("CHECK vectors ok", checked)
'''


def test_device_kernels_store_and_decode_the_format_vectors(stub_env):
    body = _BODY.format(formats=FORMATS, encode=ENCODE_VECTORS, fp8_v=FP8_V_SCALE2, decode=DECODE_VECTORS)
    out = run_on_stub(stub_env, body, timeout=300)
    # 12 encode vectors + 1 BF16-input row, both sides; 5 decode vectors, both sides, two output dtypes
    assert "CHECK vectors ok %d" % ((12 + 1) * 2 + 5 * 2 * 2) in out, out
