"""CudaBackend against a host-memory libcuda.so.1 (tests/stub_libcuda/stub_libcuda.c).

What this proves: the Python side of the driver layer, and the kernels' code run on
the CPU. Every CudaBackend call goes through cuda-bindings into a real shared library
that checks handles, contexts and address ranges, records each kernel launch's
parameters byte for byte (asserted here field by field), queues async work per stream
until the host waits for it, runs the real kernel sources through the kernel harness
(tests/kernel_harness: one fiber per CUDA thread, CTAs one at a time), and returns any
status we inject, so each error path and its CudaError can be checked. What it does NOT
prove: the GPU's memory model, concurrency between CTAs, timing and bandwidth; those are
covered only by the `cuda`-marked tests (test_cuda_gpu.py) on a machine with an NVIDIA
GPU.

The stub and the kernel libraries are built with the machine's compilers into a
temporary directory once per session and loaded in a subprocess (LD_LIBRARY_PATH) before
any driver call, so this pytest process never loads a libcuda.
"""

from __future__ import annotations

from pathlib import Path

from kernel_harness.stub import REPO_ROOT, run_on_stub

def test_importing_pagedkv_touches_no_driver(stub_env):
    run_on_stub(stub_env, '''
        import os
        import pagedkv, pagedkv.driver
        assert "cuda.bindings.driver" not in sys.modules
        pagedkv.driver.is_available()  # whatever it answers, it must not initialise CUDA
        assert "cuda.bindings.driver" not in sys.modules
        assert calls("cuInit") == 0 and calls("cuDriverGetVersion") == 0
        from pagedkv.driver import CudaBackend, CudaError  # resolving the names still calls nothing
        assert calls("cuInit") == 0
    ''')


def test_nvrtc_compiles_with_the_stub_loaded(stub_env, tmp_path):
    """libnvrtc dlopens libcuda.so.1 and calls cuInit and cuGetExportTable while compiling;
    the stub answers enough for the compile to succeed."""
    run_on_stub(stub_env, f'''
        from pagedkv.driver import nvrtc
        kernel = nvrtc.compile_cached(nvrtc.SOURCE_DIR / "fill_blocks.cu", "sm_90", cache_dir=__import__("pathlib").Path({str(tmp_path)!r}))
        assert not kernel.from_cache and kernel.cubin[:4] == b"\\x7fELF"
        assert calls("cuInit") >= 1 and calls("cuGetExportTable") >= 1
    ''')


def test_lifecycle_context_modules_and_close(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend, CudaError
        STUB.stub_set_device(132, 9, 0)
        with CudaBackend() as gpu:
            assert calls("cuInit") == 1
            assert STUB.stub_primary_refs() == 1
            assert STUB.stub_live_modules() == 5
            assert calls("cuModuleGetFunction") == 18  # the kernels of KERNELS (kv_rows.cu has thirteen)
            assert gpu.device_name == "pagedkv stub device 0"
            assert gpu.compute_capability == (9, 0) and gpu.sm_count == 132
            from pagedkv.backends.protocol import GpuBackend
            assert isinstance(gpu, GpuBackend)
            leaked = gpu.alloc(4096)
            pinned = gpu.alloc_pinned(4096)
            stream = gpu.create_stream()
        assert gpu.closed
        assert STUB.stub_primary_refs() == 0
        assert STUB.stub_live_modules() == 0
        assert STUB.stub_live_allocations() == 0, "close frees leftover allocations and staging"
        assert STUB.stub_live_host_allocations() == 0 and pinned.freed
        assert STUB.stub_live_streams() == 0 and STUB.stub_live_events() == 0
        gpu.close()  # a second close does nothing
        assert calls("cuDevicePrimaryCtxRelease") == 1
        from pagedkv.driver import BackendClosed
        try:
            gpu.alloc(16)
        except BackendClosed as err:
            assert not isinstance(err, CudaError) and str(err) == "this CudaBackend is closed", err
        else:
            raise AssertionError("alloc after close must raise")
    ''')


def test_memory_calls_reach_the_driver_once_each(stub_env):
    """What the conformance suite (tests/testing/test_conformance_cuda.py) cannot see: mem_info is
    the driver's, zero-byte calls make no driver call, a refused free makes none."""
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        from pagedkv.errors import DeviceMemoryError
        with CudaBackend() as gpu:
            free0, total = gpu.mem_info()
            a, b = gpu.alloc(1000), gpu.alloc(1000)
            assert gpu.mem_info() == (free0 - 2000, total)
            memsets, copies = calls("cuMemsetD8Async"), calls("cuMemcpyDtoDAsync")
            gpu.memset_async(a, 1, 0, 0)  # zero bytes: nothing to do, as on the host
            gpu.copy_d2d(a, b, 0, 0)
            assert calls("cuMemsetD8Async") == memsets and calls("cuMemcpyDtoDAsync") == copies
            gpu.free(a)
            for again in (a, a.offset(8)):
                try:
                    gpu.free(again)
                except DeviceMemoryError as err:
                    assert hex(int(again))[2:] in str(err)
                else:
                    raise AssertionError("free of a freed or interior pointer must raise")
            assert calls("cuMemFree") == 1
            gpu.free(b)
            assert gpu.live_allocations() == 0
    ''')


def test_streams_and_pinned_buffers_are_driver_objects(stub_env):
    """Beyond the conformance suite: streams and pinned buffers are live driver objects
    until destroyed, and async copies refuse pageable memory."""
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend, PinnedBuffer
        with CudaBackend() as gpu:
            s1, s2 = gpu.create_stream(), gpu.create_stream()
            assert STUB.stub_live_streams() == 2
            dev = gpu.alloc(256)
            with gpu.alloc_pinned(256) as pin:
                assert isinstance(pin, PinnedBuffer) and len(pin) == 256
                assert STUB.stub_live_host_allocations() >= 1
                try:
                    gpu.copy_h2d_async(np.zeros(16, np.uint8), dev, s1)
                except ValueError as err:
                    assert "PinnedBuffer" in str(err)
                else:
                    raise AssertionError("pageable memory accepted by an async copy")
            assert STUB.stub_live_host_allocations() == 0, "freed at the end of the with block"
            try:
                gpu.destroy_stream(12345)
            except ValueError as err:
                assert "12345" in str(err)
            else:
                raise AssertionError("an unknown stream destroyed")
            gpu.destroy_stream(s1)
            gpu.destroy_stream(s2)
            gpu.free(dev)
            assert STUB.stub_live_streams() == 0
    ''')


def test_fill_launch_packs_every_field(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        from pagedkv import HostBackend
        STUB.stub_set_device(2, 9, 0)
        STUB.stub_set_occupancy(16)  # grids are SMs x the occupancy the driver reports
        host = HostBackend(1 << 20)
        with CudaBackend() as gpu:
            rows, blocks = [], [5, 0, 7]
            host_rows = []
            for nbytes, stride in ((4096, 4096), (100, 112), (64, 80)):
                p, h = gpu.alloc(8 * stride), host.alloc(8 * stride)
                seed = np.random.default_rng(stride).integers(0, 256, 8 * stride, dtype=np.uint8)
                gpu.copy_h2d(seed, p)
                host.copy_h2d(seed, h)
                rows.append((int(p), stride, nbytes))
                host_rows.append((int(h), stride, nbytes))
            regions = gpu.create_block_regions(rows)
            assert int64_at(int(regions.device_table), 9) == [v for row in rows for v in row]
            uploads = calls("cuMemcpyHtoDAsync")  # copy_h2d queues on CU_STREAM_LEGACY too
            stream = gpu.create_stream()
            before = STUB.stub_launch_count()
            gpu.fill_blocks(regions, blocks, 0xAB, stream)
            assert STUB.stub_launch_count() == before + 1, "one launch for every block of every region"
            rec, p = launch(-1)
            assert rec.name == b"pagedkv_fill_blocks"
            assert list(rec.grid) == [min(3 * 3, 2 * 16), 1, 1]
            assert list(rec.block) == [256, 1, 1] and rec.shared == 0
            assert rec.stream == stream
            assert u64(p[0]) == int(regions.device_table)
            assert i32(p[1]) == 3
            assert STUB.stub_pending_work() >= 2, "the index upload and the launch wait in the stream's queue"
            gpu.synchronize(stream)  # the indices reach the staging buffer when the stream runs
            assert STUB.stub_pending_work() == 0
            assert int32_at(u64(p[2]), 3) == blocks
            assert i32(p[3]) == 3
            assert u32(p[4]) == 0xAB
            gpu.fill_blocks(regions, [1, 2, 3, 4, 6], 0, 0)
            rec, p = launch(-1)
            assert list(rec.grid) == [min(3 * 5, 2 * 16), 1, 1] and rec.stream == 1  # CU_STREAM_LEGACY
            gpu.synchronize(0)
            assert int32_at(u64(p[2]), 5) == [1, 2, 3, 4, 6] and i32(p[3]) == 5 and u32(p[4]) == 0
            assert calls("cuMemcpyHtoDAsync") == uploads + 2, "per launch only its indices: the table went up once"
            hregions = host.create_block_regions(host_rows)
            host.fill_blocks(hregions, blocks, 0xAB, 0)
            host.fill_blocks(hregions, [1, 2, 3, 4, 6], 0, 0)
            gpu.synchronize(stream)
            for (gp, stride, _), (hp, _, _) in zip(rows, host_rows):
                out = np.empty(8 * stride, np.uint8)
                gpu.copy_d2h(gp, out)
                assert np.array_equal(out, host.view(hp, 8 * stride))
            try:
                gpu.fill_blocks(regions, [8], 1, 0)
            except IndexError as err:
                assert "block 8" in str(err)
            else:
                raise AssertionError("a block past the pool must be refused")
            assert STUB.stub_launch_count() == before + 2
            gpu.destroy_block_regions(regions)
            assert regions.device_table is None
            gpu.destroy_stream(stream)
    ''')


def test_copy_launch_packs_every_field(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        from pagedkv import HostBackend
        host = HostBackend(1 << 20)
        with CudaBackend() as gpu:
            seed = np.random.default_rng(3).integers(0, 256, 16 * 528, dtype=np.uint8)
            g, h = gpu.alloc(seed.size), host.alloc(seed.size)
            gpu.copy_h2d(seed, g)
            host.copy_h2d(seed, h)
            rows = [(int(g), 528, 520), (int(g) + 8 * 528, 528, 528)]
            hrows = [(int(h), 528, 520), (int(h) + 8 * 528, 528, 528)]
            regions, hregions = gpu.create_block_regions(rows), host.create_block_regions(hrows)
            src, dst = [0, 3, 5], [7, 1, 2]
            gpu.copy_blocks(regions, src, dst, 0)
            host.copy_blocks(hregions, src, dst, 0)
            rec, p = launch(-1)
            gpu.synchronize(0)
            assert rec.name == b"pagedkv_copy_blocks"
            assert list(rec.grid) == [6, 1, 1] and list(rec.block) == [256, 1, 1] and rec.stream == 1  # CU_STREAM_LEGACY
            assert u64(p[0]) == int(regions.device_table) and i32(p[1]) == 2
            assert int32_at(u64(p[2]), 3) == src and int32_at(u64(p[3]), 3) == dst
            assert i32(p[4]) == 3
            out = np.empty(seed.size, np.uint8)
            gpu.copy_d2h(g, out)
            assert np.array_equal(out, host.view(h, seed.size))
            count = STUB.stub_launch_count()
            for bad_src, bad_dst, words in (([1, 2], [3, 3], "repeat"), ([1, 2], [2, 4], "both"), ([1], [2, 4], "as many")):
                try:
                    gpu.copy_blocks(regions, bad_src, bad_dst, 0)
                except ValueError as err:
                    assert words in str(err), err
                else:
                    raise AssertionError((bad_src, bad_dst))
            assert STUB.stub_launch_count() == count, "refused pairs launch nothing"
    ''')


def test_reduce_launches_partial_then_final_and_matches_host(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        from pagedkv import HostBackend
        import ml_dtypes
        STUB.stub_set_device(3, 9, 0)
        host = HostBackend(1 << 22)
        rng = np.random.default_rng(11)
        with CudaBackend() as gpu:
            values = rng.normal(size=64 * 1024).astype(ml_dtypes.bfloat16)
            raw = values.view(np.uint8)
            g, h = gpu.alloc(raw.size), host.alloc(raw.size)
            gpu.copy_h2d(raw, g)
            host.copy_h2d(raw, h)
            regions = gpu.create_block_regions([(int(g), 4096, 4096)])
            hregions = host.create_block_regions([(int(h), 4096, 4096)])
            blocks = [3, 1, 30, 7, 9, 12, 0, 31, 22, 5, 17, 8, 2, 4, 6, 10, 11, 13, 14, 15, 16, 18, 19, 20, 21, 23, 24, 25, 26, 27]
            before = STUB.stub_launch_count()
            got = gpu.reduce_bf16_blocks(regions, 0, blocks, 0)
            assert STUB.stub_launch_count() == before + 2
            part, pp = launch(-2)
            final, fp = launch(-1)
            assert part.name == b"pagedkv_reduce_bf16_partial" and final.name == b"pagedkv_reduce_bf16_final"
            grid = min(len(blocks), 3 * 8)
            assert list(part.grid) == [grid, 1, 1] and list(part.block) == [256, 1, 1]
            assert i64(pp[0]) == int(g) and i64(pp[1]) == 4096 and i64(pp[2]) == 4096
            assert int32_at(u64(pp[3]), len(blocks)) == blocks and i32(pp[4]) == len(blocks)
            assert list(final.grid) == [1, 1, 1] and list(final.block) == [256, 1, 1]
            assert u64(fp[0]) == u64(pp[5]) and i32(fp[1]) == grid
            assert u64(fp[2]) >= u64(pp[5]) + 8 * 36 * grid, "the result does not overlap the partials"
            want = host.reduce_bf16_blocks(hregions, 0, blocks, 0)
            assert got == want, (got, want)  # exact checksums: identical on every backend
            assert gpu.reduce_bf16_blocks(regions, 0, [], 0) == (0.0, 0.0, 0.0)
            assert STUB.stub_launch_count() == before + 2
            for bad in (1, -1):
                try:
                    gpu.reduce_bf16_blocks(regions, bad, [0], 0)
                except IndexError as err:
                    assert f"region {bad}" in str(err)
                else:
                    raise AssertionError(bad)
            odd = gpu.create_block_regions([(int(g), 4096, 4095)])
            try:
                gpu.reduce_bf16_blocks(odd, 0, [0], 0)
            except ValueError as err:
                assert "odd block size 4095" in str(err)
            else:
                raise AssertionError("odd BF16 block")
    ''')


def test_error_statuses_map_to_cuda_errors(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend, CudaError, CudaOutOfMemory
        from pagedkv.errors import DeviceOutOfMemory
        statuses = {
            1: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
            2: ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
            3: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
            101: ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
            200: ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
            201: ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
            400: ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
            500: ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
            700: ("CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"),
            719: ("CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
            801: ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
            999: ("CUDA_ERROR_UNKNOWN", "no message from the driver"),  # unknown to the stub's cuGetErrorString
        }
        with CudaBackend() as gpu:
            ptr = gpu.alloc(64)
            for status, (name, message) in statuses.items():
                STUB.stub_fail_next(b"cuMemsetD8Async", status)
                try:
                    gpu.memset_async(ptr, 1, 64, 0)
                except CudaError as err:
                    assert err.call == "cuMemsetD8Async" and err.status == status, err
                    assert err.status_name == name and err.driver_message == message, err
                    assert str(err) == f"cuMemsetD8Async failed: {name} ({message})", str(err)
                    assert isinstance(err, CudaOutOfMemory) == (status == 2)
                else:
                    raise AssertionError(status)
            STUB.stub_set_total_mem(ctypes.c_size_t(1 << 30))
            try:
                gpu.alloc(80 << 30)
            except CudaOutOfMemory as err:
                assert isinstance(err, DeviceOutOfMemory) and isinstance(err, MemoryError)
                assert str(err) == "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory) asking 80.0 GiB", str(err)
            else:
                raise AssertionError("80 GiB on a 1 GiB stub")
            again = gpu.alloc(64)  # still usable after the OOM
            gpu.free(again)
            regions = gpu.create_block_regions([(int(ptr), 64, 64)])
            STUB.stub_fail_next(b"cuLaunchKernel", 700)
            try:
                gpu.fill_blocks(regions, [0], 0, 0)
            except CudaError as err:
                assert str(err) == ("cuLaunchKernel failed: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access "
                                    "was encountered) (pagedkv_fill_blocks, grid 1, block 256)"), str(err)
            else:
                raise AssertionError("launch failure")
            slot = gpu._staging._slots[0]
            assert slot.pending, "the failed launch's queued upload must keep its slot busy"
            gpu.fill_blocks(regions, [0], 3, 0)  # the staging slot is usable after the failed launch
            out = np.empty(64, np.uint8)
            gpu.copy_d2h(ptr, out)
            assert (out == 3).all()
    ''')


def test_unavailable_and_failed_construction_release_everything(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend, CudaError, CudaUnavailable
        STUB.stub_set_init_status(100)
        try:
            CudaBackend()
        except CudaUnavailable as err:
            assert str(err) == "The NVIDIA driver is installed but reports no GPU (CUDA_ERROR_NO_DEVICE).", str(err)
        else:
            raise AssertionError("no device")
        STUB.stub_set_init_status(3)
        try:
            CudaBackend()
        except CudaUnavailable as err:
            assert "cuInit returned CUDA_ERROR_NOT_INITIALIZED (initialization error)" in str(err), str(err)
        else:
            raise AssertionError("failed init")
        STUB.stub_set_init_status(0)
        try:
            CudaBackend(device=3)
        except CudaUnavailable as err:
            assert str(err) == "CUDA device 3 does not exist: this machine has 1 GPU(s).", str(err)
        else:
            raise AssertionError("device 3")
        STUB.stub_fail_next(b"cuModuleGetFunction", 500)  # the first module loads, its function lookup fails
        try:
            CudaBackend()
        except CudaError as err:
            assert err.call == "cuModuleGetFunction" and "pagedkv_fill_blocks" in str(err), str(err)
        else:
            raise AssertionError("function lookup failure")
        assert STUB.stub_primary_refs() == 0 and STUB.stub_live_modules() == 0
        assert STUB.stub_live_allocations() == 0
        with CudaBackend() as gpu:  # a clean construction afterwards works
            gpu.free(gpu.alloc(8))
    ''')


def test_close_releases_the_context_when_it_cannot_be_made_current(stub_env):
    """A thread where cuCtxSetCurrent fails still releases the primary context on close(),
    and a construction failing that way leaves no retain behind."""
    run_on_stub(stub_env, '''
        from cuda.bindings import driver as D
        from pagedkv.driver import CudaBackend, CudaError
        real = D.cuCtxSetCurrent
        D.cuCtxSetCurrent = lambda ctx: (D.CUresult(201),)
        try:
            CudaBackend()
        except CudaError as err:
            assert err.call == "cuCtxSetCurrent", str(err)
        else:
            raise AssertionError("construction with a failing cuCtxSetCurrent")
        assert STUB.stub_primary_refs() == 0
        D.cuCtxSetCurrent = real
        gpu = CudaBackend()
        gpu.alloc(1024)
        errors = []

        def closer():
            D.cuCtxSetCurrent = lambda ctx: (D.CUresult(201),)
            try:
                gpu.close()
            except CudaError as err:
                errors.append(err.call)
            finally:
                D.cuCtxSetCurrent = real

        thread = threading.Thread(target=closer)
        thread.start()
        thread.join()
        assert errors == ["cuCtxSetCurrent"], errors
        assert gpu.closed and STUB.stub_primary_refs() == 0
    ''')


def test_context_made_current_on_each_calling_thread(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            before = calls("cuCtxSetCurrent")
            gpu.free(gpu.alloc(8))
            assert calls("cuCtxSetCurrent") == before, "the constructing thread is already current"
            results = []
            def worker():
                ptr = gpu.alloc(16)  # the stub refuses this without a current context
                gpu.free(ptr)
                results.append(int(ptr))
            t = threading.Thread(target=worker)
            t.start(); t.join()
            assert len(results) == 1
            assert calls("cuCtxSetCurrent") == before + 1
    ''')


def test_cuda_marked_suite_runs_over_the_stub(stub_env):
    """Every cuda-marked test of the suite (the cache, tokens, sequence and diagnostics
    tests re-run through the `gpu` fixture, and test_cuda_gpu.py), with the stub standing
    in for the GPU and every kernel executing on the CPU through the kernel harness (CTAs
    in a seeded random order), each result compared against HostBackend by the tests
    themselves. Proves their Python and the kernels' results; not the GPU's memory model,
    concurrency between CTAs or timing."""
    env = dict(stub_env, PAGEDKV_HARNESS_ORDER="random:20261201")
    run_on_stub(env, '''
        STUB.stub_set_total_mem(ctypes.c_size_t(4 << 30))
        import pagedkv.driver
        pagedkv.driver.is_available = lambda: True
        import pytest
        code = pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", "-m", "cuda", %r])
        assert code == 0, code
    ''' % str(Path(__file__).resolve().parents[1]))


def test_gpu_benchmark_runs_over_the_stub(stub_env):
    """tools/bench_gpu.py end to end at a reduced size over the stub: every line prints.
    The figures are the stub's (host memcpy), so the floors are not judged here."""
    out = run_on_stub(stub_env, '''
        STUB.stub_set_total_mem(ctypes.c_size_t(1 << 30))
        import argparse
        import pagedkv.driver
        pagedkv.driver.is_available = lambda: True
        sys.path.insert(0, %r)
        import bench_gpu
        bench_gpu.GIB, bench_gpu.FILL_BLOCKS, bench_gpu.COPY_PAIRS = 32 << 20, 4, 4
        try:
            bench_gpu.run(argparse.Namespace(quick=True))
        except SystemExit as stop:
            assert stop.code == 1
        assert STUB.stub_live_allocations() == 0 and STUB.stub_live_host_allocations() == 0
        assert STUB.stub_live_streams() == 0 and STUB.stub_live_events() == 0
    ''' % str(REPO_ROOT / "tools"))
    for line in (
        "copy ceiling: one 0.03125 GiB cuMemcpyDtoD",
        "per-block cuMemsetD8Async loop",
        "batched fill kernel",
        "kernel / loop",
        "copy 4 block pairs",
        "checksum of 0.03125 GiB BF16",
        "per-layer probe, 128 reductions of 4 blocks",
        "as a fraction of the copy ceiling:",
        "host I/O, 8 blocks x 64 layers x K,V of 32 KiB:",
        "write_block from pageable",
        "write_block from pinned",
        "read_block into pageable",
        "read_block into pinned (copy_d2h)",
    ):
        assert line in out, line
    assert "DRAM (read + write: 0.0625 GiB moved)" in out
    assert "GB/s DRAM (read + write)" in out
    for line in (
        "floor   batched fill vs per-layer memset loop at 4 blocks:",
        "needs >= 50x",
        "floor   fill vs measured DRAM bandwidth:",
        "needs >= 0.8x",
        "floor   copy vs measured DRAM bandwidth:",
        "floor   checksum vs measured DRAM bandwidth:",
        "needs >= 0.75x",
    ):
        assert line in out, (line, out)


def test_demo_and_plan_choose_the_cuda_backend_over_the_stub(stub_env):
    """`pagedkv demo` and `pagedkv plan` take the CUDA path when a GPU is reported: the
    demo's checks pass on CudaBackend and free everything; plan sizes from cuMemGetInfo."""
    out = run_on_stub(stub_env, '''
        STUB.stub_set_total_mem(ctypes.c_size_t(8 << 30))
        import pagedkv.driver
        pagedkv.driver.is_available = lambda: True
        from pagedkv.cli import main
        assert main(["demo", "--layers", "2", "--blocks", "16"]) == 0
        assert STUB.stub_live_allocations() == 0 and STUB.stub_primary_refs() == 0
        free_bytes = pagedkv.driver.CudaBackend().mem_info()[0]
        assert main(["plan", "--layers", "2", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16"]) == 0
        print("FREE", free_bytes)
    ''')
    assert "pagedkv demo on CudaBackend on pagedkv stub device 0" in out
    assert "demo: 10 passed, 0 failed" in out
    assert "[ok]   host tier: a prompt's 4 blocks evicted to the host tier" in out
    free_bytes = int(out.split("FREE ")[1].split()[0])
    assert f"memory {free_bytes / 2**30:.2f} GiB" in out
    bf16_row = next(line for line in out.splitlines() if line.startswith("bf16 "))
    assert bf16_row.split()[4] == f"{free_bytes // (2 * 2 * 8 * 128 * 2 * 16):,}"


def test_async_work_runs_only_when_waited_for(stub_env):
    """The stub queues async work per stream and runs it when the host waits, with the
    legacy default stream syncing with blocking streams and not with non-blocking ones, so
    a read without the right wait sees stale data, as it may on a GPU."""
    run_on_stub(stub_env, '''
        from cuda.bindings import driver as D
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            dev = gpu.alloc(64)
            gpu.copy_h2d(np.full(64, 1, np.uint8), dev)
            s1, s2 = gpu.create_stream(), gpu.create_stream()
            with gpu.alloc_pinned(64) as pin:
                pin.array[:] = 0
                gpu.copy_d2h_async(dev, pin, s1)
                assert (pin.array == 0).all(), "nothing ran yet: the host has not waited"
                assert STUB.stub_pending_work() == 1
                gpu.synchronize(s1)
                assert (pin.array == 1).all() and STUB.stub_pending_work() == 0
                # a blocking stream's work runs before a later synchronous (legacy) copy
                gpu.memset_async(dev, 2, 64, s1)
                out = np.zeros(64, np.uint8)
                gpu.copy_d2h(dev, out)
                assert (out == 2).all()
                # a stream waiting on an event recorded on another runs that stream's work first
                gpu.memset_async(dev, 3, 32, s1)
                event = D.cuEventCreate(2)[1]
                assert D.cuEventRecord(event, D.CUstream(s1))[0] == 0
                assert D.cuEventQuery(event)[0] == D.CUresult.CUDA_ERROR_NOT_READY
                assert D.cuStreamWaitEvent(D.CUstream(s2), event, 0)[0] == 0
                gpu.copy_d2h_async(dev, pin, s2)
                gpu.synchronize(s2)
                assert pin.array[:32].tolist() == [3] * 32 and pin.array[32:].tolist() == [2] * 32
                assert D.cuEventQuery(event)[0] == 0
                assert D.cuEventDestroy(event)[0] == 0
                # a non-blocking stream is not waited for by the legacy stream
                err, nb = D.cuStreamCreate(1)
                assert err == 0
                assert D.cuMemsetD8Async(int(dev), 4, 64, nb)[0] == 0
                gpu.copy_d2h(dev, out)
                assert (out == 2).sum() == 32 and (out == 3).sum() == 32, "the legacy copy did not wait for it"
                assert D.cuStreamSynchronize(nb)[0] == 0
                gpu.copy_d2h(dev, out)
                assert (out == 4).all()
                assert D.cuStreamDestroy(nb)[0] == 0
            gpu.destroy_stream(s1)
            gpu.destroy_stream(s2)
            gpu.free(dev)
    ''')


def test_a_missing_wait_in_the_backend_shows_as_wrong_data(stub_env):
    """reduce_bf16_blocks reads its result from pinned memory after cuEventSynchronize;
    without that wait the copy of the result has not run and the numbers are wrong."""
    run_on_stub(stub_env, '''
        from cuda.bindings import driver as D
        from pagedkv.driver import CudaBackend
        import ml_dtypes
        with CudaBackend() as gpu:
            values = np.arange(1, 2049, dtype=np.float32).astype(ml_dtypes.bfloat16)
            g = gpu.alloc(values.nbytes)
            gpu.copy_h2d(values.view(np.uint8), g)
            regions = gpu.create_block_regions([(int(g), 4096, 4096)])
            right = gpu.reduce_bf16_blocks(regions, 0, [0], 0)
            assert right.sum == float(values.astype(np.float64).sum()), right
            real = D.cuEventSynchronize
            D.cuEventSynchronize = lambda event: (D.CUresult(0),)  # the planted bug: no wait
            try:
                wrong = gpu.reduce_bf16_blocks(regions, 0, [0], 0)
            finally:
                D.cuEventSynchronize = real
            assert STUB.stub_pending_work() > 0, "the reduction is still queued"
            assert tuple(wrong) != tuple(right), wrong
            assert gpu.reduce_bf16_blocks(regions, 0, [0], 0) == right
            gpu.destroy_block_regions(regions)
            gpu.free(g)
    ''')


def test_per_thread_default_stream_entry_points(stub_env):
    """With cuda-python's per-thread default stream, stream 0 is this thread's stream and a
    plain synchronous driver copy waits only for it (and the legacy stream), not for other
    streams; CudaBackend's synchronous copies are ordered on the legacy stream explicitly,
    so they still wait for every blocking stream's earlier work."""
    env = dict(stub_env, CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM="1")
    run_on_stub(env, '''
        from cuda.bindings import driver as D
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            dev = gpu.alloc(64)
            gpu.copy_h2d(np.full(64, 1, np.uint8), dev)
            s1 = gpu.create_stream()
            gpu.memset_async(dev, 2, 64, s1)
            out = np.zeros(64, np.uint8)
            (status,) = D.cuMemcpyDtoH(out.ctypes.data, int(dev), 64)
            assert int(status) == 0
            assert (out == 1).all(), "under per-thread default streams a plain sync copy does not wait for s1"
            gpu.copy_d2h(dev, out)
            assert (out == 2).all(), "CudaBackend's sync copy waits for s1 all the same"
            gpu.synchronize(s1)
            gpu.memset_async(dev, 5, 64, 0)  # stream 0 is the per-thread stream: the sync copy waits for it
            gpu.copy_d2h(dev, out)
            assert (out == 5).all()
            gpu.destroy_stream(s1)
            gpu.free(dev)
    ''')


def test_a_kernel_fault_is_sticky_until_the_context_is_released(stub_env):
    """A fault in queued work (the reduction launched on an odd base: misaligned 2-byte
    loads) fails the wait that ran it with CUDA_ERROR_MISALIGNED_ADDRESS and every later
    call, as a GPU context error does; the primary context's last release resets it."""
    run_on_stub(stub_env, '''
        STUB.stub_fault_message.restype = ctypes.c_char_p
        from cuda.bindings import driver as D
        from pagedkv.driver import CudaBackend, CudaError, backend
        gpu = CudaBackend()
        g, idx, partials = gpu.alloc(8192), gpu.alloc(4), gpu.alloc(24)
        gpu.copy_h2d(np.zeros(1, np.int32), idx)
        module, function = raw_kernel("reduce_bf16.cu", "pagedkv_reduce_bf16_partial")
        assert raw_launch(function, 1, getattr(backend, "THREADS", 256), 0, ctypes.c_int64(int(g) + 1),
                          ctypes.c_int64(4096), ctypes.c_int64(4094), ctypes.c_uint64(int(idx)), ctypes.c_int32(1),
                          ctypes.c_uint64(int(partials))) == 0
        assert STUB.stub_sticky_status() == 0, "the launch is queued, not run"
        try:
            gpu.synchronize(0)
        except CudaError as err:
            assert err.status == 716 and err.status_name == "CUDA_ERROR_MISALIGNED_ADDRESS", err
        else:
            raise AssertionError("a misaligned load must fail the launch")
        message = STUB.stub_fault_message().decode()
        assert "pagedkv_reduce_bf16_partial" in message and "misaligned" in message and "2-byte" in message, message
        try:
            gpu.alloc(16)
        except CudaError as err:
            assert err.status == 716, err
        else:
            raise AssertionError("the fault must be sticky")
        try:
            gpu.close()
        except CudaError:
            pass
        assert STUB.stub_primary_refs() == 0 and STUB.stub_sticky_status() == 0
        assert STUB.stub_live_allocations() == 0
        with CudaBackend() as again:
            again.free(again.alloc(16))
    ''')


def test_a_kernel_running_past_an_allocation_is_an_illegal_address(stub_env):
    """Stub allocations have an inaccessible page on each side, so a kernel that runs past
    one (a fill row longer than its allocation, launched around CudaBackend's checks)
    fails with CUDA_ERROR_ILLEGAL_ADDRESS instead of writing into the host."""
    run_on_stub(stub_env, '''
        STUB.stub_fault_message.restype = ctypes.c_char_p
        from pagedkv.driver import CudaBackend, CudaError, backend
        gpu = CudaBackend()
        pool, table, idx = gpu.alloc(1000), gpu.alloc(24), gpu.alloc(4)
        gpu.copy_h2d(np.array([int(pool), 1000, 1000 + 8192], np.int64), table)
        gpu.copy_h2d(np.zeros(1, np.int32), idx)
        module, function = raw_kernel("fill_blocks.cu", "pagedkv_fill_blocks")
        assert raw_launch(function, 1, getattr(backend, "THREADS", 256), 0, ctypes.c_uint64(int(table)),
                          ctypes.c_int32(1), ctypes.c_uint64(int(idx)), ctypes.c_int32(1), ctypes.c_uint32(7)) == 0
        try:
            gpu.synchronize(0)
        except CudaError as err:
            assert err.status == 700 and err.status_name == "CUDA_ERROR_ILLEGAL_ADDRESS", err
        else:
            raise AssertionError("writing 8 KiB past an allocation must fault")
        message = STUB.stub_fault_message().decode()
        assert "pagedkv_fill_blocks" in message and "illegal memory access at address" in message, message
        try:
            gpu.close()
        except CudaError:
            pass
        assert STUB.stub_primary_refs() == 0 and STUB.stub_sticky_status() == 0
    ''')


def test_bad_harness_settings_are_refused_with_their_value(stub_env, tmp_path):
    """A CTA order, SM count or kernel library the stub cannot use is refused, naming it."""
    out = run_on_stub(dict(stub_env, PAGEDKV_HARNESS_ORDER="sideways"), '''
        STUB.stub_fault_message.restype = ctypes.c_char_p
        from pagedkv.driver import CudaBackend, CudaError
        with CudaBackend() as gpu:
            regions = gpu.create_block_regions([(int(gpu.alloc(64)), 64, 64)])
            try:
                gpu.fill_blocks(regions, [0], 1, 0)
            except CudaError as err:
                assert err.status == 1 and err.call == "cuLaunchKernel", err
            else:
                raise AssertionError("an unknown CTA order must be refused")
            assert STUB.stub_fault_message() == b"PAGEDKV_HARNESS_ORDER=sideways is not ascending, descending or random:SEED"
        print("refused")
    ''')
    assert "refused" in out
    run_on_stub(dict(stub_env, PAGEDKV_STUB_SMS="two"), '''
        from pagedkv.driver import CudaBackend, CudaError
        try:
            CudaBackend()
        except CudaError as err:
            assert err.call == "cuDeviceGetAttribute" and err.status == 1, err
        else:
            raise AssertionError("PAGEDKV_STUB_SMS=two must be refused")
    ''')
    missing = tmp_path / "libmissing.so"
    run_on_stub(dict(stub_env, PAGEDKV_HARNESS_LIBS=str(missing)), f'''
        STUB.stub_harness_error.restype = ctypes.c_char_p
        from pagedkv.driver import CudaBackend, CudaError
        try:
            CudaBackend()
        except CudaError as err:
            assert err.call == "cuModuleGetFunction" and err.status == 500, err
        else:
            raise AssertionError("no kernels without their library")
        assert {str(missing)!r}.encode() in STUB.stub_harness_error(), STUB.stub_harness_error()
    ''')
