"""The DLPack producer: capsule names, struct fields, flags, versions, lifetimes and the
specification's arguments, read back through ctypes as a C consumer would."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

from pagedkv import KvCacheConfig, KvCacheError, PagedKvCache, SequenceTable

from pagedkv.interop import dlpack
from pagedkv.interop.dlpack import DLManagedTensor, DLManagedTensorVersioned

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.restype = ctypes.c_int
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _managed(capsule):
    """The managed tensor inside a capsule, without consuming it."""
    name = _get_name(capsule)
    kind = DLManagedTensorVersioned if name == b"dltensor_versioned" else DLManagedTensor
    return kind.from_address(_get_pointer(capsule, name))


def _fields(capsule) -> dict:
    managed = _managed(capsule)
    t = managed.dl_tensor
    out = {
        "name": _get_name(capsule).decode(),
        "device": (t.device.device_type, t.device.device_id),
        "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        "shape": tuple(t.shape[i] for i in range(t.ndim)),
        "strides": tuple(t.strides[i] for i in range(t.ndim)),
        "byte_offset": t.byte_offset,
        "data": t.data,
    }
    if isinstance(managed, DLManagedTensorVersioned):
        out["version"] = (managed.version.major, managed.version.minor)
        out["flags"] = managed.flags
    return out


@pytest.fixture
def caches(host):
    made = []

    def make(dtype, **extra):
        config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype=dtype, **extra)
        cache = PagedKvCache(config, num_blocks=6, gpu=host)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.release(host)


def test_bf16_pool_capsule_fields_legacy_and_versioned(host, caches):
    cache = caches("bf16")
    view = cache.k_view(1, host)
    base = host.view(cache.k_pool_ptr(1), 1).__array_interface__["data"][0]
    legacy = _fields(view.__dlpack__())
    assert legacy == {
        "name": "dltensor", "device": (1, 0), "dtype": (4, 16, 1), "shape": (6, 4, 2, 16),
        "strides": (128, 32, 16, 1), "byte_offset": 0, "data": base,
    }
    versioned = _fields(view.__dlpack__(max_version=(1, 3)))
    assert versioned["name"] == "dltensor_versioned"
    assert versioned["version"] == (1, 1) and versioned["flags"] == 0
    assert _fields(view.__dlpack__(max_version=(1, 0)))["version"] == (1, 0)
    assert _fields(view.__dlpack__(max_version=(0, 8)))["name"] == "dltensor"
    assert view.__dlpack_device__() == (1, 0)


def test_fp8_and_packed_capsule_dtypes_shapes_and_offsets(host, caches):
    fp8 = _fields(caches("fp8").v_view(0, host).__dlpack__(max_version=(1, 1)))
    assert fp8["dtype"] == (10, 8, 1) and fp8["shape"] == (6, 4, 2, 16) and fp8["strides"] == (128, 32, 16, 1)
    # turbo8, rows of 32 elements: 32 data bytes and 2 groups x 2 scale bytes; 4 rows: 128 + 16
    turbo8 = caches("turbo8").k_view(0, host)
    pool = _fields(turbo8.__dlpack__())
    assert pool["dtype"] == (1, 8, 1) and pool["shape"] == (6, 144) and pool["strides"] == (144, 1)
    scale = _fields(turbo8.scale_view().__dlpack__())
    assert scale["dtype"] == (1, 8, 1) and scale["shape"] == (6, 4, 4) and scale["strides"] == (144, 4, 1)
    assert scale["byte_offset"] == 128 and scale["data"] == pool["data"]
    data = _fields(turbo8.data_view().__dlpack__())
    assert data["shape"] == (6, 4, 32) and data["strides"] == (144, 32, 1) and data["byte_offset"] == 0


def test_read_only_view_sets_the_flag_and_refuses_the_legacy_capsule(host, caches):
    view = caches("nvfp4").k_view(0, host, readonly=True)
    assert _fields(view.__dlpack__(max_version=(1, 0)))["flags"] == dlpack.FLAG_READ_ONLY
    with pytest.raises(BufferError, match="read-only"):
        view.__dlpack__()
    array = np.from_dlpack(view)
    assert not array.flags.writeable


def test_copy_true_exports_a_flagged_copy_and_copy_false_shares(host, caches):
    cache = caches("nvfp4")
    cache.alloc_blocks(cache.num_free_blocks())  # writes go only into held blocks
    cache.write_block(0, 2, np.arange(72, dtype=np.uint8), None, host)
    view = cache.k_view(0, host)
    copied = view.__dlpack__(max_version=(1, 1), copy=True)
    assert _fields(copied)["flags"] == dlpack.FLAG_IS_COPIED
    array = np.from_dlpack(view, copy=True)
    shared = np.from_dlpack(view, copy=False)
    assert array[2].tolist() == list(range(72)) == shared[2].tolist()
    array[2, 0] = 200
    assert cache.read_block(0, 2, host)[0][0] == 0  # the copy is not the pool
    shared[2, 0] = 201
    assert cache.read_block(0, 2, host)[0][0] == 201


def test_bad_arguments_are_refused_naming_them(host, caches):
    view = caches("bf16").k_view(0, host)
    with pytest.raises(BufferError, match=r"to device \(2, 0\)"):
        view.__dlpack__(dl_device=(2, 0))
    with pytest.raises(ValueError, match="stream must be None for a host"):
        view.__dlpack__(stream=5)
    with pytest.raises(ValueError, match="copy must be None, True or False, got 1"):
        view.__dlpack__(copy=1)
    with pytest.raises(ValueError, match="max_version"):
        view.__dlpack__(max_version="1.0")
    with pytest.raises(ValueError, match="dl_device"):
        view.__dlpack__(dl_device=1)
    assert _fields(view.__dlpack__(stream=-1, dl_device=(1, 0), copy=False))["device"] == (1, 0)


def test_capsules_free_their_records_consumed_or_not(host, caches):
    gc.collect()
    before = dlpack.live_exports()
    view = caches("bf16").k_view(0, host)
    unconsumed = [view.__dlpack__(), view.__dlpack__(max_version=(1, 0))]
    assert dlpack.live_exports() == before + 2
    del unconsumed
    gc.collect()
    assert dlpack.live_exports() == before
    consumed = np.from_dlpack(view.data_view())
    assert dlpack.live_exports() == before + 1
    del consumed
    gc.collect()
    assert dlpack.live_exports() == before


def test_a_consumed_capsule_is_left_to_its_consumer(host, caches):
    """A consumer renames the capsule "used_dltensor" and calls the deleter itself."""
    gc.collect()
    before = dlpack.live_exports()
    capsule = caches("bf16").k_view(0, host).__dlpack__()
    managed = _managed(capsule)
    assert _set_name(capsule, b"used_dltensor") == 0
    del capsule
    gc.collect()
    assert dlpack.live_exports() == before + 1  # the consumer still holds it
    managed.deleter(ctypes.addressof(managed))
    assert dlpack.live_exports() == before


def test_a_release_is_refused_while_a_consumer_holds_an_export(host, caches):
    cache = caches("nvfp4")
    cache.alloc_blocks(cache.num_free_blocks())  # writes go only into held blocks
    cache.write_block(1, 3, np.full(72, 9, dtype=np.uint8), None, host)
    array = np.from_dlpack(cache.k_view(1, host))
    with pytest.raises(KvCacheError, match=r"while 1 DLPack export\(s\) of its pools are alive"):
        cache.release(host)  # refused, not deferred: a consumer's writes would go into freed memory
    assert array[3].tolist() == [9] * 72 and cache.num_blocks() == 6  # nothing was released
    array[3] = 5
    assert (cache.read_block(1, 3, host)[0] == 5).all()  # still the cache's memory
    del array
    cache.release(host)
    assert cache.num_blocks() == 0
    with pytest.raises(KvCacheError, match="k_view of a released cache"):
        cache.k_view(1, host)


def test_table_exports_capsules(host, caches):
    cache = caches("bf16")
    table = SequenceTable(cache, gpu=host)
    table.add("a", list(range(9)))
    block_table = table.block_table(["a"])
    assert block_table.__dlpack_device__() == (1, 0)
    fields = _fields(block_table.__dlpack__())
    assert fields["dtype"] == (0, 32, 1) and fields["shape"] == (1, 3) and fields["strides"] == (3, 1)
    assert fields["data"] == host.view(block_table.device, 12).__array_interface__["data"][0]
    slots = _fields(table.slot_mapping(["a"], pad_to=12).__dlpack__())
    assert slots["dtype"] == (0, 64, 1) and slots["shape"] == (12,) and slots["strides"] == (1,)
    page = table.page_table(["a"])
    with pytest.raises(TypeError, match="export.device.indptr"):
        page.__dlpack__()
    assert _fields(page.device.last_page_len.__dlpack__())["shape"] == (1,)
    table.free("a")
    table.release()
