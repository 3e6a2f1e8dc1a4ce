"""PagedKvCache construction, release, failure paths, aliasing, one-call fills, events and tracing."""

import inspect
import json
import subprocess
import sys
import textwrap

import pytest
from structlog.testing import capture_logs

from pagedkv import (
    DeviceMemoryError,
    DeviceOutOfMemory,
    HostBackend,
    KvCacheConfig,
    KvCacheError,
    ModelResource,
    PagedKvCache,
    RefCountError,
)
from pagedkv.core.trace import HISTORY_PER_BLOCK

from conftest import HeldSet

SIDE = 256  # bf16, block_size 4 x 2 heads x head_dim 16


def config(dtype="bf16", layers=2, **kw):
    return KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=layers, dtype=dtype, **kw)


class RecordingBackend(HostBackend):
    """A HostBackend that records the calls the cache makes and can be told to fail some frees
    or the region-table creation (the failures a real device can produce)."""

    def __init__(self, capacity_bytes=1 << 30):
        super().__init__(capacity_bytes=capacity_bytes)
        self.calls = []
        self.fail_free = set()
        self.fail_regions = False

    def fill_blocks(self, regions, blocks, value, stream):
        self.calls.append(("fill_blocks", [int(b) for b in blocks], value))
        super().fill_blocks(regions, blocks, value, stream)

    def memset_async(self, ptr, value, nbytes, stream):
        self.calls.append(("memset_async", int(ptr), value, nbytes))
        super().memset_async(ptr, value, nbytes, stream)

    def copy_d2d(self, src, dst, nbytes, stream):
        self.calls.append(("copy_d2d", int(src), int(dst), nbytes))
        super().copy_d2d(src, dst, nbytes, stream)

    def create_block_regions(self, rows):
        if self.fail_regions:
            raise DeviceOutOfMemory("injected: no room for the region table")
        return super().create_block_regions(rows)

    def free(self, ptr):
        self.calls.append(("free", int(ptr)))
        if int(ptr) in self.fail_free:
            raise DeviceMemoryError(f"injected failure freeing {ptr!r}")
        super().free(ptr)


def calls_named(gpu, name):
    return [c for c in gpu.calls if c[0] == name]


# -- construction ---------------------------------------------------------------------


def test_construction_allocates_a_k_and_a_v_pool_per_layer():
    gpu = HostBackend(1 << 20)
    c = PagedKvCache(config(layers=3), 5, gpu)
    assert gpu.live_allocations() == 6
    assert gpu.live_bytes() == 3 * 2 * 5 * SIDE
    assert c.num_free_blocks() == 5 and [c.ref_count(b) for b in range(5)] == [0] * 5
    c.release(gpu)


def test_constructor_validation():
    gpu = HostBackend(1 << 20)
    with pytest.raises(TypeError, match="KvCacheConfig"):
        PagedKvCache({"dtype": "bf16"}, 4, gpu)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_blocks"):
            PagedKvCache(config(), bad, gpu)
    assert gpu.live_allocations() == 0


def test_construction_event_fields(gpu):
    # 4 layers x (K + V) x 16*8*128 BF16 = 4 * 2 * 32768 = 262144 bytes per block; 2048 blocks = 0.5 GiB
    cfg = KvCacheConfig(block_size=16, num_kv_heads=8, head_dim=128, num_layers=4, dtype="bf16")
    with capture_logs() as logs:
        c = PagedKvCache(cfg, 2048, gpu)
    assert len(logs) == 1
    event = logs[0]
    assert event["event"] == "kv_cache_allocated" and event["log_level"] == "info"
    assert event["blocks"] == 2048
    assert event["layers"] == 4
    assert event["bytes_per_block"] == 262144
    assert event["total_gib"] == 0.5
    assert event["dtype"] == "bf16"
    assert event["mixed_formats"] is False
    assert event["v_aliased"] is False
    c.release(gpu)


def test_construction_event_mixed_and_aliased(gpu):
    with capture_logs() as logs:
        a = PagedKvCache(config(layers=2, layer_dtypes=["fp8"]), 4, gpu)
        b = PagedKvCache(config("turbo8", layers=3, v_aliases_k=True), 4, gpu)
    assert [(e["mixed_formats"], e["v_aliased"]) for e in logs] == [(True, False), (False, True)]
    assert [e["bytes_per_block"] for e in logs] == [128 + 128 + 256 + 256, 3 * (128 + 16)]
    a.release(gpu)
    b.release(gpu)


def test_partial_allocation_failure_frees_what_was_allocated():
    pool = 8 * SIDE
    for room in (0.5, 1.5, 2.5, 3.5):  # fails at the 1st, 2nd, 3rd, 4th pool
        gpu = HostBackend(capacity_bytes=int(room * pool))
        with pytest.raises(DeviceOutOfMemory, match=f"asked {pool} bytes"):
            PagedKvCache(config(layers=2), 8, gpu)
        assert gpu.live_allocations() == 0 and gpu.live_bytes() == 0


def test_region_table_failure_frees_the_pools():
    gpu = RecordingBackend()
    gpu.fail_regions = True
    with pytest.raises(DeviceOutOfMemory, match="region table"):
        PagedKvCache(config(layers=3), 4, gpu)
    assert gpu.live_allocations() == 0 and len(calls_named(gpu, "free")) == 6


def test_compute_num_blocks():
    per_block = 2 * 2 * SIDE
    cfg = config(layers=2)
    assert cfg.block_bytes_kv_all_layers() == per_block == 1024
    assert PagedKvCache.compute_num_blocks(cfg, 10 * 1024 + 1023) == 10
    assert PagedKvCache.compute_num_blocks(cfg, 1024) == 1
    assert PagedKvCache.compute_num_blocks(cfg, 1023) == 0
    assert PagedKvCache.compute_num_blocks(cfg, 0) == 0
    # turbo4k_turbo3v: 72 + 56 bytes per layer; aliased turbo8: 144 per layer
    assert PagedKvCache.compute_num_blocks(config("turbo4k3v", layers=4), 4 * 128 * 7) == 7
    assert PagedKvCache.compute_num_blocks(config("turbo8", layers=2, v_aliases_k=True), 288 * 3 + 287) == 3
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="available_bytes"):
            PagedKvCache.compute_num_blocks(cfg, bad)


def test_compute_num_blocks_fits_exactly():
    cfg = config("turbo4k3v", layers=3, layer_dtypes=["bf16"])
    capacity = 100_000
    n = PagedKvCache.compute_num_blocks(cfg, capacity)
    gpu = HostBackend(capacity_bytes=capacity)
    PagedKvCache(cfg, n, gpu).release(gpu)
    with pytest.raises(DeviceOutOfMemory):
        PagedKvCache(cfg, n + 1, gpu)
    assert gpu.live_bytes() == 0


# -- one backend call per fill --------------------------------------------------------


@pytest.mark.parametrize(
    "method, args, blocks, value",
    [
        ("zero_blocks", ([0, 3, 5],), [0, 3, 5], 0),
        ("poison_blocks", ([6, 1],), [6, 1], 0xFF),
        ("init_blocks", ([2, 4, 7],), [2, 4, 7], 0),
        ("zero_block", (4,), [4], 0),
        ("poison_block", (2,), [2], 0xFF),
        ("init_block", (0,), [0], 0),
    ],
)
def test_fills_are_one_backend_call(env_flags, method, args, blocks, value):
    env_flags(METRALE_KV_POISON="0")
    gpu = RecordingBackend()
    c = PagedKvCache(config(layers=4, layer_dtypes=["fp8", "turbo4k3v"]), 8, gpu)
    getattr(c, method)(*args, gpu, gpu.default_stream())
    assert gpu.calls == [("fill_blocks", blocks, value)]
    c.release(gpu)


def test_init_blocks_poison_is_one_call(env_flags):
    env_flags(METRALE_KV_POISON="1")
    gpu = RecordingBackend()
    c = PagedKvCache(config(layers=3), 8, gpu)
    c.init_blocks([1, 2, 3], gpu, gpu.default_stream())
    assert gpu.calls == [("fill_blocks", [1, 2, 3], 0xFF)]
    c.release(gpu)


def test_bookkeeping_touches_no_memory():
    gpu = RecordingBackend()
    c = PagedKvCache(config(), 8, gpu)
    table = c.alloc_blocks(3)
    c.inc_ref(table[0])
    c.dec_ref(table[0])
    c.free_blocks(table)
    c.alloc_block()
    held = HeldSet()
    held.held.add(0)
    c.attach_prefix_cache(held)
    c.return_evicted_block(0)
    assert gpu.calls == []
    c.release(gpu)


# -- v_aliases_k ----------------------------------------------------------------------


def test_v_aliases_k_allocates_no_v_pool_and_frees_once():
    gpu = RecordingBackend()
    c = PagedKvCache(config("turbo8", layers=3, v_aliases_k=True), 4, gpu)
    k_side = 128 + 16
    assert gpu.live_allocations() == 3
    assert gpu.live_bytes() == 3 * 4 * k_side
    for layer in range(3):
        assert c.v_pool_ptr(layer) == c.k_pool_ptr(layer)
        assert c.v_cache_ptr(layer, 2) == c.k_cache_ptr(layer, 2)
        assert c.v_block_stride_bytes_for_layer(layer) == c.k_block_stride_bytes_for_layer(layer) == k_side
    c.release(gpu)
    assert gpu.live_allocations() == 0
    assert len(calls_named(gpu, "free")) == 3


def test_v_aliases_k_skips_v_writes(gpu):
    c = PagedKvCache(config("bf16", layers=2, v_aliases_k=True), 4, gpu)
    c.alloc_blocks(4)
    c.zero_blocks(range(4), gpu, gpu.default_stream())  # device memory starts undefined
    gpu.synchronize(gpu.default_stream())
    k_data, v_data = bytes(range(200)), b"\xEE" * SIDE
    c.write_block(1, 3, k_data, v_data, gpu)
    c.write_block(0, 3, None, v_data, gpu)
    k, v = c.read_block(1, 3, gpu)
    assert k.size == v.size == SIDE
    assert k[:200].tobytes() == k_data and not k[200:].any()
    assert v.tobytes() == k.tobytes()
    k0, _ = c.read_block(0, 3, gpu)
    assert not k0.any()
    c.poison_block(1, gpu, gpu.default_stream())
    gpu.synchronize(gpu.default_stream())
    assert (c.read_block(0, 1, gpu)[1] == 0xFF).all()
    c.release(gpu)


# -- release --------------------------------------------------------------------------


def test_release_frees_everything_and_blocks_further_use(gpu):
    c = PagedKvCache(config(layers=3), 6, gpu)
    c.alloc_blocks(2)
    c.release(gpu)
    if isinstance(gpu, HostBackend):
        assert gpu.live_allocations() == 0 and gpu.live_bytes() == 0
    assert c.num_free_blocks() == 0 and c.num_blocks() == 0
    with pytest.raises(KvCacheError, match="released"):
        c.alloc_block()
    with pytest.raises(KvCacheError, match="released"):
        c.alloc_blocks(1)
    assert c.try_alloc_block() is None
    for call in (
        lambda: c.ref_count(0),
        lambda: c.dec_ref(0),
        lambda: c.zero_block(0, gpu, gpu.default_stream()),
        lambda: c.k_cache_ptr(0, 0),
        lambda: c.k_pool_ptr(0),
        lambda: c.read_block(0, 0, gpu),
        lambda: c.block_regions(),
    ):
        with pytest.raises(KvCacheError, match="released"):
            call()
    c.release(gpu)  # second release: nothing


def test_second_release_does_nothing():
    gpu = RecordingBackend()
    c = PagedKvCache(config(layers=2), 4, gpu)
    c.release(gpu)
    assert len(calls_named(gpu, "free")) == 4
    c.release(gpu)
    assert len(calls_named(gpu, "free")) == 4 and gpu.live_allocations() == 0


def test_failed_free_still_attempts_all_and_raises_the_first():
    gpu = RecordingBackend()
    c = PagedKvCache(config(layers=3), 4, gpu)
    pools = {int(c.k_pool_ptr(l)) for l in range(3)} | {int(c.v_pool_ptr(l)) for l in range(3)}
    gpu.fail_free = {int(c.k_pool_ptr(1)), int(c.v_pool_ptr(0))}
    with capture_logs() as logs:
        with pytest.raises(DeviceMemoryError) as info:
            c.release(gpu)
    attempted = [ptr for _, ptr in calls_named(gpu, "free")]
    assert sorted(attempted) == sorted(pools)  # every pool, once each
    first_failed = next(p for p in attempted if p in gpu.fail_free)
    assert str(info.value) == f"injected failure freeing DevicePtr(0x{first_failed:x})"
    assert gpu.live_allocations() == 2  # only the two that failed
    assert [e["event"] for e in logs] == ["kv_pool_free_failed"] * 2
    with pytest.raises(KvCacheError):
        c.alloc_block()
    # the two pools whose free failed stay recorded: a second release retries just them
    gpu.fail_free = {first_failed}
    with pytest.raises(DeviceMemoryError):
        c.release(gpu)
    assert len(calls_named(gpu, "free")) == 8 and gpu.live_allocations() == 1
    gpu.fail_free = set()
    c.release(gpu)
    assert len(calls_named(gpu, "free")) == 9 and gpu.live_allocations() == 0
    c.release(gpu)  # nothing left: a further release does nothing
    assert len(calls_named(gpu, "free")) == 9


def test_cache_is_a_model_resource(gpu):
    c = PagedKvCache(config(layers=2), 8, gpu)
    assert isinstance(c, ModelResource)
    assert c.label() == "PagedKvCache(2 layers x 8 blocks, bf16)"
    c.release(gpu)


# -- dec_ref at zero with assertions off ----------------------------------------------

OPTIMISED_SCRIPT = textwrap.dedent(
    """
    import json
    from structlog.testing import capture_logs
    from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, RefCountError
    gpu = HostBackend(1 << 20)
    cache = PagedKvCache(KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype="bf16"), 4, gpu)
    b = cache.alloc_block()
    cache.dec_ref(b)
    with capture_logs() as logs:
        returned = cache.dec_ref(b)
    with capture_logs() as more:
        evicted = cache.return_evicted_block(b)  # no prefix cache attached: the seed contract, a warning at 0
    logs += more
    cache.check_invariants()
    result = dict(debug=__debug__, returned=returned, evicted=evicted, free=cache.num_free_blocks(),
                  allocs=cache.alloc_blocks(4), events=[(e["event"], e["log_level"], e["block"]) for e in logs])
    print("RESULT " + json.dumps(result))
    """
)


def test_dec_ref_at_zero_with_assertions_off_returns_false():
    proc = subprocess.run([sys.executable, "-O", "-c", OPTIMISED_SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result == {
        "debug": False,
        "returned": False,
        "evicted": None,
        "free": 4,
        "allocs": [0, 1, 2, 3],
        "events": [["kv_dec_ref_at_zero", "error", 0], ["kv_return_evicted_at_zero", "warning", 0]],
    }


# -- tracing --------------------------------------------------------------------------


def here():
    """The caller's file:line, as the tracer writes it."""
    frame = inspect.currentframe().f_back
    return f"test_cache_lifecycle.py:{frame.f_lineno}"


def test_trace_history_and_dec_ref_error(gpu, env_flags):
    env_flags(METRALE_KV_TRACE="1")
    c = PagedKvCache(config(), 4, gpu)
    b = c.alloc_block(); w1 = here()  # noqa: E702 - same line on purpose
    c.inc_ref(b); w2 = here()  # noqa: E702
    c.free_block(b); w3 = here()  # noqa: E702
    c.free_blocks([b]); w4 = here()  # noqa: E702
    expected = [f"alloc->1@{w1}", f"inc_ref->2@{w2}", f"dec_ref->1@{w3}", f"dec_ref->0@{w4}"]
    assert c.block_history(b) == expected
    assert c.block_history(1) == []
    with capture_logs() as logs:
        with pytest.raises(RefCountError) as info:
            c.dec_ref(b)
    assert str(info.value) == f"dec_ref of block {b} at count 0; history: " + ", ".join(expected)
    assert logs[0]["event"] == "kv_dec_ref_at_zero" and logs[0]["history"] == expected
    c.release(gpu)


def test_trace_return_evicted_and_warning(gpu, env_flags):
    env_flags(METRALE_KV_TRACE="true")
    c = PagedKvCache(config(), 4, gpu)
    held = HeldSet()
    c.attach_prefix_cache(held)
    b = c.alloc_block(); w1 = here()  # noqa: E702
    held.held.add(b)
    c.return_evicted_block(b); w2 = here()  # noqa: E702
    expected = [f"alloc->1@{w1}", f"return_evicted->0@{w2}"]
    with capture_logs() as logs:
        c.return_evicted_block(b)
    assert logs[0]["event"] == "kv_return_evicted_at_zero" and logs[0]["history"] == expected
    with pytest.raises(RefCountError, match=f"inc_ref of free block {b}; history: alloc->1@"):
        c.inc_ref(b)
    c.release(gpu)


def test_trace_history_is_bounded(gpu, env_flags):
    env_flags(METRALE_KV_TRACE="1")
    c = PagedKvCache(config(), 4, gpu)
    b = c.alloc_block()
    for _ in range(40):
        c.inc_ref(b)
    history = c.block_history(b)
    assert len(history) == HISTORY_PER_BLOCK == 16
    assert [h.split("@")[0] for h in history] == [f"inc_ref->{n}" for n in range(26, 42)]
    c.release(gpu)


def test_trace_off_keeps_no_history(gpu, env_flags):
    env_flags(METRALE_KV_TRACE="0")
    c = PagedKvCache(config(), 4, gpu)
    b = c.alloc_block()
    c.inc_ref(b)
    assert c.block_history(b) == []
    c.dec_ref(b)
    c.dec_ref(b)
    with capture_logs() as logs:
        with pytest.raises(RefCountError) as info:
            c.dec_ref(b)
    assert str(info.value) == f"dec_ref of block {b} at count 0"
    assert logs[0]["history"] is None
    c.release(gpu)
