"""State views (`HybridKvCache.state_view`) on HostBackend: shapes, dtypes and strides of
every state tensor, zero copy both ways through numpy's DLPack, bits views, kept views,
refusals; the CUDA side is in tests/groups/test_state_on_stub.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheError, PagedKvCache
from pagedkv.core.layer_groups import LayerGroup

BF16 = np.dtype(ml_dtypes.bfloat16)
STATE = (((4, 8), BF16), ((3,), "float32"), ((2, 3), "float64"), ((5,), "complex64"))


def make(gpu, slots=5):
    config = KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
        LayerGroup("state", (0, 2), state=STATE),
        LayerGroup("full", (1,)),
    ))
    return PagedKvCache(config, [None, 8], gpu, num_state_slots=slots)


@pytest.mark.parametrize("tensor, shape, dtype, strides", [
    (0, (5, 4, 8), "bfloat16", (32, 8, 1)),  # 64-byte slots
    (1, (5, 3), "float32", (4, 1)),  # 12 bytes rounded up to 16
    (2, (5, 2, 3), "float64", (6, 3, 1)),  # 48 bytes
])
def test_a_state_view_is_every_slot_in_the_tensors_dtype(tensor, shape, dtype, strides):
    gpu = HostBackend()
    cache = make(gpu)
    view = cache.state_view(2, gpu, tensor=tensor)
    assert (view.shape, view.dtype, view.strides, view.layer, view.tensor) == (shape, dtype, strides, 2, tensor)
    assert view.__dlpack_device__() == (1, 0)
    assert view.host_array().shape == shape and view.host_array().dtype == np.dtype(STATE[tensor][1])
    cache.release(gpu)


def test_slot_s_of_the_view_is_the_state_of_slot_s_both_ways():
    gpu = HostBackend()
    cache = make(gpu)
    held = cache.group(0).alloc_blocks(5)
    rng = np.random.default_rng(3)
    for s in held:
        cache.write_state(0, s, rng.standard_normal(3), gpu, tensor=1)
        cache.write_state(0, s, rng.standard_normal((4, 8)), gpu, tensor=0)
    f32 = np.from_dlpack(cache.state_view(0, gpu, tensor=1))  # numpy consumes float32 directly
    bf16 = np.from_dlpack(cache.state_view(0, gpu).bits_view()).view(ml_dtypes.bfloat16)
    assert bf16.shape == (5, 4, 8)
    for s in held:
        np.testing.assert_array_equal(f32[s], cache.read_state(0, s, gpu, tensor=1))
        np.testing.assert_array_equal(bf16[s], cache.read_state(0, s, gpu, tensor=0))
    f32[3] = [1.5, -2.0, 8.0]  # zero copy: the engine's write is the cache's state
    np.testing.assert_array_equal(cache.read_state(0, 3, gpu, tensor=1), np.array([1.5, -2.0, 8.0], np.float32))
    assert int(cache.state_ptr(0, 3, 1)) - int(cache.state_ptr(0, 0, 1)) == 3 * 16
    # the other layer's pool is its own memory
    assert not np.shares_memory(cache.state_view(2, gpu, tensor=1).host_array(), f32)


def test_views_are_kept_readonly_refuses_writes_and_a_released_cache_refuses_exports():
    gpu = HostBackend()
    cache = make(gpu)
    view = cache.state_view(0, gpu, tensor=1)
    assert cache.state_view(0, gpu, tensor=1) is view
    assert cache.state_view(0, gpu, tensor=1, readonly=True) is not view
    frozen = cache.state_view(0, gpu, tensor=1, readonly=True).host_array()
    with pytest.raises(ValueError, match="read-only"):
        frozen[0, 0] = 1.0
    cache.release(gpu)
    with pytest.raises(KvCacheError, match="released"):
        view.__dlpack__()


def test_a_dtype_dlpack_cannot_carry_is_refused_pointing_at_its_bytes():
    gpu = HostBackend()
    cache = make(gpu)
    view = cache.state_view(0, gpu, tensor=3)
    with pytest.raises(TypeError, match="complex64, which a DLPack view cannot carry; take its bytes with bits_view"):
        view.__dlpack__()
    raw = view.bits_view()
    assert (raw.shape, raw.dtype, raw.strides) == ((5, 40), "uint8", (48, 1))
    held = cache.group(0).alloc_block()
    cache.write_state(2, held, np.arange(5) * (1 + 2j), gpu, tensor=3)
    assert cache.state_view(2, gpu, tensor=3).bits_view().host_array()[held].tobytes() == (
        cache.read_state(2, held, gpu, tensor=3).tobytes())
    with pytest.raises(ValueError, match="group 1 is a 'full' group"):
        cache.state_view(1, gpu)
    with pytest.raises(IndexError, match="state tensor 4"):
        cache.state_view(0, gpu, tensor=4)
    with pytest.raises(ValueError, match="readonly must be a bool"):
        cache.state_view(0, gpu, readonly=1)


def test_torch_takes_bfloat16_and_float32_state_zero_copy():
    torch = pytest.importorskip("torch", reason="torch is not installed (the interop extra)")
    gpu = HostBackend()
    cache = make(gpu)
    slot = cache.group(0).alloc_block()
    bf16 = torch.from_dlpack(cache.state_view(2, gpu))
    assert bf16.dtype == torch.bfloat16 and tuple(bf16.shape) == (5, 4, 8) and bf16.stride() == (32, 8, 1)
    bf16[slot] = torch.full((4, 8), 0.75, dtype=torch.bfloat16)  # the engine's recurrent kernel writes
    np.testing.assert_array_equal(cache.read_state(2, slot, gpu), np.full((4, 8), 0.75, BF16))
    cache.write_state(2, slot, [1.0, 2.0, 3.0], gpu, tensor=1)
    f32 = torch.from_dlpack(cache.state_view(2, gpu, tensor=1))
    assert f32.dtype == torch.float32 and f32.stride() == (4, 1) and f32[slot].tolist() == [1.0, 2.0, 3.0]
