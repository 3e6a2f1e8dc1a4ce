"""Kept pool views (one object per layer, side, backend, stream, readonly), their prepared
exports, numpy's refusal of bfloat16 / float8 reaching the caller intact, and bits views."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, KvCacheError, PagedKvCache
from pagedkv.interop import dlpack


def make(dtype: str, gpu) -> PagedKvCache:
    config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=8, num_layers=3, dtype=dtype)
    return PagedKvCache(config, 6, gpu)


@pytest.fixture
def gpu():
    """A HostBackend; the collector is run first and kept off during the test, so that an
    earlier test's cyclic garbage holding exports is not freed between two counts."""
    gc.collect()
    gc.disable()
    try:
        yield HostBackend(capacity_bytes=1 << 24)
    finally:
        gc.enable()


def test_a_view_is_kept_per_layer_side_backend_stream_and_readonly(gpu):
    cache = make("bf16", gpu)
    view = cache.k_view(1, gpu)
    assert cache.k_view(1, gpu) is view
    assert cache.v_view(1, gpu) is not view and cache.v_view(1, gpu) is cache.v_view(1, gpu)
    other = HostBackend(capacity_bytes=1 << 20)
    with pytest.raises(KvCacheError, match="k_view with HostBackend .*: the cache was built on another backend"):
        cache.k_view(1, other)  # refused when asked, not when used
    assert cache.k_view(1, gpu, readonly=True) is not view and cache.k_view(1, gpu, readonly=True).__dlpack__(
        max_version=(1, 0)) is not None
    assert cache.k_view(2, gpu) is not view and cache.k_view(2, gpu).layer == 2
    with pytest.raises(ValueError, match="readonly must be a bool, got 1"):
        cache.k_view(1, gpu, readonly=1)  # 1 == True, but never the kept read-only view
    with pytest.raises(TypeError, match="got False"):
        cache.k_view(1, gpu, stream=False)  # False == 0: refused as the uncached path refuses it


def test_a_kept_export_still_raises_once_the_cache_is_released(gpu):
    cache = make("bf16", gpu)
    view = cache.k_view(0, gpu)
    np.from_dlpack(view.bits_view())
    view.__dlpack__(max_version=(1, 0))  # prepared and kept
    cache.release(gpu)
    with pytest.raises(KvCacheError):
        view.__dlpack__(max_version=(1, 0))


@pytest.mark.parametrize("dtype, bits, element", [("bf16", np.uint16, ml_dtypes.bfloat16),
                                                   ("fp8", np.uint8, ml_dtypes.float8_e4m3fn)])
def test_numpy_refusing_a_pool_dtype_raises_its_own_error_and_takes_the_bits_view(gpu, dtype, bits, element):
    cache = make(dtype, gpu)
    before = dlpack.live_exports()
    view = cache.k_view(1, gpu)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="Unsupported dtype"):  # numpy's message, not a SystemError
            np.from_dlpack(view)
    raw = np.from_dlpack(view.bits_view())
    assert raw.dtype == bits and raw.shape == view.shape == (6, 4, 2, 8)
    assert raw.strides == view.host_array().strides
    cache.alloc_blocks(6)
    values = np.arange(64, dtype=np.float32).reshape(4, 2, 8) / 8
    cache.write_block(1, 2, values.astype(element), values.astype(element), gpu)
    np.testing.assert_array_equal(raw[2].view(element).astype(np.float32), values.astype(element).astype(np.float32))
    del raw
    assert dlpack.live_exports() == before  # the refused capsules' records are gone too


def test_unconsumed_capsules_are_swept(gpu):
    view = make("bf16", gpu).k_view(0, gpu)
    before = dlpack.live_exports()
    for _ in range(300):
        view.__dlpack__(max_version=(1, 0))  # dropped at once, never consumed
    assert len(dlpack._LIVE) < before + 200  # swept as capsules are made
    held = [view.__dlpack__() for _ in range(70)]
    assert dlpack.live_exports() == before + 70
    del held
    assert dlpack.live_exports() == before


def test_torch_takes_a_kept_view_zero_copy(gpu):
    torch = pytest.importorskip("torch")
    cache = make("bf16", gpu)
    cache.alloc_blocks(6)
    view = cache.k_view(2, gpu)
    before = dlpack.live_exports()
    tensors = [torch.from_dlpack(view) for _ in range(3)]
    assert tensors[0].dtype == torch.bfloat16 and tuple(tensors[0].shape) == view.shape
    tensors[0][3, 1].fill_(2.5)
    assert tensors[2][3, 1, 0, 0].item() == 2.5 and float(view.host_array()[3, 1, 1, 7]) == 2.5
    assert dlpack.live_exports() == before + 3
    del tensors
    assert dlpack.live_exports() == before


def test_an_elastic_pool_is_checked_resident_at_every_export(gpu):
    from pagedkv import DeviceMemoryError

    config = KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=32, num_layers=1, dtype="nvfp4")
    cache = PagedKvCache(config, 64, gpu, elastic=True)
    cache.reserve(64, gpu)
    view = cache.k_view(0, gpu)
    assert np.from_dlpack(view).shape[0] == 64
    cache.shrink(gpu)  # nothing is held: the chunks are unmapped again
    with pytest.raises(DeviceMemoryError, match="touches the unmapped chunk"):
        np.from_dlpack(view)  # not a kept export made while the pool was resident
