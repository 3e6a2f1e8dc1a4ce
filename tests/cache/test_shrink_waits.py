"""`cache.shrink(gpu, streams=..., events=...)` waits for work other libraries queued on the
pools before unmapping (issue 19): over the libcuda stub, a copy queued on a foreign
non-blocking stream from the block about to be unmapped runs first and reads the bytes. (On a
GPU an unnamed stream's work may run after the unmap: an illegal address that loses the
context. The stub drains its queues when memory is unmapped, so it cannot show that half.)
Bad arguments are refused before anything waits."""

from __future__ import annotations

import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache

from kernel_harness.stub import run_on_stub

BODY = '''
from cuda.bindings import driver as D
from pagedkv import KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend, CudaError
STUB.stub_set_vmm_granularity.argtypes = [ctypes.c_size_t]
STUB.stub_set_vmm_granularity(4096)
config = KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")  # 512-byte blocks

class Foreign:
    """Another library's stream (as torch's), named by __cuda_stream__."""
    def __init__(self, handle):
        self.handle = handle
    def __cuda_stream__(self):
        return (0, int(self.handle))

def run(name_it):
    with CudaBackend() as gpu:
        cache = PagedKvCache(config, 64, gpu, elastic=True)
        blocks = cache.alloc_blocks(20)                   # past the first 8-block step
        cache.fill_blocks(blocks, 0x5A, gpu, 0)
        gpu.synchronize(0)
        err, foreign = D.cuStreamCreate(1)                # CU_STREAM_NON_BLOCKING: not the backend's
        assert int(err) == 0
        host = np.zeros(512, np.uint8)
        tail = int(cache.k_cache_ptr(0, blocks[-1]))
        assert int(D.cuMemcpyDtoHAsync(host.ctypes.data, tail, 512, foreign)[0]) == 0   # queued, not run
        cache.free_blocks(blocks)
        given = cache.shrink(gpu, streams=[Foreign(foreign)] if name_it else [])
        assert given > 0
        status = int(D.cuStreamSynchronize(foreign)[0])
        D.cuStreamDestroy(foreign)
        cache.release(gpu)
        return status, host

status, host = run(True)
assert status == 0 and (host == 0x5A).all(), (status, host[:4])
print("ok")
'''


def test_shrink_waits_for_the_streams_it_is_given(stub_env):
    assert "ok" in run_on_stub(stub_env, BODY)


def test_shrink_refuses_bad_wait_lists_before_waiting():
    gpu = HostBackend(1 << 26)
    cache = PagedKvCache(KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16"), 8,
                         gpu, elastic=True)
    with pytest.raises(TypeError, match="streams must be a sequence of streams, got str 'abc'"):
        cache.shrink(gpu, streams="abc")
    with pytest.raises(TypeError, match="events must be a sequence of events, got int 5"):
        cache.shrink(gpu, events=5)
    event = gpu.record_event(0)
    assert cache.shrink(gpu, streams=[0], events=[event]) == 0   # nothing mapped beyond use
    gpu.destroy_event(event)
    cache.release(gpu)
