"""CudaBackend's failure paths over the libcuda stub: nothing is forgotten before the driver
says it is gone (an allocation, a pinned buffer, a stream, a region table, an event, a VMM
handle), so a failed free is kept and its retry succeeds, and a granule whose cuMemRelease
failed after its unmap is never resident again (a kernel over it would be
CUDA_ERROR_ILLEGAL_ADDRESS and a lost context).

The sweep fails every watched driver call of the elastic, host-tier and tier+elastic
scenarios of tests/fault_injection.py once (the stub's `stub_fail_next`: before it takes
effect; for waits, copies and cuMemRelease also after it, the status replaced on return),
then with faults off checks the invariants, uses every block, releases everything and
asserts that neither the backend nor the stub holds anything."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from kernel_harness.stub import run_on_stub

pytestmark = pytest.mark.cuda

TESTS = Path(__file__).resolve().parent.parent

SETUP = f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
from cuda.bindings import driver as D
from structlog.testing import capture_logs
from pagedkv import PagedKvCache
from pagedkv.driver import CudaBackend, CudaError
STUB.stub_set_vmm_granularity.argtypes = [ctypes.c_size_t]
STUB.stub_set_vmm_granularity(4096)  # the stub maps whole pages
STUB.stub_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
import fault_injection as fi
from pagedkv import KvCacheConfig
fi.CONFIG = KvCacheConfig(block_size=8, num_kv_heads=1, head_dim=64, num_layers=2, dtype="bf16")  # 1 KiB sides: 4 blocks a granule

WATCHED = ("cuMemAlloc", "cuMemFree", "cuMemHostAlloc", "cuMemFreeHost", "cuMemHostGetDevicePointer",
           "cuStreamCreate", "cuStreamDestroy", "cuEventCreate", "cuEventRecord", "cuEventDestroy",
           "cuEventQuery", "cuEventSynchronize", "cuStreamWaitEvent", "cuStreamSynchronize",
           "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemMap", "cuMemSetAccess",
           "cuMemUnmap", "cuMemRelease", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemsetD8Async",
           "cuLaunchKernel", "cuCtxSynchronize")
LATE = {{"cuMemRelease", "cuEventQuery", "cuEventSynchronize", "cuStreamWaitEvent", "cuStreamSynchronize",
         "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemsetD8Async"}}

class Plan:
    at, late, armed, fired, method = -1, False, False, None, None
    calls = []

PLAN = Plan()

def _wrap(name):
    real = getattr(D, name)
    def call(*args):
        plan = PLAN
        if plan.armed:
            index = len(plan.calls)
            plan.calls.append(name)
            if index == plan.at or (plan.method == name):
                plan.method = None
                if not plan.late:
                    plan.fired = name
                    STUB.stub_fail_next(name.encode(), 999)  # CUDA_ERROR_UNKNOWN, before it takes effect
                elif name in LATE:
                    plan.fired = name
                    result = real(*args)
                    return (D.CUresult(999),) + tuple(result[1:])
        return real(*args)
    setattr(D, name, call)

for _name in WATCHED:
    _wrap(_name)

def fail_next(name, late=False):
    PLAN.calls, PLAN.at, PLAN.late, PLAN.fired, PLAN.method, PLAN.armed = [], -1, late, None, name, True

def staging(gpu):
    """(device allocations, host allocations, events) the staging rings hold (made on a
    slot's first use, kept until close)."""
    slots = [slot for ring in (gpu._staging, gpu._mapped_staging) for slot in ring._slots]
    return (sum(bool(s.device) and not s.mapped for s in slots), sum(bool(s.host_address) for s in slots),
            sum(s.event is not None for s in slots))

def books(gpu):
    """What the backend records, and what the stub holds beyond the backend's records
    (untracked: a leak close() cannot free). Streams and pinned buffers a failed temporary
    kept are recorded: close() frees them, and the sweep checks that at the end."""
    vm = gpu._virtual_memory()
    handles = len(vm._chunks) + vm.unreleased()
    dev, host, events = staging(gpu)
    return dict(
        allocations=len(gpu._allocs), swap=len(gpu._swap), events=len(gpu._events),
        reservations=len(vm.reservations()), handles=handles,
        untracked_allocations=STUB.stub_live_allocations() - len(gpu._allocs) - dev,
        untracked_host=STUB.stub_live_host_allocations() - len(gpu._pinned) - len(gpu._swap) - host,
        untracked_streams=STUB.stub_live_streams() - len(gpu._streams),
        untracked_events=STUB.stub_live_events() - len(gpu._events) - events,
        untracked_handles=STUB.stub_live_mem_handles() - handles,
        untracked_reservations=STUB.stub_live_reservations() - len(vm.reservations()))
'''


def test_failed_frees_keep_what_they_free_and_a_retry_frees_it(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        from pagedkv.backends.protocol import DevicePtr
        with CudaBackend() as gpu:
            ptr = gpu.alloc(4096)
            fail_next("cuMemFree")
            try:
                gpu.free(ptr)
            except CudaError as err:
                assert err.status_name == "CUDA_ERROR_UNKNOWN", err
            else:
                raise AssertionError("the injected failure must surface")
            assert gpu.live_allocations() == 1 and STUB.stub_live_allocations() >= 1
            gpu.free(ptr)  # the retry is accepted and frees it
            assert gpu.live_allocations() == 0
            pinned = gpu.alloc_pinned(256)
            fail_next("cuMemFreeHost")
            try:
                pinned.free()
            except CudaError:
                pass
            assert not pinned.freed and len(gpu._pinned) == 1
            pinned.free()
            assert pinned.freed and len(gpu._pinned) == 0
            stream = gpu.create_stream()
            fail_next("cuStreamDestroy")
            try:
                gpu.destroy_stream(stream)
            except CudaError:
                pass
            gpu.destroy_stream(stream)  # still known: the retry destroys it
            config = fi.CONFIG
            cache = PagedKvCache(config, 8, gpu)
            fail_next("cuMemFree")  # the region table's free, the first of the release
            try:
                cache.release(gpu)
            except CudaError:
                pass
            assert gpu.live_allocations() == 1
            cache.release(gpu)
            assert gpu.live_allocations() == 0
            other = gpu.create_stream()
            fail_next("cuEventDestroy")  # the event of a cross-stream wait
            try:
                gpu.make_stream_wait(0, other)
            except CudaError:
                pass
            assert gpu.live_events() == 1  # kept: close() destroys it
            gpu.destroy_stream(other)
        assert STUB.stub_live_allocations() == 0 and STUB.stub_live_events() == 0
        assert STUB.stub_live_streams() == 0 and STUB.stub_live_host_allocations() == 0
    '''))


def test_a_release_that_fails_after_the_unmap_leaves_no_block_over_the_granule(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        with CudaBackend() as gpu:
            cache = PagedKvCache(fi.CONFIG, 16, gpu, elastic=True)  # 128-byte sides: 4 blocks a granule
            held = cache.alloc_blocks(8)
            cache.free_blocks(held[4:])
            fail_next("cuMemRelease", late=True)  # released, then an error: the handle is gone
            with capture_logs():
                try:
                    cache.shrink(gpu)
                except CudaError:
                    pass
                else:
                    raise AssertionError("the injected failure must surface")
            assert cache.resident_blocks() == 4, cache.resident_blocks()
            assert STUB.stub_live_mem_handles() == 4 and gpu._virtual_memory().unreleased() == 1
            more = cache.alloc_blocks(12)  # the retried release finds the handle gone: settled, mapped anew
            assert more == list(range(4, 16)) and gpu._virtual_memory().unreleased() == 0
            cache.fill_blocks(held[:4] + more, 0x3C, gpu, 0)  # a kernel over every block: all mapped
            gpu.synchronize(0)
            assert (cache.read_block(1, more[-1], gpu)[1] == 0x3C).all()
            fail_next("cuMemRelease")  # before it takes effect: the handle stays, the retry releases it
            cache.free_blocks(held[:4] + more)
            with capture_logs():
                try:
                    cache.shrink(gpu)
                except CudaError:
                    pass
            assert gpu._virtual_memory().unreleased() == 1 and STUB.stub_live_mem_handles() == 1
            cache.release(gpu)
            assert gpu._virtual_memory().unreleased() == 0
            assert STUB.stub_live_mem_handles() == 0 and STUB.stub_live_reservations() == 0
    '''))


def test_every_failing_driver_call_of_the_scenarios_is_survived(stub_env):
    run_on_stub(stub_env, SETUP + dedent('''
        import time
        started = time.perf_counter()
        problems, runs, fired = [], 0, 0
        gpu = CudaBackend()
        with capture_logs():
            for name in sorted(fi.SCENARIOS):
                for _ in range(3):  # warm up: the staging rings' slots and events are made on first use
                    fi.SCENARIOS[name](fi.World(gpu))
                base, streams, pinned = books(gpu), set(gpu._streams), set(gpu._pinned)
                PLAN.calls, PLAN.at, PLAN.method, PLAN.armed = [], -1, None, True
                fi.SCENARIOS[name](fi.World(gpu))
                PLAN.armed = False
                calls = list(PLAN.calls)
                assert len(calls) >= 30, (name, len(calls))
                assert books(gpu) == base, (books(gpu), base)
                for late in (False, True):
                    for at, method in enumerate(calls):
                        if late and method not in LATE:
                            continue
                        runs += 1
                        before = books(gpu)
                        PLAN.calls, PLAN.at, PLAN.late, PLAN.fired, PLAN.armed = [], at, late, None, True
                        world = fi.World(gpu)
                        try:
                            fi.SCENARIOS[name](world)
                        except Exception:
                            pass
                        PLAN.armed = False
                        try:
                            fi.recover(world)
                        except Exception as err:
                            problems.append((name, at, method, late, f"{type(err).__name__}: {err}"[:200]))
                            continue
                        for handle in set(gpu._streams) - streams:  # a failed temporary's, kept for a retry
                            gpu.destroy_stream(handle)
                        for address in set(gpu._pinned) - pinned:
                            gpu._pinned[address].free()
                        left = {k: v - before[k] for k, v in books(gpu).items() if v != before[k]}
                        fired += PLAN.fired == method  # the call order may shift a little between runs
                        if PLAN.fired is None and not late or left:
                            problems.append((name, at, method, late, PLAN.fired, left))
            for problem in problems:
                print("PROBLEM", problem)
            gpu.close()  # frees what failed temporaries left recorded
        assert problems == [], problems[:10]
        assert (STUB.stub_live_allocations(), STUB.stub_live_host_allocations(), STUB.stub_live_streams(),
                STUB.stub_live_events(), STUB.stub_live_mem_handles(), STUB.stub_live_reservations()) == (0,) * 6
        assert fired > 0.8 * runs, (fired, runs)
        print("runs", runs, "as planned", fired, "seconds", round(time.perf_counter() - started, 2))
    '''))
