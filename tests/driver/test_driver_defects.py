"""CudaBackend defects found by reading the driver (issue 9), each proved over the libcuda
stub (tests/stub_libcuda) with the kernel harness: the stub checks contexts, handles and
address ranges, queues work per stream, and runs the real kernel sources on the CPU (no
memory model, no concurrency between CTAs, no timing: see tests/kernel_harness).
"""

from __future__ import annotations

from kernel_harness.stub import REPO_ROOT, run_on_stub


def test_another_library_switching_context_does_not_redirect_calls(stub_env):
    """`_enter` used to remember per thread that its context was current; after another
    library changed the thread's context, calls went to that context (here: none)."""
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            gpu.free(gpu.alloc(8))
            before = calls("cuCtxSetCurrent")
            assert STUB.cuCtxSetCurrent(ctypes.c_void_p(0)) == 0  # another library, same thread
            gpu.free(gpu.alloc(16))  # the stub refuses alloc without the primary context current
            assert calls("cuCtxSetCurrent") == before + 2, "made current again, once"
            gpu.free(gpu.alloc(16))
            assert calls("cuCtxSetCurrent") == before + 2, "no switch while it stays current"
    ''')


def test_reduction_refuses_odd_base_and_stride(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            g = gpu.alloc(1 << 16)
            before = STUB.stub_launch_count()
            for rows, words in (
                ([(int(g) + 1, 4096, 4096)], "odd base address"),
                ([(int(g), 4097, 4096)], "odd block stride 4097"),
                ([(int(g), 4096, 4095)], "odd block size 4095"),
            ):
                regions = gpu.create_block_regions(rows)
                try:
                    gpu.reduce_bf16_blocks(regions, 0, [0, 1], 0)
                except ValueError as err:
                    assert words in str(err), err
                else:
                    raise AssertionError(words)
                gpu.destroy_block_regions(regions)
            assert STUB.stub_launch_count() == before, "nothing launched"
            gpu.free(g)
    ''')


def test_reduction_checks_blocks_against_its_own_row(stub_env):
    """A reduction reads one row: a block that fits that row is accepted even when
    another row of the table is smaller, and one past it is refused naming the row."""
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        from pagedkv import HostBackend
        with CudaBackend() as gpu:
            small, large = gpu.alloc(2 * 256), gpu.alloc(16 * 256)
            data = np.arange(16 * 128, dtype=np.uint16) & 0x3FFF
            gpu.copy_h2d(data, large)
            regions = gpu.create_block_regions([(int(small), 256, 256), (int(large), 256, 256)])
            got = gpu.reduce_bf16_blocks(regions, 1, [15, 9], 0)
            host = HostBackend(1 << 20)
            h = host.alloc(16 * 256)
            host.copy_h2d(data, h)
            assert got == host.reduce_bf16_blocks(host.create_block_regions([(int(h), 256, 256)]), 0, [15, 9], 0)
            for row, block in ((1, 16), (0, 2)):
                try:
                    gpu.reduce_bf16_blocks(regions, row, [block], 0)
                except IndexError as err:
                    assert f"block {block} out of range: region {row} holds" in str(err), err
                else:
                    raise AssertionError((row, block))
            try:
                gpu.fill_blocks(regions, [2], 0, 0)  # fill touches every row: row 0 bounds it
            except IndexError as err:
                assert "region 0 holds 2 blocks" in str(err), err
            else:
                raise AssertionError("fill past the small row")
    ''')


def test_checksums_are_exact_and_identical_on_every_grid(stub_env):
    """Adversarial BF16 data (huge values cancelling, every subnormal, random bits) gives
    the same exact result as HostBackend and math.fsum at 2 and 132 SMs and several
    occupancies, i.e. several grids."""
    run_on_stub(stub_env, '''
        import math
        import ml_dtypes
        from pagedkv.driver import CudaBackend
        rng = np.random.default_rng(9)
        bits = rng.integers(0, 1 << 16, size=64 * 512, dtype=np.uint16)
        bits[((bits >> 7) & 0xFF) == 0xFF] = 0x0001
        bits[:2], bits[512:514] = (0x7F7F, 0xFF7F), (0xFF7F, 0x7F7F)
        bits[1024:1151] = np.arange(1, 128)
        blocks = rng.permutation(64).tolist()
        x = np.concatenate([bits[512 * b : 512 * (b + 1)] for b in blocks]).view(ml_dtypes.bfloat16).astype(np.float64)
        want = (math.fsum(x.tolist()), math.fsum((x * x).tolist()), math.fsum(np.abs(x).tolist()))
        seen = set()
        for sms, occupancy in ((2, 1), (2, 8), (132, 8), (3, 5), (7, 3)):
            STUB.stub_set_device(sms, 9, 0)
            STUB.stub_set_occupancy(occupancy)
            with CudaBackend() as gpu:
                g = gpu.alloc(bits.nbytes)
                gpu.copy_h2d(bits, g)
                regions = gpu.create_block_regions([(int(g), 1024, 1024)])
                got = gpu.reduce_bf16_blocks(regions, 0, blocks, 0)
                rec, pp = launch(-2)
                seen.add(rec.grid[0])
                assert rec.grid[0] == min(len(blocks), sms * occupancy)
                assert tuple(got) == want, (sms, occupancy, got, want)
        assert len(seen) == 5, seen
    ''')


def test_non_finite_checksums_match_the_host(stub_env):
    run_on_stub(stub_env, '''
        import math
        from pagedkv.driver import CudaBackend
        from pagedkv import HostBackend
        host = HostBackend(1 << 20)
        with CudaBackend() as gpu:
            for specials in ([0x7FC1], [0x7F80], [0xFF80], [0x7F80, 0xFF80]):
                bits = np.full(256, 0x3F80, np.uint16)
                bits[100 : 100 + len(specials)] = specials
                g, h = gpu.alloc(bits.nbytes), host.alloc(bits.nbytes)
                gpu.copy_h2d(bits, g)
                host.copy_h2d(bits, h)
                got = gpu.reduce_bf16_blocks(gpu.create_block_regions([(int(g), 128, 128)]), 0, [0, 1, 2, 3], 0)
                want = host.reduce_bf16_blocks(host.create_block_regions([(int(h), 128, 128)]), 0, [0, 1, 2, 3], 0)
                assert [repr(v) for v in got] == [repr(v) for v in want], (specials, got, want)
            assert repr(tuple(want)) == "(nan, inf, inf)"
    ''')


def test_grids_come_from_the_reported_occupancy(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        STUB.stub_set_device(5, 9, 0)
        STUB.stub_set_occupancy(3)
        with CudaBackend() as gpu:
            assert calls("cuOccupancyMaxActiveBlocksPerMultiprocessor") == 18, "one query per kernel"
            g = gpu.alloc(64 * 512)
            regions = gpu.create_block_regions([(int(g), 512, 512)])
            gpu.fill_blocks(regions, list(range(40)), 0, 0)
            assert launch(-1)[0].grid[0] == 15
            gpu.copy_blocks(regions, list(range(20)), list(range(20, 40)), 0)
            assert launch(-1)[0].grid[0] == 15
            gpu.reduce_bf16_blocks(regions, 0, list(range(64)), 0)
            assert launch(-2)[0].grid[0] == 15 and launch(-1)[0].grid[0] == 1
            assert gpu.max_grid("pagedkv_fill_blocks") == 15
    ''')


def test_close_takes_the_lock(stub_env):
    """close() used not to take the backend's lock, so it could free staging buffers that
    another thread, inside a launch, was filling. Here a thread holds the lock (as a launch
    does); close() from another thread waits for it."""
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        gpu = CudaBackend()
        gpu._lock.acquire()
        closer = threading.Thread(target=gpu.close)
        closer.start()
        closer.join(timeout=1.0)
        assert closer.is_alive() and not gpu.closed, "close() ran while another thread held the lock"
        gpu._lock.release()
        closer.join()
        assert gpu.closed and STUB.stub_primary_refs() == 0
    ''')


def test_reduction_waits_for_its_event_without_the_lock(stub_env):
    """The reduction's wait for its result must not hold the backend-wide lock (every other
    thread's calls would queue behind one GPU wait)."""
    run_on_stub(stub_env, '''
        from cuda.bindings import driver
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            g = gpu.alloc(8 * 512)
            regions = gpu.create_block_regions([(int(g), 512, 512)])
            real = driver.cuEventSynchronize
            owned = []
            def spy(event):
                owned.append(gpu._lock._is_owned())
                return real(event)
            driver.cuEventSynchronize = spy
            try:
                gpu.reduce_bf16_blocks(regions, 0, [0, 1, 2], 0)
            finally:
                driver.cuEventSynchronize = real
            assert owned == [False], owned
            assert gpu._staging.held() == 0
    ''')


def test_synchronize_all_waits_for_every_stream(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            s1, s2 = gpu.create_stream(), gpu.create_stream()
            before = calls("cuStreamSynchronize")
            gpu.synchronize_all()
            assert calls("cuStreamSynchronize") == before + 3, "two streams and the legacy default stream"
            gpu.destroy_stream(s1)
            gpu.synchronize_all()
            assert calls("cuStreamSynchronize") == before + 5
    ''')


def test_synchronous_copies_are_ordered_on_the_legacy_stream(stub_env):
    """With CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1 cuda-bindings calls the per-thread
    variants, and the plain synchronous copies no longer wait for the blocking streams'
    work; so copy_h2d/copy_d2h queue on CU_STREAM_LEGACY explicitly and wait for it."""
    env = dict(stub_env, CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM="1")
    run_on_stub(env, '''
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            g = gpu.alloc(64)
            data = np.arange(64, dtype=np.uint8)
            sync, h2d, d2h = calls("cuStreamSynchronize"), calls("cuMemcpyHtoDAsync"), calls("cuMemcpyDtoHAsync")
            gpu.copy_h2d(data, g)
            out = np.zeros(64, np.uint8)
            gpu.copy_d2h(g, out)
            assert np.array_equal(out, data)
            assert calls("cuMemcpyHtoD") == 0 and calls("cuMemcpyDtoH") == 0, "no null-stream copies"
            assert calls("cuMemcpyHtoDAsync") == h2d + 1 and calls("cuMemcpyDtoHAsync") == d2h + 1
            assert calls("cuStreamSynchronize") == sync + 2
    ''')


def test_modules_keep_their_cubin_alive(stub_env):
    run_on_stub(stub_env, '''
        import gc
        from pagedkv.driver import CudaBackend
        with CudaBackend() as gpu:
            gc.collect()
            names = sorted(m.filename for m in gpu._modules)
            assert names == ["copy_batch.cu", "copy_blocks.cu", "fill_blocks.cu", "kv_rows.cu", "reduce_bf16.cu"], names
            for m in gpu._modules:
                assert isinstance(m.cubin, bytes) and m.cubin[:4] == b"\\x7fELF"
                assert sys.getrefcount(m.cubin) >= 2
    ''')


def test_gpu_bench_counts_copy_traffic_as_read_plus_write():
    """The copy ceiling used to count 1 GiB for the 2 GiB a 1 GiB copy moves, so the fill
    and checksum floors passed at about 35% of bandwidth. Now the ceiling and the copy count
    read + write, and each kernel has its floor against the measured bandwidth (fill 0.8,
    copy and checksum 0.75); the lines that print them are checked by test_driver_stub's
    one run of the bench over the stub."""
    import sys

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(REPO_ROOT / "tools"))
    assert bench_gpu.copy_traffic(1 << 30) == 2 << 30
    assert bench_gpu.FLOORS_OF_BANDWIDTH == {"fill": 0.80, "copy": 0.75, "checksum": 0.75}
    assert bench_gpu.FILL_RATIO_FLOOR == 50.0 and bench_gpu.FILL_BLOCKS == 256



def test_reduction_at_another_block_size_is_exact_and_never_traps(stub_env):
    """The reductions loop by blockDim.x (issue 19: no kernel traps, a trap kills every
    library's context): a 128-thread launch of the 256-thread reduction gives the same exact
    result, and the backend stays usable."""
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        from pagedkv.driver import nvrtc
        gpu = CudaBackend()
        assert gpu._launchers["pagedkv_reduce_bf16_partial"].threads == nvrtc.REDUCE_THREADS == 256
        g = gpu.alloc(4 * 512)
        gpu.copy_h2d(np.arange(1024, dtype=np.uint16), g)
        regions = gpu.create_block_regions([(int(g), 512, 512)])
        want = gpu.reduce_bf16_blocks(regions, 0, [0, 1], 0)
        gpu._launchers["pagedkv_reduce_bf16_partial"].threads = 128
        assert tuple(gpu.reduce_bf16_blocks(regions, 0, [0, 1], 0)) == tuple(want)
        gpu.close()
        assert gpu.closed and STUB.stub_primary_refs() == 0
    ''')
