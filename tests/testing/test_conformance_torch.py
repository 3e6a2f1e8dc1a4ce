"""TorchArenaBackend (memory from torch's CPU allocator) against the conformance suite,
and what is its own: the engine's allocator, real addresses shared with torch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[interop]'")

from pagedkv import DeviceOutOfMemory, KvCacheConfig, PagedKvCache  # noqa: E402
from pagedkv.backends.torch_arena import TorchArenaBackend  # noqa: E402
from pagedkv.testing import conformance_tests  # noqa: E402

globals().update(conformance_tests(lambda: TorchArenaBackend(capacity_bytes=1 << 26)))


def test_memory_comes_from_the_engine_allocator_and_is_shared():
    made = []

    def engine_allocate(nbytes):
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        made.append(tensor)
        return tensor

    gpu = TorchArenaBackend(capacity_bytes=1 << 20, allocate=engine_allocate)
    p = gpu.alloc(1000)
    assert len(made) == 1 and made[0].numel() == 1000 + 255
    assert made[0].data_ptr() <= int(p) < made[0].data_ptr() + 256 and int(p) % 256 == 0
    gpu.copy_h2d(b"\x07\x08", p.offset(10))
    offset = int(p) - made[0].data_ptr() + 10
    assert made[0][offset : offset + 2].tolist() == [7, 8]  # the engine's own tensor holds the bytes
    gpu.free(p)
    assert gpu.live_allocations() == 0 and gpu.mem_info() == (1 << 20, 1 << 20)


def test_allocator_failure_is_device_out_of_memory():
    def exhausted(nbytes):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    gpu = TorchArenaBackend(capacity_bytes=1 << 20, allocate=exhausted)
    with pytest.raises(DeviceOutOfMemory, match="allocator failed for 64 bytes.*can't allocate"):
        gpu.alloc(64)
    assert gpu.mem_info() == (1 << 20, 1 << 20)


def test_pool_view_is_a_zero_copy_cpu_tensor():
    gpu = TorchArenaBackend(capacity_bytes=1 << 24)
    config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(config, 3, gpu)
    cache.zero_blocks(range(3), gpu, 0)
    k = torch.from_dlpack(cache.k_view(0, gpu))
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == (3, 4, 2, 16) and k.device.type == "cpu"
    assert k.data_ptr() == int(cache.k_pool_ptr(0))
    k[1, 2, 0, 5] = 1.5
    raw, _ = cache.read_block(0, 1, gpu)
    assert raw.view("<u2")[(2 * 2 + 0) * 16 + 5] == 0x3FC0 and np.count_nonzero(raw.view("<u2")) == 1
    with pytest.raises(TypeError, match="host_array\\(\\).*'host_view'.*TorchArenaBackend does not"):
        cache.k_view(0, gpu).host_array()
    del k
    cache.release(gpu)
    assert gpu.live_allocations() == 0
