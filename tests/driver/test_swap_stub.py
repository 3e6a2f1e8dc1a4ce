"""CudaBackend's host-tier calls over the libcuda stub: swap memory, copy_batch_async on
both paths (cuMemcpyBatchAsync in either ABI, and the copy kernel run by the harness),
events, ordering across streams, and bad input refused with nothing enqueued.

What this proves: the Python side and the kernel's bytes on the CPU (see
tests/kernel_harness/README.md for what the harness is not: no memory model, no
concurrency between CTAs, no timing). The copies of mapped host memory by a real GPU
over PCIe are not exercised here.
"""

from __future__ import annotations

import textwrap

from kernel_harness.stub import REPO_ROOT, run_on_stub
from kernel_harness.swap_checks import copy_batch_body


def test_kernel_path_is_byte_exact_in_two_cta_orders(stub_env):
    assert "CHECK copy_batch ok" in run_on_stub(stub_env, copy_batch_body(2, "kernel"), timeout=300)


def test_driver_path_is_byte_exact(stub_env):
    assert "CHECK copy_batch ok" in run_on_stub(stub_env, copy_batch_body(2, "driver", orders=("ascending",)))


_SETUP = '''
from pagedkv.driver import CudaBackend, CudaError, CudaOutOfMemory
from pagedkv.errors import DeviceOutOfMemory

class Attr(ctypes.Structure):
    _fields_ = [("order", ctypes.c_int), ("src_type", ctypes.c_int), ("src_id", ctypes.c_int),
                ("dst_type", ctypes.c_int), ("dst_id", ctypes.c_int), ("flags", ctypes.c_uint)]

def attrs():
    """The attributes of the last batch the stub accepted: [(first copy, order, src type, dst type, flags)]."""
    out, first = [], ctypes.c_size_t()
    a = Attr()
    n = STUB.stub_batch_attr(0, ctypes.byref(a), ctypes.byref(first))
    for i in range(max(n, 0)):
        STUB.stub_batch_attr(i, ctypes.byref(a), ctypes.byref(first))
        out.append((first.value, a.order, a.src_type, a.dst_type, a.flags))
    return out

def copies():
    return calls("cuLaunchKernel"), calls("cuMemcpyBatchAsync")
'''


def _run(env: dict, body: str) -> str:
    """run_on_stub of _SETUP followed by `body` (dedented)."""
    return run_on_stub(env, _SETUP + textwrap.dedent(body))


def test_abi_versions_and_fallbacks(stub_env):
    """A 13.x driver is asked for the CUDA 13 ABI, a 12.8 driver for the 12.8 ABI (its
    failIdx argument before the stream: a prototype of the wrong ABI would hand the stub a
    wrong stream), an older driver or a missing symbol leaves the copy kernel."""
    out = _run(stub_env, '''
        STUB.stub_set_device(2, 9, 0)
        for version, abi in ((13000, 13000), (12090, 12080), (12080, 12080), (12060, None)):
            STUB.stub_set_driver_version(version)
            with CudaBackend() as gpu:
                assert (gpu._memcpy_batch.abi if gpu._memcpy_batch else None) == abi, (version, gpu._memcpy_batch)
                assert gpu.copy_batch_path == ("kernel" if abi is None else "driver")
                stream = gpu.create_stream()
                dev, swap = gpu.alloc(4096), gpu.alloc_swap_memory(4096)
                swap.array[:] = np.arange(4096) % 251
                before = copies()
                gpu.copy_batch_async([int(dev) + 1, int(dev) + 2000], [swap.address + 3, swap.address + 100], [1000, 77], stream)
                after = copies()
                assert (after[0] - before[0], after[1] - before[1]) == ((1, 0) if abi is None else (0, 1))
                got = np.empty(4096, np.uint8)
                gpu.synchronize(stream)
                gpu.copy_d2h(dev, got)
                assert np.array_equal(got[1:1001], swap.array[3:1003]) and np.array_equal(got[2000:2077], swap.array[100:177])
                gpu.free(dev)
                swap.free()
                gpu.destroy_stream(stream)
        STUB.stub_set_driver_version(13000)
        print("ABI ok")
    ''')
    assert "ABI ok" in out


def test_symbol_reported_missing_leaves_the_kernel(stub_env):
    env = dict(stub_env, PAGEDKV_STUB_NO_BATCH_MEMCPY="1")
    out = _run(env, '''
        with CudaBackend() as gpu:
            assert gpu.copy_batch_path == "kernel"
            assert calls("cuGetProcAddress") > 0
            stream = gpu.create_stream()
            dev = gpu.alloc(512)
            swap = gpu.alloc_swap_memory(512)
            gpu.copy_h2d(np.full(512, 9, np.uint8), dev)
            before = copies()
            gpu.copy_batch_async([swap.address], [int(dev)], [512], stream)
            assert copies() == (before[0] + 1, before[1])
            gpu.synchronize(stream)
            assert (swap.array == 9).all()
        print("missing ok")
    ''')
    assert "missing ok" in out


def test_kernel_forced_by_argument_or_environment(stub_env):
    env = dict(stub_env, PAGEDKV_COPY_BATCH="kernel")
    _run(env, '''
        with CudaBackend() as gpu:
            assert gpu.copy_batch_path == "kernel"
        with CudaBackend(copy_batch="auto") as gpu:
            assert gpu.copy_batch_path == "driver"
        import os
        os.environ["PAGEDKV_COPY_BATCH"] = "fast"
        try:
            CudaBackend()
        except ValueError as err:
            assert "PAGEDKV_COPY_BATCH='fast'" in str(err), err
        else:
            raise AssertionError("a bad PAGEDKV_COPY_BATCH was accepted")
        try:
            CudaBackend(copy_batch="driver")
        except ValueError as err:
            assert "copy_batch='driver'" in str(err), err
        else:
            raise AssertionError("a bad copy_batch was accepted")
        assert STUB.stub_primary_refs() == 0
    ''')


def test_one_driver_call_however_many_ranges(stub_env):
    _run(stub_env, '''
        for mode, want in (("auto", (0, 1)), ("kernel", (1, 0))):
            with CudaBackend(copy_batch=mode) as gpu:
                stream = gpu.create_stream()
                dev = gpu.alloc(1 << 20)
                swap = gpu.alloc_swap_memory(1 << 20)
                rng = np.random.default_rng(4)
                data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
                gpu.copy_h2d(data, dev)
                for n in (1, 64, 512):
                    size = (1 << 20) // n
                    before = copies()
                    pending = STUB.stub_pending_work()
                    # swap out: one range per block, blocks reversed, every call counted
                    srcs = [int(dev) + k * size for k in range(n)]
                    dsts = [swap.address + (n - 1 - k) * size for k in range(n)]
                    gpu.copy_batch_async(np.array(dsts, np.uint64), np.array(srcs, np.int64), [size] * n, stream)
                    after = copies()
                    assert (after[0] - before[0], after[1] - before[1]) == want, (mode, n, before, after)
                    if mode == "auto":
                        assert STUB.stub_pending_work() == pending + n, "the stub queues one copy per range"
                    gpu.synchronize(stream)
                    for k in (0, n - 1):
                        assert np.array_equal(swap.array[(n - 1 - k) * size:(n - k) * size], data[k * size:(k + 1) * size])
                gpu.free(dev)
                swap.free()
                gpu.destroy_stream(stream)
    ''')


def test_batch_attributes_are_stream_ordered_with_location_hints(stub_env):
    _run(stub_env, '''
        STUB.stub_batch_attr.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        with CudaBackend() as gpu:
            stream = gpu.create_stream()
            dev = gpu.alloc(1 << 16)
            swap = gpu.alloc_swap_memory(1 << 16)
            D, H = int(dev), swap.address
            gpu.copy_batch_async([H, H + 100], [D, D + 100], [50, 50], stream)
            assert attrs() == [(0, 1, 1, 2, 0)], attrs()  # STREAM order, device -> host
            # runs of alike copies share one attribute: h->d, h->d, d->d, h->h, d->h
            gpu.copy_batch_async([D + 1000, D + 2000, D + 3000, H + 4000, H + 5000],
                                 [H + 10000, H + 11000, D + 12000, H + 13000, D + 14000], [10] * 5, stream)
            assert attrs() == [(0, 1, 2, 1, 0), (2, 1, 1, 1, 0), (3, 1, 2, 2, 0), (4, 1, 1, 2, 0)], attrs()
            gpu.synchronize(stream)
            gpu.free(dev)
            swap.free()
            gpu.destroy_stream(stream)
    ''')


def test_legacy_default_stream_takes_the_kernel(stub_env):
    """cuMemcpyBatchAsync refuses the legacy NULL stream (the stub does as the driver), so
    stream 0 takes the copy kernel: still one driver call, ordered after earlier legacy work."""
    _run(stub_env, '''
        with CudaBackend() as gpu:
            assert gpu.copy_batch_path == "driver"
            dev = gpu.alloc(4096)
            swap = gpu.alloc_swap_memory(4096)
            swap.array[:] = 0
            gpu.memset_async(dev, 0x5A, 4096, 0)
            before = copies()
            gpu.copy_batch_async([swap.address + 5], [int(dev) + 17], [3000], 0)
            assert copies() == (before[0] + 1, before[1])
            gpu.synchronize(0)
            assert (swap.array[5:3005] == 0x5A).all() and (swap.array[:5] == 0).all() and (swap.array[3005:] == 0).all()
    ''')


def test_copy_behind_a_kernel_on_another_stream_waits_through_an_event(stub_env):
    """A fill kernel on stream A, an event recorded after it, stream B made to wait on it,
    then the batch on B: the host sees the filled bytes. Without the wait the same sequence
    reads stale bytes (the stub runs B's work alone), so the ordering is what is tested."""
    out = _run(stub_env, '''
        for mode in ("auto", "kernel"):
            for wait in (True, False):
                with CudaBackend(copy_batch=mode) as gpu:
                    a, b = gpu.create_stream(), gpu.create_stream()
                    dev = gpu.alloc(8 * 1024)
                    gpu.copy_h2d(np.zeros(8 * 1024, np.uint8), dev)
                    regions = gpu.create_block_regions([(int(dev), 1024, 1024)])
                    swap = gpu.alloc_swap_memory(8 * 1024)
                    swap.array[:] = 1
                    gpu.fill_blocks(regions, [2, 5], 0xC3, a)
                    event = gpu.record_event(a)
                    assert gpu.event_done(event) is False
                    if wait:
                        gpu.stream_wait_event(b, event)
                    gpu.copy_batch_async([swap.address, swap.address + 1024], [int(dev) + 2048, int(dev) + 5120], [1024, 1024], b)
                    gpu.synchronize(b)
                    seen = bool((swap.array[:2048] == 0xC3).all())
                    assert seen == wait, (mode, wait, swap.array[:4])
                    if not wait:
                        assert (swap.array[:2048] == 0).all(), "without the wait the copy ran before the fill"
                    gpu.wait_event(event)
                    assert gpu.event_done(event) is True
                    gpu.destroy_event(event)
                    gpu.destroy_block_regions(regions)
        print("ordering ok")
    ''')
    assert "ordering ok" in out


def test_bad_input_is_refused_with_nothing_enqueued(stub_env):
    _run(stub_env, '''
        for mode in ("auto", "kernel"):
            with CudaBackend(copy_batch=mode) as gpu:
                stream = gpu.create_stream()
                dev = gpu.alloc(4096)
                swap = gpu.alloc_swap_memory(4096)
                big = gpu.alloc_swap_memory(8192)
                gone = gpu.alloc_swap_memory(4096)
                gone_address = gone.address
                gone.free()
                foreign = np.zeros(4096, np.uint8)
                D, H = int(dev), swap.address
                swap.array[:] = 7
                gpu.copy_h2d(np.full(4096, 3, np.uint8), dev)
                gpu.synchronize_all()
                cases = [
                    (IndexError, "range 1: destination 0x%x + 2 bytes" % (D + 4095), [H, D + 4095], [D, H], [16, 2]),
                    (IndexError, "range 0: source 0x%x + 4097 bytes" % D, [big.address], [D], [4097]),
                    (IndexError, "range 2: destination 0x%x" % gone_address, [H, H + 100, gone_address], [D, D, D], [10, 10, 10]),
                    (IndexError, "range 0: source 0x%x" % foreign.ctypes.data, [D], [foreign.ctypes.data], [8]),
                    (ValueError, "destinations of ranges 0 and 2 overlap", [H + 10, H + 200, H + 19], [D, D, D], [10, 10, 10]),
                    (ValueError, "destination of range 1 (", [H, D + 100], [D, D + 50], [10, 60]),
                    (ValueError, "destination of range 0", [D], [D], [1]),
                    (ValueError, "equal lengths: 2 dsts, 1 srcs", [H, H + 8], [D], [4, 4]),
                    (ValueError, "sizes[1] = -4 is negative", [H, H + 8], [D, D], [4, -4]),
                    (TypeError, "must hold ints", [H], [D], [4.0]),
                    (ValueError, "unknown stream 12345", [H], [D], [4]),
                ]
                for kind, text, dsts, srcs, sizes in cases:
                    before, pending = copies(), STUB.stub_pending_work()
                    s = 12345 if "unknown stream" in text else stream
                    try:
                        gpu.copy_batch_async(dsts, srcs, sizes, s)
                    except kind as err:
                        assert text in str(err), (text, str(err))
                    else:
                        raise AssertionError(f"accepted: {text}")
                    assert copies() == before and STUB.stub_pending_work() == pending, (mode, text)
                gpu.synchronize(stream)
                got = np.empty(4096, np.uint8)
                gpu.copy_d2h(dev, got)
                assert (got == 3).all() and (swap.array == 7).all(), "a refused batch changed nothing"
                before = copies()
                gpu.copy_batch_async([], [], [], stream)
                gpu.copy_batch_async([H], [D], [0], stream)  # a range of 0 bytes copies nothing
                assert copies() == before
    ''')


def test_swap_memory_lifecycle(stub_env):
    _run(stub_env, '''
        STUB.stub_host_alloc_flags.argtypes = [ctypes.c_void_p]
        with CudaBackend() as gpu:
            assert gpu.supports("host_tier") is True
            hosts = STUB.stub_live_host_allocations()
            swap = gpu.alloc_swap_memory(10000)
            assert STUB.stub_host_alloc_flags(swap.address) == 3, "PORTABLE | DEVICEMAP"
            assert swap.nbytes == 10000 and swap.array.shape == (10000,) and swap.array.dtype == np.uint8
            assert swap.device_address == swap.address  # the stub's device pointers are host addresses
            assert calls("cuMemHostGetDevicePointer") >= 1
            assert gpu.live_swap_memories() == 1 and not swap.freed
            swap.array[:] = 1
            # usable for the async copies that need page-locked memory too
            dev = gpu.alloc(10000)
            gpu.copy_h2d_async(swap.array, dev, 0)
            gpu.synchronize(0)
            STUB.stub_fail_next(b"cuMemFreeHost", 1)
            try:
                swap.free()
            except CudaError as err:
                assert err.call == "cuMemFreeHost"
            else:
                raise AssertionError("the injected failure was not raised")
            assert not swap.freed and gpu.live_swap_memories() == 1, "kept recorded until its free succeeds"
            swap.free()
            swap.free()
            assert swap.freed and gpu.live_swap_memories() == 0
            assert STUB.stub_live_host_allocations() == hosts
            for bad in (0, -5):
                try:
                    gpu.alloc_swap_memory(bad)
                except ValueError as err:
                    assert "nbytes" in str(err) or str(bad) in str(err), err
                else:
                    raise AssertionError(bad)
            STUB.stub_fail_next(b"cuMemHostAlloc", 2)
            try:
                gpu.alloc_swap_memory(4096)
            except CudaOutOfMemory as err:
                assert isinstance(err, DeviceOutOfMemory) and isinstance(err, MemoryError)
            else:
                raise AssertionError("out of memory not raised")
            STUB.stub_fail_next(b"cuMemHostGetDevicePointer", 1)
            try:
                gpu.alloc_swap_memory(4096)
            except CudaError as err:
                assert err.call == "cuMemHostGetDevicePointer"
            assert STUB.stub_live_host_allocations() == hosts and gpu.live_swap_memories() == 0, "freed on failure"
            left = gpu.alloc_swap_memory(4096)
        assert left.freed and STUB.stub_live_host_allocations() == 0, "close frees swap memory left"
    ''')


def test_events_poll_wait_and_refuse_unknown_handles(stub_env):
    _run(stub_env, '''
        with CudaBackend() as gpu:
            stream = gpu.create_stream()
            dev = gpu.alloc(4096)
            gpu.memset_async(dev, 1, 4096, stream)
            event = gpu.record_event(stream)
            assert isinstance(event, int) and gpu.live_events() == 1
            assert gpu.event_done(event) is False and gpu.event_done(event) is False, "polling never runs the work"
            before = calls("cuEventQuery")
            gpu.event_done(event)
            assert calls("cuEventQuery") == before + 1
            gpu.wait_event(event)
            assert gpu.event_done(event) is True
            gpu.destroy_event(event)
            for call in (gpu.event_done, gpu.wait_event, gpu.destroy_event, lambda e: gpu.stream_wait_event(stream, e)):
                try:
                    call(event)
                except ValueError as err:
                    assert f"unknown event {event!r}" in str(err), err
                else:
                    raise AssertionError("a destroyed event was accepted")
            for bogus in (0, 12345, "x"):
                try:
                    gpu.wait_event(bogus)
                except ValueError as err:
                    assert repr(bogus) in str(err)
                else:
                    raise AssertionError(bogus)
            live = STUB.stub_live_events()
            STUB.stub_fail_next(b"cuEventRecord", 1)
            try:
                gpu.record_event(stream)
            except CudaError as err:
                assert err.call == "cuEventRecord"
            else:
                raise AssertionError("the injected failure was not raised")
            assert STUB.stub_live_events() == live and gpu.live_events() == 0, "a failed record destroys its event"
            gpu.record_event(stream)
            assert STUB.stub_live_events() == live + 1
        assert STUB.stub_live_events() == 0, "close destroys the events left"
    ''')


def test_tier_benchmark_runs_over_the_stub(stub_env):
    """tools/bench_tier.py end to end at a reduced size over the stub, both paths: every
    line prints and everything is freed. The figures are the stub's (host memcpy, the
    kernel run by the harness), so the floors are printed but not judged here."""
    out = run_on_stub(stub_env, '''
        STUB.stub_set_total_mem(ctypes.c_size_t(1 << 30))
        import argparse
        import pagedkv.driver
        pagedkv.driver.is_available = lambda: True
        sys.path.insert(0, %r)
        import bench_tier
        bench_tier.BLOCKS, bench_tier.LAYERS = 4, 2
        assert bench_tier.FLOOR_OF_PINNED == 0.80
        before = calls("cuMemcpyBatchAsync")
        bench_tier.run(argparse.Namespace(quick=True))
        assert calls("cuMemcpyBatchAsync") > before
        assert STUB.stub_live_allocations() == 0 and STUB.stub_live_host_allocations() == 0
        assert STUB.stub_live_streams() == 0 and STUB.stub_live_events() == 0
    ''' % str(REPO_ROOT / "tools"), timeout=300)
    for line in (
        "host tier: 4 blocks x 2 layers x K,V of 32 KiB (0.5 MiB per swap)",
        "driver path (cuMemcpyBatchAsync):",
        "kernel path (pagedkv_copy_batch kernel over mapped memory):",
        "pinned ceiling: one cuMemcpyDtoHAsync",
        "pinned ceiling: one cuMemcpyHtoDAsync",
        "contiguous blocks (4 ranges per swap):",
        "scattered blocks (12 ranges per swap):",
        "swap_out  one copy_batch_async",
        "swap_in   one copy_batch_async",
        "per-block loop swap_out (16 cuMemcpyDtoHAsync)",
        "per-block loop swap_in (16 cuMemcpyHtoDAsync)",
    ):
        assert line in out, (line, out)
    for path in ("driver", "kernel"):
        for direction in ("out", "in"):
            for layout in ("contiguous", "scattered"):
                assert f"floor   {path} swap_{direction} ({layout} blocks) vs pinned copy:" in out, (path, direction, layout)
    assert out.count("needs >= 0.8x") == 8


def test_tier_descriptors_are_one_range_per_layer_side_run():
    import sys

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import bench_tier

    assert bench_tier.block_bytes() == 32 * 1024
    assert bench_tier.layer_side_runs([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 6]) == [(3, 0, 3), (9, 3, 2), (2, 6, 1)]
    assert bench_tier.layer_side_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)], "a run needs both sides consecutive"
    size = bench_tier.block_bytes()
    dsts, srcs, sizes = bench_tier.descriptors([1 << 30, 2 << 30], [1 << 20, 2 << 20], [3, 4, 8], [0, 1, 2])
    assert srcs.tolist() == [(1 << 30) + 3 * size, (1 << 30) + 8 * size, (2 << 30) + 3 * size, (2 << 30) + 8 * size]
    assert dsts.tolist() == [1 << 20, (1 << 20) + 2 * size, 2 << 20, (2 << 20) + 2 * size]
    assert sizes.tolist() == [2 * size, size, 2 * size, size]


def test_stub_batch_entry_points_refuse_like_the_driver(stub_env):
    """The stub's own rules, called directly: cuGetProcAddress versions, the two ABIs, bad
    attributes, the legacy stream, a bad range (failIdx in the 12.8 ABI), nothing queued
    on refusal, and cuMemHostGetDevicePointer only for DEVICEMAP memory."""
    _run(stub_env, '''
        with CudaBackend() as gpu:
            p, status = ctypes.c_void_p(), ctypes.c_int(-1)
            get = STUB.cuGetProcAddress_v2
            get.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p]
            assert get(b"cuMemcpyBatchAsync", ctypes.byref(p), 13000, 0, ctypes.byref(status)) == 0 and status.value == 0
            v2 = ctypes.cast(STUB.cuMemcpyBatchAsync_v2, ctypes.c_void_p).value
            v1 = ctypes.cast(STUB.cuMemcpyBatchAsync, ctypes.c_void_p).value
            assert p.value == v2
            assert get(b"cuMemcpyBatchAsync", ctypes.byref(p), 12080, 0, ctypes.byref(status)) == 0 and p.value == v1
            assert get(b"cuMemcpyBatchAsync", ctypes.byref(p), 12000, 0, ctypes.byref(status)) == 0
            assert p.value is None and status.value == 2, "VERSION_NOT_SUFFICIENT"
            assert get(b"cuMemcpyBatchAsync", ctypes.byref(p), 13010, 0, ctypes.byref(status)) == 1, "above the driver"
            assert get(b"cuGetProcAddress", ctypes.byref(p), 12000, 0, None) == 0
            assert p.value == ctypes.cast(STUB.cuGetProcAddress_v2, ctypes.c_void_p).value
            import os
            os.environ["PAGEDKV_STUB_NO_BATCH_MEMCPY"] = "1"
            assert get(b"cuMemcpyBatchAsync", ctypes.byref(p), 13000, 0, ctypes.byref(status)) == 500 and status.value == 1
            del os.environ["PAGEDKV_STUB_NO_BATCH_MEMCPY"]

            stream = gpu.create_stream()
            dev = gpu.alloc(4096)
            swap = gpu.alloc_swap_memory(4096)
            plain = gpu.alloc_pinned(4096)
            U64 = ctypes.c_uint64 * 2
            dsts, srcs, sizes = U64(swap.address, int(dev) + 100), U64(int(dev), swap.address + 8), U64(64, 64)
            idx = (ctypes.c_size_t * 1)(0)

            class A(ctypes.Structure):
                _fields_ = [("order", ctypes.c_int), ("st", ctypes.c_int), ("si", ctypes.c_int),
                            ("dt", ctypes.c_int), ("di", ctypes.c_int), ("flags", ctypes.c_uint)]

            batch = STUB.cuMemcpyBatchAsync_v2
            batch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            old = STUB.cuMemcpyBatchAsync
            old.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                    ctypes.c_void_p, ctypes.c_void_p]
            s = stream  # the backend's handle is the CUstream's address
            pending = STUB.stub_pending_work()
            for attr, stream_handle, count, want in (
                (A(0, 1, 0, 2, 0, 0), s, 2, 1),   # srcAccessOrder INVALID
                (A(4, 1, 0, 2, 0, 0), s, 2, 1),   # no such order
                (A(1, 9, 0, 2, 0, 0), s, 2, 1),   # no such location type
                (A(1, 1, 0, 2, 0, 2), s, 2, 1),   # unknown flag
                (A(1, 1, 0, 2, 0, 0), 0, 2, 1),   # the legacy NULL stream
                (A(1, 1, 0, 2, 0, 0), 1, 2, 1),   # CU_STREAM_LEGACY
                (A(1, 1, 0, 2, 0, 0), s, 0, 1),   # no copy
            ):
                assert batch(dsts, srcs, sizes, count, ctypes.byref(attr), idx, 1, stream_handle) == want, (attr.order, stream_handle)
            assert STUB.stub_pending_work() == pending, "a refused batch queues nothing"
            fail = ctypes.c_size_t(0)
            bad = U64(swap.address, int(dev) + 4090)
            assert old(bad, srcs, sizes, 2, ctypes.byref(A(1, 1, 0, 2, 0, 0)), idx, 1, ctypes.byref(fail), s) == 1
            assert fail.value == 1 and STUB.stub_pending_work() == pending
            assert old(dsts, srcs, sizes, 2, ctypes.byref(A(1, 1, 0, 2, 0, 0)), idx, 1, ctypes.byref(fail), s) == 0
            assert fail.value == 2**64 - 1 and STUB.stub_pending_work() == pending + 2

            dptr = ctypes.c_uint64()
            hgdp = STUB.cuMemHostGetDevicePointer_v2
            hgdp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            assert hgdp(ctypes.byref(dptr), swap.address + 100, 0) == 0 and dptr.value == swap.address + 100
            assert hgdp(ctypes.byref(dptr), plain.array.ctypes.data, 0) == 1, "no DEVICEMAP: not mapped"
            assert hgdp(ctypes.byref(dptr), swap.address, 1) == 1, "flags must be 0"
            gpu.synchronize(stream)
    ''')


def test_mapped_vmm_chunks_are_device_memory_for_the_batch(stub_env):
    """An elastic pool's memory (mapped VMM chunks) is reachable like an allocation; adjacent
    chunks form one span; the unmapped rest of a reservation is refused before anything runs."""
    _run(stub_env, '''
        for mode in ("auto", "kernel"):
            with CudaBackend(copy_batch=mode) as gpu:
                g = gpu.vmm_granularity()
                base = gpu.reserve_address(4 * g)
                gpu.map_chunk(base, g)
                gpu.map_chunk(base.offset(g), g)
                stream = gpu.create_stream()
                swap = gpu.alloc_swap_memory(8192)
                swap.array[:] = np.arange(8192) % 241
                before = copies()
                # one range across the boundary of two adjacent chunks
                gpu.copy_batch_async([int(base) + g - 4096], [swap.address], [8192], stream)
                gpu.synchronize(stream)
                got = np.empty(8192, np.uint8)
                gpu.copy_d2h(base.offset(g - 4096), got)
                assert np.array_equal(got, swap.array)
                assert sum(copies()) == sum(before) + 1
                try:
                    gpu.copy_batch_async([int(base) + 2 * g - 10], [swap.address], [20], stream)
                except IndexError as err:
                    assert "range 0: destination 0x%x + 20 bytes" % (int(base) + 2 * g - 10) in str(err), err
                else:
                    raise AssertionError("a range into the unmapped part was accepted")
                swap.free()
                gpu.destroy_stream(stream)
                gpu.release_address(base)
    ''')


def test_a_refused_driver_call_raises_and_the_next_batch_works(stub_env):
    _run(stub_env, '''
        for mode, call in (("auto", "cuMemcpyBatchAsync"), ("kernel", "cuLaunchKernel")):
            with CudaBackend(copy_batch=mode) as gpu:
                stream = gpu.create_stream()
                dev = gpu.alloc(4096)
                swap = gpu.alloc_swap_memory(4096)
                gpu.copy_h2d(np.full(4096, 6, np.uint8), dev)
                swap.array[:] = 0
                STUB.stub_fail_next(call.encode(), 1)
                try:
                    gpu.copy_batch_async([swap.address], [int(dev)], [4096], stream)
                except CudaError as err:
                    assert err.call == call and err.status == 1, err
                else:
                    raise AssertionError("the injected failure was not raised")
                gpu.synchronize(stream)
                assert (swap.array == 0).all()
                gpu.copy_batch_async([swap.address], [int(dev)], [4096], stream)
                gpu.synchronize(stream)
                assert (swap.array == 6).all()
    ''')


def test_queued_kernel_batches_keep_their_descriptors(stub_env):
    """Eight kernel-path batches queued back to back (the stub runs none until the host
    waits): more than the mapped staging ring holds, so slots are reused, each only after
    the launch that reads it has run; every batch copies what its own descriptor says."""
    _run(stub_env, '''
        with CudaBackend(copy_batch="kernel") as gpu:
            stream = gpu.create_stream()
            dev = gpu.alloc(8 * 4096)
            swap = gpu.alloc_swap_memory(8 * 4096)
            gpu.copy_h2d(np.repeat(np.arange(1, 9, dtype=np.uint8), 4096), dev)
            swap.array[:] = 0
            assert len(gpu._mapped_staging) < 8
            for k in range(8):
                gpu.copy_batch_async([swap.address + k * 4096], [int(dev) + (7 - k) * 4096], [4096], stream)
            gpu.synchronize(stream)
            for k in range(8):
                assert (swap.array[k * 4096:(k + 1) * 4096] == 8 - k).all(), (k, swap.array[k * 4096])
    ''')


def test_captures_refuse_staged_launches_and_keep_an_undestroyed_graph(stub_env):
    """A kernel-path batch (its descriptor in a mapped staging slot) or a block kernel (its
    indices uploaded from a staging slot) inside a capture would bake a slot that later
    calls rewrite, so a replay would copy another batch's ranges: the call is refused with
    GraphCaptureError before anything is acquired or enqueued, the capture is discarded,
    and the staging ring works afterwards. The driver path (no staging) is captured and
    its replay copies its own ranges; a graph whose destroy the driver refuses stays
    recorded and the next close() frees it."""
    _run(stub_env, '''
        from pagedkv import KvCacheConfig, PagedKvCache
        from pagedkv.driver import GraphCaptureError
        for mode in ("kernel", "auto"):
            with CudaBackend(copy_batch=mode) as gpu:
                stream = gpu.create_stream()
                dev = gpu.alloc(8 * 4096)
                swap = gpu.alloc_swap_memory(8 * 4096)
                gpu.copy_h2d(np.repeat(np.arange(1, 9, dtype=np.uint8), 4096), dev)
                for _ in range(len(gpu._mapped_staging)):  # every slot allocated: a capture needs no allocation
                    gpu.copy_batch_async([swap.address], [int(dev)], [16], stream)
                gpu.synchronize(stream)
                swap.array[:] = 0
                graph = None
                try:
                    with gpu.capture(stream) as graph:
                        gpu.copy_batch_async([swap.address], [int(dev) + 4096], [4096], stream)
                except GraphCaptureError as err:
                    assert mode == "kernel" and (err.call, err.status) == ("a staged launch", 900), (mode, err)
                    assert not graph.ready and STUB.stub_live_graphs() == 0
                else:
                    assert mode == "auto" and graph.ready, mode
                for k in range(8):
                    gpu.copy_batch_async([swap.address + k * 4096], [int(dev) + (7 - k) * 4096], [4096], stream)
                gpu.synchronize(stream)
                assert [int(swap.array[k * 4096]) for k in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
                if graph.ready:
                    swap.array[:] = 0
                    graph.launch(stream)
                    gpu.synchronize(stream)
                    assert (swap.array[:4096] == 2).all() and (swap.array[4096:] == 0).all()
                    STUB.stub_fail_next(b"cuGraphExecDestroy", 1)  # a refused destroy stays recorded
                    try:
                        graph.close()
                    except CudaError as err:
                        assert err.call == "cuGraphExecDestroy", err
                    else:
                        raise AssertionError("the injected failure was not raised")
                    assert (STUB.stub_live_graph_execs(), STUB.stub_live_graphs()) == (1, 0) and not graph.ready
                    graph.close()
                    assert STUB.stub_live_graph_execs() == 0
                    graph.close()
                    try:  # a capture ended by an exception, its graph's destroy refused: kept, freed by close()
                        with gpu.capture(stream) as dropped:
                            gpu.memset_async(dev, 1, 64, stream)
                            STUB.stub_fail_next(b"cuGraphDestroy", 1)
                            raise KeyError("body")
                    except KeyError:
                        pass
                    assert STUB.stub_live_graphs() == 1 and not dropped.ready
                    dropped.close()
                    assert STUB.stub_live_graphs() == 0
                cache = PagedKvCache(KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16"), 4, gpu)
                launches = calls("cuLaunchKernel")
                try:
                    with gpu.capture(stream):
                        cache.init_blocks([1, 2], gpu, stream)
                except GraphCaptureError as err:
                    assert (err.call, err.status) == ("a staged launch", 900) and calls("cuLaunchKernel") == launches, err
                else:
                    raise AssertionError("a staged block kernel was captured")
                cache.init_blocks([1, 2], gpu, stream)
                gpu.synchronize(stream)
                cache.release(gpu)
                swap.free()
                gpu.free(dev)
    ''')
