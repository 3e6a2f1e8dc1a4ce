"""Elastic pools over the libcuda stub: CudaBackend's VMM calls (tests/stub_libcuda, the
ELASTIC section) with real page protection, and kernels run by the harness.

An access to an unmapped chunk is checked two ways: a driver copy or memset is refused by
the stub's range check (CUDA_ERROR_INVALID_VALUE, raised as CudaError), and a kernel that
touches one takes a real SIGSEGV on the PROT_NONE pages, which the harness turns into a
failed launch (CUDA_ERROR_ILLEGAL_ADDRESS, the context's sticky error, as on a GPU).
"""

from __future__ import annotations

from textwrap import dedent

from kernel_harness.stub import run_on_stub

SETUP = '''
from pagedkv import KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend
from pagedkv.backends.capabilities import BackendFeatureMissing
from pagedkv.errors import KvCacheError, KvCacheExhausted
STUB.stub_set_vmm_granularity.argtypes = [ctypes.c_size_t]
STUB.stub_set_vmm_granularity(4096)
config = KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")  # 512-byte blocks
'''


def test_elastic_cache_maps_in_steps_and_kernels_run_on_mapped_chunks(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        with CudaBackend() as gpu:
            assert gpu.supports("vmm") and gpu.vmm_granularity() == 4096
            free0, total = gpu.mem_info()
            cache = PagedKvCache(config, 64, gpu, elastic=True)
            assert STUB.stub_live_reservations() == 4 and cache.resident_blocks() == 0
            fixed = 96 + 16  # only the region table (4 rows of 3 int64) and the counter (two words)
            assert gpu.mem_info()[0] == free0 - fixed
            table = cache.alloc_blocks(3)
            assert table == [0, 1, 2] and cache.resident_blocks() == 8
            assert calls("cuMemCreate") == 4 and calls("cuMemMap") == 4 and calls("cuMemSetAccess") == 4
            assert gpu.mem_info()[0] == free0 - fixed - 4 * 4096
            data = (np.arange(512) % 251).astype(np.uint8)
            cache.write_block(1, 2, data, data[::-1].copy(), gpu)
            cache.copy_blocks([(2, 1)], gpu, 0)          # kernel over mapped chunks
            gpu.synchronize(0)
            k, v = cache.read_block(1, 1, gpu)
            assert np.array_equal(k, data) and np.array_equal(v, data[::-1])
            more = cache.alloc_blocks(10)
            assert more == list(range(3, 13)) and cache.resident_blocks() == 16
            cache.fill_blocks(more, 7, gpu, 0)
            gpu.synchronize(0)
            assert np.array_equal(cache.read_block(0, 12, gpu)[1], np.full(512, 7, np.uint8))
            cache.free_blocks(more)
            before = gpu.mem_info()[0]
            assert cache.shrink(gpu) == 4 * 4096 and cache.resident_blocks() == 8
            assert calls("cuMemUnmap") == 4 and calls("cuMemRelease") == 4
            assert gpu.mem_info()[0] == before + 4 * 4096
            k, _ = cache.read_block(1, 1, gpu)  # what stayed mapped kept its bytes
            assert np.array_equal(k, data)
            cache.free_blocks(table)
            assert cache.shrink(gpu) == 4 * 4096 and gpu.mem_info()[0] == before + 8 * 4096
            cache.alloc_blocks(9)  # two steps mapped again, released with the cache
            cache.release(gpu)
            assert STUB.stub_live_reservations() == 0 and STUB.stub_live_mem_handles() == 0
            assert gpu.mem_info()[0] == before + 8 * 4096 + fixed
    '''))


def test_a_copy_into_an_unmapped_chunk_is_refused_by_the_driver(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        from pagedkv.driver import CudaError
        with CudaBackend() as gpu:
            cache = PagedKvCache(config, 64, gpu, elastic=True)
            cache.alloc_block()
            tail = cache.k_pool_ptr(0).offset(8 * 512)  # block 8: the first unmapped chunk
            for action in (lambda: gpu.copy_h2d(bytes(512), tail), lambda: gpu.copy_d2h(tail, bytearray(512))):
                try:
                    action()
                except CudaError as err:
                    assert err.status_name == "CUDA_ERROR_INVALID_VALUE", err
                else:
                    raise AssertionError("a copy into an unmapped chunk must fail")
            try:
                cache.zero_blocks([8], gpu, 0)   # the cache refuses before the kernel runs
            except IndexError as err:
                assert "block 8 is not resident" in str(err), err
            else:
                raise AssertionError("zeroing a block that is not resident must fail")
            cache.release(gpu)
    '''))


def test_a_kernel_touching_an_unmapped_chunk_faults_loudly(stub_env):
    """The harness catches the kernel's SIGSEGV on the PROT_NONE chunk and fails the launch
    with CUDA_ERROR_ILLEGAL_ADDRESS, sticky as on a GPU; nothing is written anywhere."""
    run_on_stub(stub_env, SETUP + dedent('''
        from pagedkv.driver import CudaError
        STUB.stub_fault_message.restype = ctypes.c_char_p
        gpu = CudaBackend()
        cache = PagedKvCache(config, 64, gpu, elastic=True)
        cache.alloc_block()
        assert cache.resident_blocks() == 8
        # behind the cache's back: the kernel writes block 20, in no mapped chunk
        gpu.fill_blocks(cache.block_regions(), [20], 0xEE, 0)
        try:
            gpu.synchronize(0)
        except CudaError as err:
            assert err.status == 700 and err.status_name == "CUDA_ERROR_ILLEGAL_ADDRESS", err
        else:
            raise AssertionError("a kernel writing an unmapped chunk must fail its launch")
        assert "pagedkv_fill_blocks" in STUB.stub_fault_message().decode()
        try:
            gpu.close()
        except CudaError:
            pass
        assert STUB.stub_sticky_status() == 0  # the context reset (the stub keeps its VMM ranges)
    '''))


def test_device_without_vmm_is_refused_by_name(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        STUB.stub_set_vmm_supported(0)
        with CudaBackend() as gpu:
            assert not gpu.supports("vmm")
            live = STUB.stub_live_allocations()
            try:
                PagedKvCache(config, 64, gpu, elastic=True)
            except BackendFeatureMissing as err:
                assert "elastic pools needs a backend that supports 'vmm'" in str(err), err
                assert "CudaBackend" in str(err), err
            else:
                raise AssertionError("elastic=True must need vmm")
            assert STUB.stub_live_allocations() == live and STUB.stub_live_reservations() == 0
            PagedKvCache(config, 64, gpu).release(gpu)  # the default path is unaffected
    '''))


def test_two_caches_share_a_capped_stub_device_and_failed_maps_leave_nothing(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        from pagedkv.driver import CudaError
        STUB.stub_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
        with CudaBackend() as gpu:
            a = PagedKvCache(config, 64, gpu, elastic=True)
            b = PagedKvCache(config, 64, gpu, elastic=True)
            free, total = gpu.mem_info()
            STUB.stub_set_total_mem(total - free + 4 * 4 * 4096)  # room for four steps in all
            burst = a.alloc_blocks(24)
            b.alloc_blocks(8)
            handles = STUB.stub_live_mem_handles()
            try:
                b.alloc_block()
            except KvCacheExhausted as err:
                assert "the device could not map more: cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY" in str(err), err
            else:
                raise AssertionError("the capped device must refuse a fifth step")
            assert STUB.stub_live_mem_handles() == handles and b.resident_blocks() == 8
            a.free_blocks(burst[8:])
            assert a.shrink(gpu) == 2 * 4 * 4096 and gpu.mem_info()[0] == 2 * 4 * 4096
            STUB.stub_fail_next(b"cuMemSetAccess", 1)  # the third granule of the step fails
            try:
                b.alloc_block()
            except CudaError as err:
                assert err.call == "cuMemSetAccess", err
            else:
                raise AssertionError("an injected cuMemSetAccess failure must surface")
            assert STUB.stub_live_mem_handles() == handles - 8 and b.resident_blocks() == 8  # a gave 8 back
            assert gpu.mem_info()[0] == 2 * 4 * 4096
            assert b.alloc_blocks(16) == list(range(8, 24)) and gpu.mem_info()[0] == 0
            a.release(gpu)
            b.release(gpu)
            assert STUB.stub_live_reservations() == 0 and STUB.stub_live_mem_handles() == 0
    '''))


def test_close_releases_reservations_a_cache_left_behind(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        gpu = CudaBackend()
        cache = PagedKvCache(config, 64, gpu, elastic=True)
        cache.alloc_blocks(12)
        assert STUB.stub_live_reservations() == 4 and STUB.stub_live_mem_handles() == 8
        gpu.close()  # the cache was never released
        assert STUB.stub_live_reservations() == 0 and STUB.stub_live_mem_handles() == 0
        assert STUB.stub_live_allocations() == 0
    '''))


def test_stub_vmm_calls_follow_the_driver_rules(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        from cuda.bindings import driver as d
        from pagedkv.driver.errors import check, CudaError
        gpu = CudaBackend()  # makes the primary context current
        g = 4096
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        def status(result):
            return int(result[0] if isinstance(result, tuple) else result)
        base = int(check(d.cuMemAddressReserve(4 * g, g, 0, 0), "reserve"))
        assert base % g == 0
        assert status(d.cuMemAddressReserve(g + 1, 0, 0, 0)) == 1  # not a multiple of the granularity
        handle = check(d.cuMemCreate(2 * g, prop, 0), "create")
        check(d.cuMemMap(base + g, 2 * g, 0, handle, 0), "map")
        assert status(d.cuMemcpyHtoD(base + g, bytes(16), 16)) == 1  # mapped, but no access yet
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = 0
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        assert status(d.cuMemSetAccess(base, 2 * g, [access], 1)) == 1  # granule 0 is not mapped
        check(d.cuMemSetAccess(base + g, 2 * g, [access], 1), "access")
        check(d.cuMemcpyHtoD(base + g, b"\\x07" * 16, 16), "copy")
        out = bytearray(16)
        check(d.cuMemcpyDtoH(out, base + g, 16), "copy back")
        assert bytes(out) == b"\\x07" * 16
        assert status(d.cuMemcpyHtoD(base + 3 * g - 8, bytes(16), 16)) == 1  # runs into granule 3
        assert status(d.cuMemUnmap(base + g, g)) == 1  # half a mapping
        assert status(d.cuMemAddressFree(base, 4 * g)) == 1  # still mapped
        check(d.cuMemRelease(handle), "release")  # freed once unmapped too
        assert STUB.stub_live_mem_handles() == 1
        check(d.cuMemUnmap(base + g, 2 * g), "unmap")
        assert STUB.stub_live_mem_handles() == 0
        assert status(d.cuMemcpyDtoH(out, base + g, 16)) == 1
        check(d.cuMemAddressFree(base, 4 * g), "free")
        assert STUB.stub_live_reservations() == 0
        gpu.close()
    '''))
