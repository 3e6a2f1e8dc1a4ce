"""Prefill writes of many layers in one launch (`PagedKvCache.plan_layer_writes`,
pagedkv.kv.prefill; `pagedkv_kv_write_layers` in kv_rows.cu): over the libcuda stub with
the kernels executing, one launch writes every planned layer (mixed formats and dims, BF16
and float32 rows, a row stride, -1 and out-of-order slots) byte-equal to HostBackend's
`write_tokens` per layer, in two CTA orders, again after new rows and slots are written
into the same buffers, and inside a CUDA graph capture; on HostBackend the plan is a
`write_tokens` per layer."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_harness.stub import run_on_stub
from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.errors import RefCountError

CONFIG = dict(block_size=16, num_kv_heads=2, head_dim=128, num_layers=4, dtype="bf16",
              layer_dtypes=("turbo4", "fp8k_turbo2v", "nvfp4", "bf16k_turbo4v"),
              layer_dims=((2, 128), (1, 256), (2, 64), (1, 128)), k_scale=0.5, v_scale=2.0)


def test_host_plan_is_a_write_per_layer_and_refuses_bad_plans():
    host = HostBackend(1 << 24)
    a, b = (PagedKvCache(KvCacheConfig(**CONFIG), 4, host) for _ in range(2))
    a.alloc_blocks(3), b.alloc_blocks(3)
    rng = np.random.default_rng(3)
    slots = np.array([5, -1, 40, 17], np.int64)
    rows = {layer: [rng.normal(size=(4, *KvCacheConfig(**CONFIG).dims_for_layer(layer))).astype(np.float32)
                    for _ in "kv"] for layer in (0, 1, 3)}
    def on_host(x):
        ptr = host.alloc(x.nbytes)
        host.copy_h2d(x, ptr)
        return DeviceArray(ptr, x.shape, x.dtype)
    plan = b.plan_layer_writes([0, 1, 3], [on_host(rows[l][0]) for l in rows], [on_host(rows[l][1]) for l in rows],
                               host, k_scale=0.5, v_scale=2.0)
    assert plan.num_tokens == 4
    plan.write(slots, 0)
    for layer, (k, v) in rows.items():
        a.write_tokens(layer, slots, k, v, host, 0, 0.5, 2.0)
    for layer in range(4):
        for side in "kv":
            size = 4 * getattr(a, f"{side}_block_stride_bytes_for_layer")(layer)
            pa, pb = getattr(a, f"{side}_pool_ptr")(layer), getattr(b, f"{side}_pool_ptr")(layer)
            assert np.array_equal(host.view(pa, size), host.view(pb, size)), (layer, side)
    with pytest.raises(RefCountError, match="free block 3"):  # the host path checks blocks as write_tokens does
        plan.write(np.array([48, -1, -1, -1], np.int64), 0)
    plan.close()
    plan.close()
    with pytest.raises(RuntimeError, match="closed"):
        plan.write(slots, 0)
    k0 = [on_host(rows[0][0])]
    with pytest.raises(ValueError, match=r"layers must be distinct, got \[0, 0\]"):
        b.plan_layer_writes([0, 0], k0 * 2, k0 * 2, host)
    with pytest.raises(ValueError, match="layer 4 is not one of the cache's 4 layers"):
        b.plan_layer_writes([4], k0, k0, host)
    with pytest.raises(ValueError, match="one k and one v array per layer: 2 layers, 1 k arrays"):
        b.plan_layer_writes([0, 3], k0, k0 * 2, host)
    with pytest.raises(ValueError, match="at least one layer"):
        b.plan_layer_writes([], [], [], host)


_BODY = '''
import os
import ml_dtypes
from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend
CONFIG = {config!r}
config = KvCacheConfig(**CONFIG)
LAYERS, TOKENS, PAD, NUM_BLOCKS = [0, 1, 3], 7, 24, 6
NAMES = """cuCtxSynchronize cuEventSynchronize cuStreamSynchronize cuMemAlloc cuMemFree cuMemcpyHtoD
    cuMemcpyHtoDAsync cuMemcpyDtoH cuMemcpyDtoHAsync cuMemsetD8Async""".split()
rng = np.random.default_rng(21)

def rows_for(layer):
    heads, dim = config.dims_for_layer(layer)
    x = rng.normal(size=(TOKENS, heads, dim)).astype(np.float32)
    x[:, :, 3] *= 500.0          # past +-448 after the fp8 scale
    x[1, 0, :16] = 0.0           # an all-zero group
    x[2, 0, 5] = 1e-41           # a float32 denormal
    return x

def pools_of(cache, gpu):
    out = []
    for layer in range(config.num_layers):
        for side in "kv":
            size = NUM_BLOCKS * getattr(cache, f"{{side}}_block_stride_bytes_for_layer")(layer)
            ptr = getattr(cache, f"{{side}}_pool_ptr")(layer)
            if isinstance(gpu, HostBackend):
                out.append(gpu.view(ptr, size).copy())
            else:
                got = np.empty(size, np.uint8)
                gpu.copy_d2h(ptr, got)
                out.append(got)
    return out

host = HostBackend(1 << 26)
for order in ("ascending", "descending"):
    os.environ["PAGEDKV_HARNESS_ORDER"] = order
    want = PagedKvCache(config, NUM_BLOCKS, host)
    want.alloc_blocks(NUM_BLOCKS)
    for layer in range(config.num_layers):
        for side in "kv":
            size = NUM_BLOCKS * getattr(want, f"{{side}}_block_stride_bytes_for_layer")(layer)
            host.memset_async(getattr(want, f"{{side}}_pool_ptr")(layer), 0x3C, size, 0)
    with CudaBackend() as gpu:
        stream = gpu.create_stream()
        cache = PagedKvCache(config, NUM_BLOCKS, gpu)
        for layer in range(config.num_layers):
            for side in "kv":
                size = NUM_BLOCKS * getattr(cache, f"{{side}}_block_stride_bytes_for_layer")(layer)
                gpu.memset_async(getattr(cache, f"{{side}}_pool_ptr")(layer), 0x3C, size, stream)
        bufs, ks, vs = [], [], []
        for layer in LAYERS:
            heads, dim = config.dims_for_layer(layer)
            n = heads * dim
            for side, arrays in (("k", ks), ("v", vs)):
                bf16 = side == "k" and layer == 1             # one BF16 input, with a row stride
                stride = n + (PAD if bf16 else 0)
                ptr = gpu.alloc(TOKENS * stride * (2 if bf16 else 4))
                bufs.append((ptr, layer, side, bf16, stride))
                arrays.append(DeviceArray(ptr, (TOKENS, heads, dim), "bfloat16" if bf16 else "float32", row_stride=stride))
        slot_buf = gpu.alloc(TOKENS * 8)
        slots_dev = DeviceArray(slot_buf, (TOKENS,), "int64")
        live = STUB.stub_live_allocations()
        plan = cache.plan_layer_writes(LAYERS, ks, vs, gpu, k_scale=0.5, v_scale=2.0)
        assert STUB.stub_live_allocations() == live + 1 and plan.num_tokens == TOKENS
        def upload(round_):
            """New rows in the same buffers, new slots in the same slot buffer; the host twin."""
            slots = rng.permutation(np.arange(NUM_BLOCKS * 16))[:TOKENS].astype(np.int64)
            slots[round_ % TOKENS] = -1
            gpu.copy_h2d(slots, slot_buf)
            for ptr, layer, side, bf16, stride in bufs:
                x = rows_for(layer)
                if bf16:
                    x = x.astype(ml_dtypes.bfloat16)
                padded = np.zeros((TOKENS, stride), x.dtype)
                padded[:, : x[0].size] = x.reshape(TOKENS, -1)
                gpu.copy_h2d(padded.view(np.uint8), ptr)
                if side == "k":
                    k_host = x
                else:
                    want.write_tokens(layer, slots, k_host, x, host, 0, 0.5, 2.0)
        def compare(what):
            gpu.synchronize(stream)
            for i, (got, exp) in enumerate(zip(pools_of(cache, gpu), pools_of(want, host))):
                bad = np.flatnonzero(got != exp)
                assert bad.size == 0, (what, order, "layer", i // 2, "kv"[i % 2], bad[:6].tolist())
        for round_ in range(2):
            upload(round_)
            before = {{n: calls(n) for n in NAMES}}
            launches = calls("cuLaunchKernel")
            plan.write(slots_dev, stream)
            assert {{n: calls(n) for n in NAMES}} == before and calls("cuLaunchKernel") == launches + 1
            rec = launch(-1)[0]
            assert rec.name in (b"pagedkv_kv_write", b"pagedkv_kv_write16", b"pagedkv_kv_write_nvfp4",
                                b"pagedkv_kv_write_turbo_h128", b"pagedkv_kv_write_turbo8_h128"), rec.name
            compare(f"write {{round_}}")
        # captured once, replayed with new rows and slots
        with gpu.capture(stream) as graph:
            plan.write(slots_dev, stream)
        for round_ in (2, 3):
            upload(round_)
            graph.launch(stream)
            compare(f"replay {{round_}}")
        graph.close()
        # NaN/inf inputs are counted across every layer of the launch
        ptr, layer, side, bf16, stride = bufs[3]                   # v of layer 1
        poison = np.full(1, np.nan, np.float32)
        gpu.copy_h2d(poison, ptr + 4 * (stride * 1 + 2))
        gpu.copy_h2d(np.full(1, np.inf, np.float32), bufs[0][0] + 4 * 7)
        ok_slots = np.arange(TOKENS, dtype=np.int64)
        gpu.copy_h2d(ok_slots, slot_buf)
        assert cache.take_nonfinite_inputs(gpu, stream) == 0
        plan.write(slots_dev, stream)
        assert cache.take_nonfinite_inputs(gpu, stream) == 2
        try:
            plan.write(DeviceArray(slot_buf, (TOKENS - 1,), "int64"), stream)
        except ValueError as err:
            assert "slots must hold the plan's 7 tokens, got 6" in str(err), err
        else:
            raise AssertionError("a short slot array was accepted")
        try:
            cache.plan_layer_writes([0, 1], ks[:1] + [DeviceArray(ks[1].ptr, (TOKENS - 2, 1, 256), "float32")], vs[:2], gpu)
        except ValueError as err:
            assert "k of layer 1 must be shaped [7, 1, 256]" in str(err), err
        else:
            raise AssertionError("rows of another token count were accepted")
        plan.close()
        assert STUB.stub_live_allocations() == live
        for ptr, *_ in bufs:
            gpu.free(ptr)
        gpu.free(slot_buf)
        cache.release(gpu)
        gpu.destroy_stream(stream)
    want.release(host)
print("CHECK prefill ok")
'''


def test_one_launch_writes_every_planned_layer_byte_exact(stub_env):
    out = run_on_stub(stub_env, _BODY.format(config=CONFIG), timeout=300)
    assert "CHECK prefill ok" in out
