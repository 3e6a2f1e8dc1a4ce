"""Pool views and table exports as tensors: shapes, dtypes, zero copy both ways (numpy as
the consumer on HostBackend), and the CUDA side (kDLCUDA capsules, CAI v3, stream waits)
over the libcuda stub."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pagedkv import DeviceMemoryError, KvCacheConfig, KvCacheError, PagedKvCache, SequenceTable
from pagedkv.codecs import encode
from kernel_harness.stub import run_on_stub

RNG = np.random.default_rng(11)


def _cache(host, dtype, num_blocks=5, **extra):
    extra.setdefault("num_kv_heads", 2)
    extra.setdefault("head_dim", 16)
    config = KvCacheConfig(block_size=4, num_layers=2, dtype=dtype, **extra)
    return PagedKvCache(config, num_blocks=num_blocks, gpu=host)


@pytest.mark.parametrize(
    "dtype, k_shape, k_dtype, v_shape, v_dtype",
    [
        ("bf16", (5, 4, 2, 16), ml_dtypes.bfloat16, (5, 4, 2, 16), ml_dtypes.bfloat16),
        ("fp8", (5, 4, 2, 16), ml_dtypes.float8_e4m3fn, (5, 4, 2, 16), ml_dtypes.float8_e4m3fn),
        ("nvfp4", (5, 72), np.uint8, (5, 72), np.uint8),  # 64 data + 8 scale bytes
        ("turbo3", (5, 56), np.uint8, (5, 56), np.uint8),  # 48 + 8
        ("turbo2", (5, 40), np.uint8, (5, 40), np.uint8),  # 32 + 8
        ("bf16k_turbo4v", (5, 4, 2, 16), ml_dtypes.bfloat16, (5, 72), np.uint8),
    ],
)
def test_pool_view_shapes_and_dtypes_per_format(host, dtype, k_shape, k_dtype, v_shape, v_dtype):
    cache = _cache(host, dtype)
    k, v = cache.k_view(1, host), cache.v_view(1, host)
    assert (k.shape, v.shape) == (k_shape, v_shape)
    assert k.host_array().dtype == np.dtype(k_dtype) and v.host_array().dtype == np.dtype(v_dtype)
    assert k.host_array().shape == k_shape and v.side == "V"
    cache.release(host)


def test_hybrid_layers_use_their_own_dims_and_formats(host):
    config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype="bf16",
                           layer_dtypes=("bf16", "turbo8"), layer_dims=((1, 32), (4, 32)))
    cache = PagedKvCache(config, num_blocks=3, gpu=host)
    assert cache.k_view(0, host).shape == (3, 4, 1, 32)
    view = cache.v_view(1, host)  # 128 elements a row: 128 data + 8 groups x 2 scale bytes
    assert view.shape == (3, 4 * 128 + 4 * 16)
    assert view.data_view().shape == (3, 4, 128) and view.scale_view().shape == (3, 4, 16)
    cache.release(host)


def test_packed_view_is_zero_copy_both_ways_through_numpy(host):
    cache = _cache(host, "nvfp4")
    pool = np.from_dlpack(cache.k_view(1, host))
    data = np.from_dlpack(cache.k_view(1, host).data_view())
    scales = np.from_dlpack(cache.k_view(1, host).scale_view())
    written = RNG.integers(0, 256, 72, dtype=np.uint8)
    cache.alloc_blocks(cache.num_free_blocks())  # writes go only into held blocks
    cache.write_block(1, 3, written, None, host)  # pagedkv writes, the consumer sees
    assert pool[3].tolist() == written.tolist()
    assert data[3].reshape(-1).tolist() == written[:64].tolist()
    assert scales[3].reshape(-1).tolist() == written[64:].tolist()
    scales[2, 1, 0] = 0x38  # the consumer writes, pagedkv reads
    data[2, 3, 15] = 0x7A
    k, v = cache.read_block(1, 2, host)
    assert k[64 + 2] == 0x38 and k[3 * 16 + 15] == 0x7A and k.sum() == 0x38 + 0x7A
    assert v.sum() == 0  # V is its own pool
    del pool, data, scales  # the consumer lets go: the release is refused while they are alive
    cache.release(host)


def test_data_and_scale_views_hold_what_write_tokens_encoded(host):
    cache = _cache(host, "turbo4")
    rows = RNG.standard_normal((2, 2, 16)).astype(np.float32)
    cache.alloc_blocks(cache.num_free_blocks())  # writes go only into held blocks
    cache.write_tokens(0, [4 * 4 + 1, 2 * 4 + 3], rows, rows, host, 0)
    expected = np.frombuffer(encode(rows[:1], "turbo4"), dtype=np.uint8)  # one token: 16 data + 2 scale bytes
    view = cache.v_view(0, host)
    assert np.from_dlpack(view.data_view())[4, 1].tolist() == expected[:16].tolist()
    assert np.from_dlpack(view.scale_view())[4, 1].tolist() == expected[16:].tolist()
    cache.release(host)


def test_v_view_is_the_k_view_under_v_aliases_k(host):
    cache = _cache(host, "bf16", v_aliases_k=True)
    k, v = cache.k_view(0, host), cache.v_view(0, host)
    assert v.side == "K"
    k_array, v_array = k.host_array(), v.host_array()
    assert np.shares_memory(k_array, v_array)
    v_array[1, 0, 0, 0] = 3.0
    assert cache.read_block(0, 1, host)[0][:2].view(np.uint16)[0] == 0x4040  # BF16 3.0
    cache.release(host)


def test_bf16_view_values_are_what_write_tokens_wrote(host):
    cache = _cache(host, "bf16")
    rows = RNG.standard_normal((1, 2, 16)).astype(ml_dtypes.bfloat16)
    cache.alloc_blocks(cache.num_free_blocks())  # writes go only into held blocks
    cache.write_tokens(1, [3 * 4 + 2], rows, rows, host, 0)
    assert cache.k_view(1, host).host_array()[3, 2].tolist() == rows[0].tolist()
    cache.release(host)


def test_bad_view_requests_name_the_value(host):
    cache = _cache(host, "bf16")
    with pytest.raises(IndexError, match="layer 2 out of range"):
        cache.k_view(2, host)
    with pytest.raises(ValueError, match="bf16: it has no scale section"):
        cache.k_view(0, host).scale_view()
    with pytest.raises(TypeError, match="stream"):
        cache.k_view(0, host, stream="s")
    with pytest.raises(KvCacheError, match="k_view with object .*: the cache was built on another backend"):
        cache.k_view(0, object())
    with pytest.raises(AttributeError, match="only on CUDA views"):
        cache.k_view(0, host).__cuda_array_interface__
    view = cache.k_view(0, host)
    cache.release(host)
    with pytest.raises(KvCacheError, match="released"):
        view.__dlpack__()


# -- tables ------------------------------------------------------------------------------


def _table(host, with_backend: bool):
    cache = _cache(host, "bf16", num_blocks=16)
    table = SequenceTable(cache, gpu=host if with_backend else None)
    table.add("a", list(range(9)))  # 3 blocks, last holds 1 token
    table.add("b", list(range(8)))  # 2 blocks, both full
    table.add("empty", [])
    return cache, table


@pytest.mark.parametrize("with_backend", [False, True], ids=["host-only", "backend"])
def test_every_table_export_is_zero_copy_both_ways(host, with_backend):
    """Without a backend an export's DLPack is its host array; with one, the backend buffer."""
    cache, table = _table(host, with_backend)
    block_table = table.block_table(["a", "b"])
    slots = table.slot_mapping(["a", "b"], pad_to=20)
    page = table.page_table(["a", "b", "empty"])
    fields = page.device if with_backend else page.host
    producers = {
        "block_table": (block_table, block_table.device if with_backend else block_table.host),
        "slot_mapping": (slots, slots.device if with_backend else slots.host),
        "indptr": (fields.indptr, fields.indptr),
        "indices": (fields.indices, fields.indices),
        "last_page_len": (fields.last_page_len, fields.last_page_len),
    }
    expected = {
        "block_table": [[0, 1, 2], [3, 4, -1]],
        "slot_mapping": list(range(9)) + list(range(12, 20)) + [-1, -1, -1],
        "indptr": [0, 3, 5, 5],
        "indices": [0, 1, 2, 3, 4],
        "last_page_len": [1, 4, 0],
    }
    for name, (producer, memory) in producers.items():
        array = np.from_dlpack(producer)
        assert array.tolist() == expected[name], name
        array.reshape(-1)[0] = 77  # the consumer writes: what pagedkv holds changes
        if with_backend:
            held = np.empty(array.size, dtype=array.dtype)
            host.copy_d2h(memory, held)
        else:
            held = memory.reshape(-1)
        assert held[0] == 77, name
        held_before = array.reshape(-1)[-1]
        if with_backend:  # pagedkv writes its buffer: the consumer sees it
            host.copy_h2d(np.array([-5], dtype=array.dtype), memory.offset((array.size - 1) * array.itemsize))
        else:
            memory.reshape(-1)[-1] = -5
        assert array.reshape(-1)[-1] == -5 != held_before, name
    table.release()
    cache.release(host)


def test_a_stale_device_export_raises_instead_of_reading_freed_memory(host):
    cache = _cache(host, "bf16", num_blocks=600)
    table = SequenceTable(cache, gpu=host)
    table.add("a", list(range(5)))
    old = table.block_table(["a"])
    assert np.from_dlpack(old).tolist() == [[0, 1]]
    table.add("long", list(range(4 * 590)))
    table.block_table(["a", "long"])  # 2 x 590 int32 outgrow the 4096-byte buffer: it moves
    with pytest.raises(DeviceMemoryError, match="not inside any live allocation"):
        np.from_dlpack(old)
    table.release()
    cache.release(host)


def test_last_page_len_follows_flashinfer_and_an_empty_sequence_gets_zero(host):
    cache = _cache(host, "bf16", num_blocks=16)
    table = SequenceTable(cache, gpu=None)
    lengths = {"n1": 1, "n4": 4, "n5": 5, "n8": 8, "n0": 0}
    for seq_id, n in lengths.items():
        table.add(seq_id, list(range(n)))
    page = table.page_table(list(lengths)).host
    assert page.last_page_len.tolist() == [1, 4, 1, 4, 0]
    assert np.diff(page.indptr).tolist() == [1, 1, 2, 2, 0]
    for i, n in enumerate(lengths.values()):
        pages = int(page.indptr[i + 1] - page.indptr[i])
        held = (pages - 1) * 4 + int(page.last_page_len[i]) if pages else 0
        assert held == n
    table.append("n4", 1)
    assert table.page_table(["n4"]).host.last_page_len.tolist() == [1]
    cache.release(host)


# -- CUDA, over the libcuda stub ----------------------------------------------------------


def test_cuda_views_capsules_cai_and_stream_waits_over_the_stub(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv import KvCacheConfig, PagedKvCache, SequenceTable
        from pagedkv.interop import dlpack
        from pagedkv.driver import CudaBackend
        from cuda.bindings import driver as drv

        class DLTensorView:
            """Read a capsule's DLTensor the way a C consumer would."""
            def __init__(self, capsule):
                get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
                get_ptr = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))
                self.capsule, self.name = capsule, get_name(capsule)  # kept: it owns the tensor
                kind = dlpack.DLManagedTensorVersioned if self.name == b"dltensor_versioned" else dlpack.DLManagedTensor
                self.managed = kind.from_address(get_ptr(capsule, self.name))
                t = self.managed.dl_tensor
                self.device = (t.device.device_type, t.device.device_id)
                self.data, self.offset = t.data, t.byte_offset
                self.dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
                self.shape = tuple(t.shape[i] for i in range(t.ndim))
                self.strides = tuple(t.strides[i] for i in range(t.ndim))

        class EngineStream:
            def __init__(self, handle): self.handle = handle
            def __cuda_stream__(self): return (0, self.handle)

        with CudaBackend() as gpu:
            config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype="bf16k_turbo4v")
            cache = PagedKvCache(config, num_blocks=6, gpu=gpu)
            ours = gpu.create_stream()
            k = DLTensorView(cache.k_view(1, gpu, stream=ours).__dlpack__(max_version=(1, 1), stream=-1))
            assert k.name == b"dltensor_versioned" and k.device == (2, 0)
            assert k.data == int(cache.k_pool_ptr(1)) and k.offset == 0
            assert k.dtype == (4, 16, 1) and k.shape == (6, 4, 2, 16) and k.strides == (128, 32, 16, 1)
            v_view = cache.v_view(1, gpu, stream=ours)
            scale = DLTensorView(v_view.scale_view().__dlpack__(stream=-1))
            assert scale.name == b"dltensor" and scale.device == (2, 0)
            assert scale.data == int(cache.v_pool_ptr(1)) and scale.offset == 64
            assert scale.dtype == (1, 8, 1) and scale.shape == (6, 4, 2) and scale.strides == (72, 2, 1)
            assert v_view.__dlpack_device__() == (2, 0)

            cai = v_view.data_view().__cuda_array_interface__
            assert cai == {"shape": (6, 4, 16), "typestr": "|u1", "data": (int(cache.v_pool_ptr(1)), False),
                           "strides": (72, 16, 1), "version": 3, "stream": int(ours)}
            try:
                cache.k_view(1, gpu).__cuda_array_interface__
            except AttributeError as err:
                assert "bfloat16 has no __cuda_array_interface__" in str(err)
            else:
                raise AssertionError("bf16 got a CAI typestr")
            assert cache.v_view(0, gpu).__cuda_array_interface__["stream"] == 1  # pagedkv's 0 is legacy

            # a consumer's stream (another library's, as a __cuda_stream__ object) waits on ours
            theirs = drv.cuStreamCreate(0)[1]
            before = calls("cuStreamWaitEvent"), calls("cuEventRecord"), STUB.stub_live_events()
            DLTensorView(cache.k_view(0, gpu, stream=ours).__dlpack__(stream=EngineStream(int(theirs))))
            DLTensorView(cache.k_view(0, gpu, stream=ours).__dlpack__(stream=int(theirs)))
            assert calls("cuStreamWaitEvent") == before[0] + 2 and calls("cuEventRecord") == before[1] + 2
            assert STUB.stub_live_events() == before[2]  # each event destroyed once the wait is enqueued
            STUB.stub_fail_next(b"cuStreamWaitEvent", 400)
            try:
                cache.k_view(0, gpu, stream=ours).__dlpack__(stream=int(theirs))
            except Exception as err:
                assert "cuStreamWaitEvent" in str(err) and "CUDA_ERROR_INVALID_HANDLE" in str(err), err
            else:
                raise AssertionError("a failed wait went unreported")
            assert STUB.stub_live_events() == before[2]  # the failed wait's event was destroyed too
            assert calls("cuStreamWaitEvent") == before[0] + 3
            DLTensorView(cache.k_view(0, gpu, stream=0).__dlpack__())  # legacy on both sides: nothing to wait for
            DLTensorView(cache.k_view(0, gpu, stream=ours).__dlpack__(stream=-1))
            assert calls("cuStreamWaitEvent") == before[0] + 3
            try:
                cache.k_view(0, gpu).__dlpack__(stream=0)
            except ValueError as err:
                assert "ambiguous" in str(err)
            else:
                raise AssertionError("stream 0 accepted")

            # copies to the host: dl_device=(1, 0), or refused with copy=False
            cache.alloc_blocks(3)  # blocks 0-2: writes go only into held blocks
            cache.write_block(0, 2, np.arange(128, dtype=np.uint8), np.full(72, 5, dtype=np.uint8), gpu)
            host_copy = np.from_dlpack(cache.v_view(0, gpu).data_view(), device="cpu")
            assert host_copy.shape == (6, 4, 16) and host_copy[2].reshape(-1).tolist() == [5] * 64
            k_bytes = DLTensorView(cache.k_view(0, gpu).__dlpack__(dl_device=(1, 0), max_version=(1, 0)))
            assert k_bytes.device == (1, 0) and k_bytes.managed.flags == dlpack.FLAG_IS_COPIED
            assert bytes((ctypes.c_uint8 * 128).from_address(k_bytes.data + 2 * 256)) == bytes(range(128))
            try:
                cache.k_view(0, gpu).__dlpack__(dl_device=(1, 0), copy=False)
            except BufferError as err:
                assert "copy=False" in str(err)
            else:
                raise AssertionError("a cross-device export without a copy")

            # engine stream objects at the cache and the table; table exports are kDLCUDA
            cache.zero_blocks([0, 1], gpu, EngineStream(int(theirs)))
            table = SequenceTable(cache, gpu=gpu, stream=EngineStream(int(theirs)))
            table.add("a", list(range(6)))
            exported = table.block_table(["a"])
            bt = DLTensorView(exported.__dlpack__(stream=-1))
            assert bt.device == (2, 0) and bt.data == int(exported.device)
            assert bt.dtype == (0, 32, 1) and bt.shape == (1, 2) and bt.strides == (2, 1)
            assert int32_at(bt.data, 2) == table.blocks("a")
            page = table.page_table(["a"])
            cai = page.device.indices.__cuda_array_interface__
            assert cai["typestr"] == "<i4" and cai["shape"] == (2,) and cai["stream"] == int(theirs)
            slots = table.slot_mapping(["a"], pad_to=8)
            assert slots.device.__cuda_array_interface__["typestr"] == "<i8"
            assert int64_at(DLTensorView(slots.__dlpack__(stream=-1)).data, 8) == slots.host.tolist()
            table.free("a")
            table.release()
            drv.cuStreamDestroy(theirs)
            gpu.destroy_stream(ours)
            del k, scale  # the consumer's capsules of the pools: a release is refused while they are alive
            cache.release(gpu)
    ''')


def test_a_host_copy_export_waits_for_the_producing_stream_over_the_stub(stub_env):
    """dl_device=cpu from a CUDA view copies to the host only after the view's producing
    stream (here another library's non-blocking stream) has run what was queued on it."""
    run_on_stub(stub_env, '''
        from cuda.bindings import driver as drv
        from pagedkv import KvCacheConfig, PagedKvCache
        from pagedkv.driver import CudaBackend

        class EngineStream:
            def __init__(self, handle): self.handle = handle
            def __cuda_stream__(self): return (0, self.handle)

        with CudaBackend() as gpu:
            config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=1, dtype="nvfp4")
            cache = PagedKvCache(config, num_blocks=4, gpu=gpu)
            cache.alloc_blocks(4)
            theirs = drv.cuStreamCreate(1)[1]  # CU_STREAM_NON_BLOCKING: no implicit legacy sync
            gpu.synchronize(0)
            cache.fill_blocks([1], 7, gpu, EngineStream(int(theirs)))  # queued, not yet run
            copied = np.from_dlpack(cache.k_view(0, gpu, stream=EngineStream(int(theirs))), device="cpu")
            assert copied[1].tolist() == [7] * copied.shape[1], copied[1][:8].tolist()
            assert drv.cuStreamDestroy(theirs)[0] == 0
            cache.release(gpu)
    ''')
