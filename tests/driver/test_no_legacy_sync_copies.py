"""No synchronous copy on the legacy default stream where an engine calls per step, nor
when a cache is built (issue 19). Over the libcuda stub, which models the driver's capture
rules: while another stream is being captured into a CUDA graph, any use of the legacy
stream fails (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and invalidates that capture. Building a
cache (its region table, the non-finite counter) and `take_nonfinite_inputs` on another
stream must leave such a capture valid: they use the caller's or their own stream."""

from __future__ import annotations

from kernel_harness.stub import run_on_stub

BODY = '''
from cuda.bindings import driver as D
from pagedkv import DeviceArray, KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend
RELAXED = D.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
with CudaBackend() as gpu:
    captured, stream = gpu.create_stream(), gpu.create_stream()
    handle = gpu._stream(captured)
    config = KvCacheConfig(block_size=16, num_kv_heads=2, head_dim=64, num_layers=2, dtype="fp8")
    # a capture (another library's, say) is running while the cache is built and its counter read
    assert int(D.cuStreamBeginCapture(handle, RELAXED)[0]) == 0
    cache = PagedKvCache(config, 8, gpu)
    cache.alloc_blocks(2)
    rows = gpu.alloc(4 * 3 * 128)
    bad = np.zeros((3, 2, 64), np.float32)
    bad[0, 0, :3] = (np.nan, np.inf, -np.inf)
    pinned = gpu.alloc_pinned(bad.nbytes)
    pinned.array[:] = bad.view(np.uint8).reshape(-1)
    gpu.copy_h2d_async(pinned, rows, stream)
    slots = gpu.alloc(24)
    sp = gpu.alloc_pinned(24)
    sp.array[:] = np.arange(3, dtype=np.int64).view(np.uint8)
    gpu.copy_h2d_async(sp, slots, stream)
    k = DeviceArray(rows, (3, 2, 64), "float32")
    cache.write_tokens(0, DeviceArray(slots, (3,), "int64"), k, k, gpu, stream)
    assert cache.take_nonfinite_inputs(gpu, stream) == 6     # 3 in K and 3 in V
    assert cache.take_nonfinite_inputs(gpu, stream) == 0     # reset
    err, graph = D.cuStreamEndCapture(handle)
    assert int(err) == 0, f"the capture was invalidated: {err}"
    D.cuGraphDestroy(graph)
    for p in (rows, slots):
        gpu.free(p)
    pinned.free(); sp.free()
    cache.release(gpu)
    gpu.destroy_stream(stream); gpu.destroy_stream(captured)
print("ok")
'''


def test_building_a_cache_and_reading_its_counter_leave_a_capture_valid(stub_env):
    assert "ok" in run_on_stub(stub_env, BODY)
