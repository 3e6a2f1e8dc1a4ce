"""The device form of write_tokens/read_tokens (pagedkv.kv.device_path): DeviceArray and DLPack
inputs, the out_k/out_v read form, the NaN/inf counter. On HostBackend the same arguments
name host memory and take the host codecs; on CudaBackend (over the libcuda stub, kernels
executing in the harness) a call is one kernel launch and nothing else that synchronises,
allocates or copies, and its bytes equal HostBackend's."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
from kernel_harness.stub import run_on_stub

CONFIG = dict(block_size=16, num_kv_heads=2, head_dim=128, num_layers=2, dtype="turbo4k_turbo3v",
              layer_dtypes=("turbo4k_turbo3v", "fp8k_turbo2v"), k_scale=0.5, v_scale=2.0)


def _rows(seed, tokens=5, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=(tokens, 2, 128)).astype(dtype)


def _in_backend(host, arr):
    ptr = host.alloc(max(arr.nbytes, 1))
    host.copy_h2d(np.ascontiguousarray(arr).view(np.uint8).ravel(), ptr)
    return ptr


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_host_backend_device_arrays_give_the_numpy_path_bytes(dtype):
    host = HostBackend(1 << 24)
    a, b = PagedKvCache(KvCacheConfig(**CONFIG), 4, host), PagedKvCache(KvCacheConfig(**CONFIG), 4, host)
    blocks = a.alloc_blocks(2), b.alloc_blocks(2)
    slots = np.array([17, 3, -1, 20, 0], np.int64)
    k, v = _rows(1, dtype=dtype), _rows(2, dtype=dtype)
    for layer in (0, 1):
        a.write_tokens(layer, slots, k, v, host, 0, 0.5, 2.0)
        dk = DeviceArray(_in_backend(host, k), k.shape, k.dtype)
        dv = DeviceArray(_in_backend(host, v), v.shape, v.dtype)
        ds = DeviceArray(_in_backend(host, slots), slots.shape, np.int64)
        b.write_tokens(layer, ds, dk, dv, host, 0, 0.5, 2.0)
        for side in ("k", "v"):
            pa, pb = getattr(a, f"{side}_pool_ptr")(layer), getattr(b, f"{side}_pool_ptr")(layer)
            size = 4 * getattr(a, f"{side}_block_stride_bytes_for_layer")(layer)
            assert np.array_equal(host.view(pa, size), host.view(pb, size)), (layer, side)
        want = a.read_tokens(layer, slots, host, unrotate=False, k_scale=0.5, v_scale=2.0)
        outs = [DeviceArray(host.alloc(5 * 256 * 4), (5, 2, 128), np.float32) for _ in range(2)]
        got = b.read_tokens(layer, ds, host, unrotate=False, k_scale=0.5, v_scale=2.0, out_k=outs[0], out_v=outs[1])
        assert got == tuple(outs)
        for out, w in zip(outs, want):
            assert np.array_equal(host.view(out.ptr, 5 * 256 * 4).view(np.float32).reshape(5, 2, 128), w)
    assert a.take_nonfinite_inputs(host, 0) == 0, "HostBackend refuses non-finite inputs; it never counts"
    assert blocks


def test_device_array_refuses_bad_fields():
    with pytest.raises(ValueError, match="non-null"):
        DeviceArray(0, (2, 2), np.float32)
    with pytest.raises(TypeError, match="float16"):
        DeviceArray(4096, (2, 2), np.float16)
    with pytest.raises(ValueError, match="row_stride must be an int of at least 6"):
        DeviceArray(4096, (2, 2, 3), np.float32, row_stride=5)
    with pytest.raises(ValueError, match="shape"):
        DeviceArray(4096, (2, -1), np.float32)


def test_read_out_form_needs_both_outputs():
    host = HostBackend(1 << 22)
    cache = PagedKvCache(KvCacheConfig(**CONFIG), 2, host)
    out = DeviceArray(host.alloc(4096), (1, 2, 128), np.float32)
    with pytest.raises(TypeError, match="both out_k and out_v"):
        cache.read_tokens(0, [0], host, out_k=out)


def test_cuda_device_path_is_one_launch_and_byte_exact(stub_env):
    out = run_on_stub(stub_env, '''
        import ml_dtypes
        from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
        from pagedkv.driver import CudaBackend
        from pagedkv.interop.views import DeviceArrayPtr
        CONFIG = dict(block_size=16, num_kv_heads=2, head_dim=128, num_layers=2, dtype="turbo4k_turbo3v",
                      layer_dtypes=("turbo4k_turbo3v", "fp8k_turbo2v"), k_scale=0.5, v_scale=2.0)
        NAMES = """cuCtxSynchronize cuEventSynchronize cuStreamSynchronize cuMemAlloc cuMemFree cuMemFreeHost
            cuMemHostAlloc cuMemcpyDtoD cuMemcpyDtoDAsync cuMemcpyDtoH cuMemcpyDtoHAsync cuMemcpyHtoD
            cuMemcpyHtoDAsync cuMemsetD8Async cuStreamQuery cuEventQuery""".split()
        # (the DLPack producer of the slots orders its stream before ours with an event record
        # and a stream wait: both stream-ordered, so they are allowed)
        rng = np.random.default_rng(5)
        k = rng.normal(size=(5, 2, 128)).astype(np.float32)
        v = rng.normal(size=(5, 2, 128)).astype(np.float32)
        slots = np.array([17, 3, -1, 20, 0], np.int64)
        host = HostBackend(1 << 24)
        want_cache = PagedKvCache(KvCacheConfig(**CONFIG), 4, host)
        want_cache.alloc_blocks(2)
        with CudaBackend() as gpu:
            cache = PagedKvCache(KvCacheConfig(**CONFIG), 4, gpu)
            cache.alloc_blocks(2)
            stream = gpu.create_stream()
            cache.zero_blocks(list(range(4)), gpu, stream)
            want_cache.zero_blocks(list(range(4)), host, 0)
            gpu.synchronize(stream)
            def put(a):
                p = gpu.alloc(a.nbytes)
                gpu.copy_h2d(a.view(np.uint8).ravel(), p)
                return p
            dk, dv = DeviceArray(put(k), k.shape, "float32"), DeviceArray(put(v), v.shape, "float32")
            ds = DeviceArrayPtr(int(put(slots)), slots, gpu)          # a DLPack producer, like a table export
            outs = [DeviceArray(gpu.alloc(5 * 256 * 2), (5, 2, 128), "bfloat16") for _ in range(2)]
            for layer in (0, 1):
                before = {n: calls(n) for n in NAMES}
                launches = calls("cuLaunchKernel")
                cache.write_tokens(layer, ds, dk, dv, gpu, stream, 0.5, 2.0)
                cache.read_tokens(layer, ds, gpu, unrotate=True, k_scale=0.5, v_scale=2.0,
                                  out_k=outs[0], out_v=outs[1], stream=stream)
                assert {n: calls(n) for n in NAMES} == before, {n: calls(n) - before[n] for n in NAMES}
                assert calls("cuLaunchKernel") == launches + 2
                # layer 0 (rotated turbo4/turbo3 of head_dim 128): the one-path kernels; layer 1 (fp8 K): the every-format ones
                suffix = b"_turbo_h128" if layer == 0 else b""
                assert [launch(-2)[0].name, launch(-1)[0].name] == [b"pagedkv_kv_write" + suffix, b"pagedkv_kv_read" + suffix]
                want_cache.write_tokens(layer, slots, k, v, host, 0, 0.5, 2.0)
                gpu.synchronize(stream)
                for side in ("k", "v"):
                    size = 4 * getattr(cache, f"{side}_block_stride_bytes_for_layer")(layer)
                    got = np.empty(size, np.uint8)
                    gpu.copy_d2h(getattr(cache, f"{side}_pool_ptr")(layer), got)
                    hv = host.view(getattr(want_cache, f"{side}_pool_ptr")(layer), size)
                    bad = np.flatnonzero(got != hv)
                    assert bad.size == 0, (layer, side, size, bad[:5].tolist(), bad[-5:].tolist(), got[bad[:5]].tolist(), hv[bad[:5]].tolist())
                want = want_cache.read_tokens(layer, slots, host, True, 0.5, 2.0)
                for out, w in zip(outs, want):
                    got = np.empty(5 * 256, np.uint16)
                    gpu.copy_d2h(out.ptr, got)
                    assert np.array_equal(got, w.astype(ml_dtypes.bfloat16).view(np.uint16).ravel()), layer
            # non-finite inputs are counted, not refused; reading resets the count
            bad = k.copy()
            bad[0, 0, 3] = np.nan
            bad[1, 1, 7] = np.inf
            bad[2, 0, 0] = np.nan          # slot -1: not written, not counted
            dbad = DeviceArray(put(bad), bad.shape, "float32")
            cache.write_tokens(0, ds, dbad, dv, gpu, stream)
            assert cache.take_nonfinite_inputs(gpu, stream) == 2
            assert cache.take_nonfinite_inputs(gpu, stream) == 0
            try:
                cache.write_tokens(0, ds, DeviceArray(dk.ptr, (4, 2, 128), "float32"), dv, gpu, stream)
            except ValueError as err:
                assert "k must be shaped [5, 2, 128]" in str(err), err
            else:
                raise AssertionError("a k of 4 rows for 5 slots was accepted")
            cache.release(gpu)
        print("CHECK device path ok")
    ''')
    assert "CHECK device path ok" in out


def test_readme_device_step_runs_over_the_stub(stub_env):
    """The README's engine step on the device path runs as written (CudaBackend over the stub)."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    (step,) = [block for block in re.findall(r"```py\n(.*?)```", readme, flags=re.S) if "out_k=out_k" in block]
    assert "write_tokens" in step and "out_k=out_k" in step
    out = run_on_stub(stub_env, step + '\nprint("CHECK readme step ok")\n')
    assert "CHECK readme step ok" in out


def test_kv_bench_smoke_over_the_stub(stub_env):
    """tools/bench.py's kv section at --quick size over the stub: a row per side format, each
    with its three floors printed (write, decode step, checksum), nothing left allocated (the figures are the CPU harness's,
    so only the form is checked)."""
    import pathlib

    tools = pathlib.Path(__file__).resolve().parents[2] / "tools"
    out = run_on_stub(stub_env, '''
        import pagedkv.driver
        pagedkv.driver.is_available = lambda: True
        sys.path.insert(0, %r)
        import bench
        bench.main(["--section", "kv", "--quick"])
        assert STUB.stub_live_allocations() == 0 and STUB.stub_live_streams() == 0 and STUB.stub_live_events() == 0
        print("CHECK bench ok")
    ''' % str(tools), timeout=300)
    lines = out.splitlines()
    assert lines[0] == "== kv ==" and "libcuda stub" in lines[1] and "DRAM bandwidth" in lines[2], lines[:3]
    for fmt in ("bf16", "fp8", "nvfp4", "turbo4", "turbo3", "turbo2", "turbo8"):
        assert any(line.split()[:1] == [fmt] for line in lines), fmt
        assert sum(f"floor   {fmt} " in line for line in lines) == 3, fmt
        assert any(f"floor   {fmt} checksum vs DRAM bandwidth: " in line for line in lines), fmt
    assert lines[-1] == "CHECK bench ok"
