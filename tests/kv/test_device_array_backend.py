"""A DeviceArray names its owning backend (issue 21): pagedkv's producers (pool views, table
exports' device copies) set it, and write_tokens/read_tokens and the layer plans refuse one
of another backend, naming both, before anything is written; one built without a backend
is taken on the caller's word, as before."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache, SequenceTable
from pagedkv.interop.device_array import from_dlpack, owning_backend
from kernel_harness.stub import run_on_stub

CONFIG = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")


class Pair:
    """A cache and table on `gpu`, another on `other`; rows of 5 tokens in each backend."""

    def __init__(self):
        self.gpu, self.other = HostBackend(1 << 22), HostBackend(1 << 22)
        self.cache = PagedKvCache(CONFIG, 4, self.gpu)
        self.other_cache = PagedKvCache(CONFIG, 4, self.other)
        self.table, self.other_table = SequenceTable(self.cache, None, self.gpu), SequenceTable(self.other_cache, None, self.other)
        self.table.add("a", list(range(5)))
        self.other_table.add("a", list(range(5)))
        self.rows = np.arange(5 * 16, dtype=np.float32).reshape(5, 1, 16) / 7

    def array(self, backend, owned: bool = True):
        ptr = backend.alloc(self.rows.nbytes)
        backend.copy_h2d(self.rows.view(np.uint8).ravel(), ptr)
        return DeviceArray(ptr, self.rows.shape, "float32", backend=backend if owned else None)

    def pools(self):
        return [bytes(self.gpu.view(self.cache.k_pool_ptr(layer), 4 * self.cache.k_block_stride_bytes_for_layer(layer)))
                for layer in (0, 1)]


def _names_both(pair, err):
    text = str(err)
    return f"{pair.other!r:.60}" in text and f"{pair.gpu!r:.60}" in text and "another backend" in text


def test_pagedkv_producers_name_their_backend():
    p = Pair()
    assert from_dlpack(p.table.slot_mapping(["a"])).backend is p.gpu
    assert from_dlpack(p.table.slot_mapping(["a"]).device).backend is p.gpu
    assert owning_backend(p.table.page_table(["a"])) is p.gpu
    assert from_dlpack(p.cache.k_view(0, p.gpu)).backend is p.gpu
    assert owning_backend(p.cache.k_view(0, p.gpu).bits_view()) is p.gpu
    assert owning_backend(np.zeros(1)) is None
    assert DeviceArray(4096, (1,), "int64").backend is None


@pytest.mark.parametrize("what", ["k", "v"])
def test_write_tokens_refuses_rows_of_another_backend_with_nothing_written(what):
    p = Pair()
    before = p.pools()
    mine, theirs = p.array(p.gpu), p.array(p.other)
    k, v = (theirs, mine) if what == "k" else (mine, theirs)
    with pytest.raises(ValueError, match=f"^{what} is memory of HostBackend") as err:
        p.cache.write_tokens(0, p.table.slot_mapping(["a"]), k, v, p.gpu, 0)
    assert _names_both(p, err.value)
    assert p.pools() == before


def test_slots_exported_by_another_backends_table_are_refused():
    p = Pair()
    before = p.pools()
    with pytest.raises(ValueError, match="^slots is memory of HostBackend") as err:
        p.cache.write_tokens(0, p.other_table.slot_mapping(["a"]), p.rows, p.rows, p.gpu, 0)
    assert _names_both(p, err.value)
    with pytest.raises(ValueError, match="^slots is memory of"):
        p.cache.read_tokens(0, p.other_table.slot_mapping(["a"]), p.gpu)
    assert p.pools() == before


def test_read_tokens_refuses_an_output_of_another_backend_with_nothing_written():
    p = Pair()
    p.cache.write_tokens(0, p.table.slot_mapping(["a"]), p.rows, p.rows, p.gpu, 0)
    mine, theirs = p.array(p.gpu), p.array(p.other)
    theirs_before = p.other.view(theirs.ptr, p.rows.nbytes).copy()
    mine_before = p.gpu.view(mine.ptr, p.rows.nbytes).copy()
    with pytest.raises(ValueError, match="^out_v is memory of HostBackend") as err:
        p.cache.read_tokens(0, p.table.slot_mapping(["a"]), p.gpu, out_k=mine, out_v=theirs)
    assert _names_both(p, err.value)
    assert np.array_equal(p.other.view(theirs.ptr, p.rows.nbytes), theirs_before)
    assert np.array_equal(p.gpu.view(mine.ptr, p.rows.nbytes), mine_before)


def test_a_view_of_another_cache_is_refused_as_an_output():
    p = Pair()
    with pytest.raises(ValueError, match="^out_k is memory of HostBackend"):
        p.cache.read_tokens(0, p.table.slot_mapping(["a"]), p.gpu, out_k=p.other_cache.k_view(0, p.other),
                            out_v=p.other_cache.v_view(0, p.other))


def test_the_plans_refuse_arrays_of_another_backend_when_made():
    p = Pair()
    mine, theirs = p.array(p.gpu), p.array(p.other)
    with pytest.raises(ValueError, match="^v of layer 1 is memory of HostBackend"):
        p.cache.plan_layer_writes([0, 1], [mine, mine], [mine, theirs], p.gpu)
    with pytest.raises(ValueError, match="^k of layer 0 is memory of HostBackend"):
        p.cache.plan_layer_writes([0], [theirs], [mine], p.gpu)
    with pytest.raises(ValueError, match="^out_k of layer 1 is memory of HostBackend"):
        p.cache.plan_layer_reads([0, 1], [mine, theirs], [mine, mine], p.gpu)
    plan = p.cache.plan_layer_writes([0], [mine], [mine], p.gpu)
    with pytest.raises(ValueError, match="^slots is memory of HostBackend"):
        plan.write(p.other_table.slot_mapping(["a"]), 0)
    plan.close()


def test_arrays_of_the_calls_backend_or_of_none_are_taken_and_write_the_numpy_bytes():
    p = Pair()
    slots = p.table.slot_mapping(["a"])
    p.cache.write_tokens(0, slots, p.rows, p.rows, p.gpu, 0)
    want = p.pools()
    p.cache.zero_blocks(p.table.blocks("a"), p.gpu, 0)
    p.cache.write_tokens(0, slots, p.array(p.gpu), p.array(p.gpu), p.gpu, 0)
    assert p.pools() == want
    p.cache.zero_blocks(p.table.blocks("a"), p.gpu, 0)
    p.cache.write_tokens(0, slots, p.array(p.gpu, owned=False), p.array(p.gpu, owned=False), p.gpu, 0)
    assert p.pools() == want


def test_cuda_refuses_an_array_of_another_backend_before_any_launch(stub_env):
    out = run_on_stub(stub_env, '''
        from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
        from pagedkv.driver import CudaBackend
        host = HostBackend(1 << 20)
        with CudaBackend() as gpu:
            cache = PagedKvCache(KvCacheConfig(4, 1, 16, 2, "bf16"), 4, gpu)
            slots = DeviceArray(gpu.alloc(8 * 5), (5,), "int64", backend=gpu)
            mine = DeviceArray(gpu.alloc(5 * 64), (5, 1, 16), "float32", backend=gpu)
            theirs = DeviceArray(host.alloc(5 * 64), (5, 1, 16), "float32", backend=host)
            launches = calls("cuLaunchKernel")
            for call in (lambda: cache.write_tokens(0, slots, mine, theirs, gpu, 0),
                         lambda: cache.read_tokens(0, slots, gpu, out_k=theirs, out_v=mine),
                         lambda: cache.plan_layer_writes([0], [theirs], [mine], gpu),
                         lambda: cache.write_tokens(0, DeviceArray(slots.ptr, (5,), "int64", backend=host),
                                                    mine, mine, gpu, 0)):
                try:
                    call()
                except ValueError as err:
                    assert "another backend" in str(err) and "CudaBackend" in str(err), err
                else:
                    raise AssertionError("an array of another backend was accepted")
            assert calls("cuLaunchKernel") == launches
            cache.write_tokens(0, slots, mine, mine, gpu, 0)      # the call's own: one launch
            assert calls("cuLaunchKernel") == launches + 1
            cache.release(gpu)
        print("CHECK backend refused")
    ''')
    assert "CHECK backend refused" in out


@pytest.mark.cuda
def test_a_gpu_refuses_an_array_of_another_backend_with_nothing_written(cuda_session):
    gpu, host = cuda_session, HostBackend(1 << 20)
    cache = PagedKvCache(CONFIG, 4, gpu)
    buffers = [gpu.alloc(8 * 5), gpu.alloc(5 * 64)]
    try:
        cache.zero_blocks(list(range(4)), gpu, 0)
        slots = DeviceArray(buffers[0], (5,), "int64", backend=gpu)
        mine = DeviceArray(buffers[1], (5, 1, 16), "float32", backend=gpu)
        theirs = DeviceArray(host.alloc(5 * 64), (5, 1, 16), "float32", backend=host)
        with pytest.raises(ValueError, match="^v is memory of HostBackend"):
            cache.write_tokens(0, slots, mine, theirs, gpu, 0)
        with pytest.raises(ValueError, match="^out_k is memory of HostBackend"):
            cache.read_tokens(0, slots, gpu, out_k=theirs, out_v=mine)
        gpu.synchronize(0)
        size = 4 * cache.k_block_stride_bytes_for_layer(0)
        got = np.empty(size, np.uint8)
        gpu.copy_d2h(cache.k_pool_ptr(0), got)
        assert not got.any()
    finally:
        for ptr in buffers:
            gpu.free(ptr)
        cache.release(gpu)
