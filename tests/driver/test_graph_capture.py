"""CUDA graph capture over the libcuda stub (kernels executing in the harness): the stub's
capture model (what becomes a node, what the driver refuses during capture and how that
invalidates it, the three modes), `CudaBackend.capture` and an engine step captured once
and replayed with new K/V rows and new slots in the same buffers, byte-equal to
HostBackend's writes; a host-staged call inside a capture fails cleanly.

This is the stub's model of the driver's rules (the CUDA programming guide's prohibited
operations), not a GPU: capture has not been run on a real device by these tests."""

from __future__ import annotations

import textwrap

from kernel_harness.stub import run_on_stub

_RAW = '''
from cuda.bindings import driver as D
STUB.stub_graph_nodes.argtypes = [ctypes.c_void_p]
D.cuInit(0)
dev = D.cuDeviceGet(0)[1]
ctx = D.cuDevicePrimaryCtxRetain(dev)[1]
assert D.cuCtxSetCurrent(ctx)[0] == 0
def code(r):
    return int((r[0] if isinstance(r, tuple) else r).value)
def status(s):
    err, st = D.cuStreamIsCapturing(s)
    assert code(err) == 0, err
    return int(st.value)
def mem(n, fill):
    p = D.cuMemAlloc(n)[1]
    assert code(D.cuMemsetD8Async(p, fill, n, D.CUstream(1))) == 0 and code(D.cuCtxSynchronize()) == 0
    return p
def read(p, n):
    return bytes((ctypes.c_uint8 * n).from_address(int(p)))
GLOBAL, THREAD_LOCAL, RELAXED = (D.CUstreamCaptureMode(m) for m in (0, 1, 2))
'''


def test_stub_capture_records_nodes_in_order_and_replays_them(stub_env):
    out = run_on_stub(stub_env, _RAW + textwrap.dedent('''
        s = D.cuStreamCreate(0)[1]
        a, b, c = mem(64, 1), mem(64, 2), mem(64, 3)
        ev = D.cuEventCreate(2)[1]
        host = (ctypes.c_uint8 * 64)(*([9] * 64))
        assert status(s) == 0
        assert code(D.cuStreamBeginCapture(s, GLOBAL)) == 0
        assert status(s) == 1
        err, st, cid, graph, deps, edges, n = D.cuStreamGetCaptureInfo(s)
        assert code(err) == 0 and int(st.value) == 1 and int(cid) > 0 and n == 0
        assert code(D.cuMemsetD8Async(a, 7, 32, s)) == 0                  # node 1
        assert code(D.cuMemcpyDtoDAsync(b, a, 64, s)) == 0                # node 2: after the memset
        assert code(D.cuEventRecord(ev, s)) == 0                          # capture-internal: no node
        assert code(D.cuStreamWaitEvent(s, ev, 0)) == 0                   # same capture: nothing
        assert code(D.cuMemcpyHtoDAsync(c, ctypes.addressof(host), 16, s)) == 0   # node 3
        assert code(D.cuStreamIsCapturing(D.CUstream(1))[0]) == 906        # legacy query: refused...
        assert status(s) == 1                                              # ...without invalidating
        assert read(a, 64) == bytes([1] * 64) and read(b, 64) == bytes([2] * 64), "captured work ran"
        err, graph = D.cuStreamEndCapture(s)
        assert code(err) == 0 and STUB.stub_graph_nodes(int(graph)) == 3 and status(s) == 0
        assert STUB.stub_pending_work() == 0, "capture queued work"
        err, exe = D.cuGraphInstantiate(graph, 0)
        assert code(err) == 0 and STUB.stub_live_graph_execs() == 1
        assert code(D.cuGraphDestroy(graph)) == 0                         # the exec keeps its own copy
        for round_ in range(2):
            host[0] = 40 + round_
            assert code(D.cuGraphLaunch(exe, s)) == 0
            assert STUB.stub_pending_work() == 3, "a launch queues the three nodes, run when waited for"
            if round_ == 0:
                assert read(b, 64) == bytes([2] * 64)
            assert code(D.cuStreamSynchronize(s)) == 0
            assert read(a, 64) == bytes([7] * 32 + [1] * 32)
            assert read(b, 64) == bytes([7] * 32 + [1] * 32)
            assert read(c, 64) == bytes([40 + round_] + [9] * 15 + [3] * 48)
        assert code(D.cuGraphExecDestroy(exe)) == 0
        assert code(D.cuGraphExecDestroy(exe)) == 400 and code(D.cuGraphLaunch(exe, s)) == 400
        assert STUB.stub_live_graphs() == 0 and STUB.stub_live_graph_execs() == 0
        # the legacy stream cannot capture; a stream cannot capture twice; ending needs a capture
        assert code(D.cuStreamBeginCapture(D.CUstream(1), GLOBAL)) == 900
        assert code(D.cuStreamEndCapture(s)[0]) == 401
        assert code(D.cuStreamBeginCapture(s, RELAXED)) == 0
        assert code(D.cuStreamBeginCapture(s, RELAXED)) == 401
        err, graph = D.cuStreamEndCapture(s)
        assert code(err) == 0 and STUB.stub_graph_nodes(int(graph)) == 0
        assert code(D.cuGraphDestroy(graph)) == 0
        print("CHECK nodes ok")
    '''))
    assert "CHECK nodes ok" in out


def test_stub_refuses_what_a_capture_cannot_record_and_invalidates_it(stub_env):
    """Each refused call returns the driver's status, invalidates the capture (later work
    on the stream: 901; cuStreamEndCapture: 901 and no graph) and runs nothing."""
    out = run_on_stub(stub_env, _RAW + textwrap.dedent('''
        import threading
        blocking, nonblocking = D.cuStreamCreate(0)[1], D.cuStreamCreate(1)[1]
        a = mem(64, 1)
        host = (ctypes.c_uint8 * 64)()
        ev = D.cuEventCreate(2)[1]
        def captured_event(s):
            assert code(D.cuEventRecord(ev, s)) == 0
            return ev
        cases = [
            # (name, stream, call -> status, expected status)
            ("stream sync", blocking, lambda s: D.cuStreamSynchronize(s), 900),
            ("stream query", blocking, lambda s: D.cuStreamQuery(s), 900),
            ("context sync", nonblocking, lambda s: D.cuCtxSynchronize(), 900),
            ("alloc", nonblocking, lambda s: D.cuMemAlloc(64), 900),
            ("free", nonblocking, lambda s: D.cuMemFree(mem_spare), 900),
            ("sync copy, blocking capture", blocking, lambda s: D.cuMemcpyHtoD(a, ctypes.addressof(host), 8), 906),
            ("sync copy, non-blocking capture", nonblocking, lambda s: D.cuMemcpyDtoH(ctypes.addressof(host), a, 8), 900),
            ("legacy async copy", blocking, lambda s: D.cuMemcpyDtoHAsync(ctypes.addressof(host), a, 8, D.CUstream(1)), 906),
            ("legacy sync", blocking, lambda s: D.cuStreamSynchronize(D.CUstream(1)), 906),
            ("event query", nonblocking, lambda s: D.cuEventQuery(captured_event(s)), 900),
            ("event sync", nonblocking, lambda s: D.cuEventSynchronize(captured_event(s)), 900),
        ]
        mem_spare = mem(64, 0)
        for name, s, call, want in cases:
            assert code(D.cuStreamBeginCapture(s, GLOBAL)) == 0, name
            assert code(D.cuMemsetD8Async(a, 5, 64, s)) == 0, name
            assert code(call(s)) == want, name
            assert status(s) == 2, name
            assert code(D.cuMemsetD8Async(a, 6, 64, s)) == 901, name
            err, graph = D.cuStreamEndCapture(s)
            assert code(err) == 901 and graph is None, name
            assert status(s) == 0 and read(a, 64) == bytes([1] * 64), name
            assert STUB.stub_live_graphs() == 0, name
        # a legacy-stream call while only a non-blocking stream captures is no conflict
        assert code(D.cuStreamBeginCapture(nonblocking, GLOBAL)) == 0
        assert code(D.cuMemsetD8Async(a, 2, 8, D.CUstream(1))) == 0 and code(D.cuStreamSynchronize(D.CUstream(1))) == 0
        assert status(nonblocking) == 1 and read(a, 8) == bytes([2] * 8)
        graph = D.cuStreamEndCapture(nonblocking)[1]
        assert code(D.cuGraphDestroy(graph)) == 0
        # modes: who may make potentially unsafe calls while a capture runs
        def other_thread_alloc():
            box = []
            def body():
                D.cuCtxSetCurrent(ctx)
                err, ptr = D.cuMemAlloc(64)
                box.append(code(err))
                if code(err) == 0:
                    box.append(code(D.cuMemFree(ptr)))
            t = threading.Thread(target=body)
            t.start(); t.join()
            assert box[0] != 0 or box[1] == 0, box
            return box[0]
        for mode, own, other in ((GLOBAL, 900, 900), (THREAD_LOCAL, 900, 0), (RELAXED, 0, 0)):
            assert code(D.cuStreamBeginCapture(nonblocking, mode)) == 0
            assert other_thread_alloc() == other, (mode, "other thread")
            err, ptr = D.cuMemAlloc(64)
            assert code(err) == own, (mode, "own thread")
            if own == 0:
                assert code(D.cuMemFree(ptr)) == 0
            err, graph = D.cuStreamEndCapture(nonblocking)
            assert code(err) == (0 if own == 0 and other == 0 else 901), mode
            if graph is not None:
                assert code(D.cuGraphDestroy(graph)) == 0
        # this thread's own mode: relaxed lets it allocate during its global capture
        assert code(D.cuStreamBeginCapture(nonblocking, GLOBAL)) == 0
        err, previous = D.cuThreadExchangeStreamCaptureMode(RELAXED)
        assert code(err) == 0 and int(previous.value) == 0
        err, ptr = D.cuMemAlloc(64)
        assert code(err) == 0 and code(D.cuMemFree(ptr)) == 0
        D.cuThreadExchangeStreamCaptureMode(GLOBAL)
        # a non-relaxed capture must end on the thread that began it
        box = []
        t = threading.Thread(target=lambda: (D.cuCtxSetCurrent(ctx), box.append(D.cuStreamEndCapture(nonblocking))))
        t.start(); t.join()
        assert code(box[0][0]) == 908 and status(nonblocking) == 1
        err, graph = D.cuStreamEndCapture(nonblocking)
        assert code(err) == 0 and code(D.cuGraphDestroy(graph)) == 0
        name, text = D.cuGetErrorName(901)[1], D.cuGetErrorString(900)[1]
        assert name == b"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED" and text == b"operation not permitted when stream is capturing"
        print("CHECK refusals ok")
    '''))
    assert "CHECK refusals ok" in out


_STEP = '''
import ml_dtypes
from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache, SequenceTable
from pagedkv.driver import CudaBackend, CudaGraph, GraphCaptureError
from cuda.bindings import driver as D
CONFIG = dict(block_size=16, num_kv_heads=2, head_dim=128, num_layers=4, dtype="bf16",
              layer_dtypes=("bf16", "fp8k_turbo2v", "nvfp4", "turbo4k_turbo3v"), k_scale=0.5, v_scale=2.0)
HEADS, DIM, TOKENS, LAYERS = 2, 128, 20, 4
NAMES = """cuCtxSynchronize cuEventSynchronize cuStreamSynchronize cuMemAlloc cuMemFree cuMemFreeHost
    cuMemHostAlloc cuMemcpyDtoD cuMemcpyDtoDAsync cuMemcpyDtoH cuMemcpyDtoHAsync cuMemcpyHtoD
    cuMemcpyHtoDAsync cuMemsetD8Async cuStreamQuery cuEventQuery cuEventRecord cuStreamWaitEvent""".split()
rng = np.random.default_rng(11)

def rows(round_):
    """K and V rows of every layer for one step (BF16 K, float32 V), outliers in channel 5."""
    out = []
    for layer in range(LAYERS):
        k = rng.normal(size=(TOKENS, HEADS, DIM)).astype(np.float32)
        k[:, :, 5] *= 60
        v = rng.normal(size=(TOKENS, HEADS, DIM)).astype(np.float32)
        out.append((k.astype(ml_dtypes.bfloat16), v))
    return out

def pool_bytes(cache, gpu, layer, side):
    size = 8 * getattr(cache, f"{side}_block_stride_bytes_for_layer")(layer)
    ptr = getattr(cache, f"{side}_pool_ptr")(layer)
    if isinstance(gpu, HostBackend):
        return gpu.view(ptr, size).copy()
    got = np.empty(size, np.uint8)
    gpu.copy_d2h(ptr, got)
    return got

def clear_pools(cache, gpu, stream):
    """Every pool byte 0 (blocks not yet handed out included), as on the other backend."""
    for layer in range(LAYERS):
        for side in "kv":
            size = 8 * getattr(cache, f"{side}_block_stride_bytes_for_layer")(layer)
            gpu.memset_async(getattr(cache, f"{side}_pool_ptr")(layer), 0, size, stream)
    gpu.synchronize(stream)

host = HostBackend(1 << 26)
want = PagedKvCache(KvCacheConfig(**CONFIG), 8, host)
clear_pools(want, host, 0)
want_table = SequenceTable(want, gpu=host)
'''


def test_an_engine_step_is_captured_once_and_replays_byte_exact(stub_env):
    out = run_on_stub(stub_env, _STEP + textwrap.dedent('''
        with CudaBackend() as gpu:
            assert gpu.supports("graphs")
            stream = gpu.create_stream()
            cache = PagedKvCache(KvCacheConfig(**CONFIG), 8, gpu)
            clear_pools(cache, gpu, stream)
            table = SequenceTable(cache, gpu=gpu, stream=stream)    # exports ordered on the step's stream
            for t in (table, want_table):
                t.add("a", list(range(TOKENS)))
            slots = table.slot_mapping(["a"], pad_to=TOKENS)
            want_slots = want_table.slot_mapping(["a"], pad_to=TOKENS).host
            assert np.array_equal(slots.host, want_slots)
            ks = [DeviceArray(gpu.alloc(TOKENS * HEADS * DIM * 2), (TOKENS, HEADS, DIM), "bfloat16") for _ in range(LAYERS)]
            vs = [DeviceArray(gpu.alloc(TOKENS * HEADS * DIM * 4), (TOKENS, HEADS, DIM), "float32") for _ in range(LAYERS)]
            outs = [[DeviceArray(gpu.alloc(TOKENS * HEADS * DIM * 4), (TOKENS, HEADS, DIM), "float32") for _ in "kv"]
                    for _ in range(LAYERS)]
            gpu.synchronize(stream)
            before_pools = [pool_bytes(cache, gpu, layer, side) for layer in range(LAYERS) for side in "kv"]
            launches = calls("cuLaunchKernel")
            before = {n: calls(n) for n in NAMES}
            with gpu.capture(stream) as graph:
                for layer in range(LAYERS):
                    cache.write_tokens(layer, slots, ks[layer], vs[layer], gpu, stream, 0.5, 2.0)
                    cache.read_tokens(layer, slots, gpu, unrotate=True, k_scale=0.5, v_scale=2.0,
                                      out_k=outs[layer][0], out_v=outs[layer][1], stream=stream)
                assert not graph.ready
            assert {n: calls(n) for n in NAMES} == before, {n: calls(n) - before[n] for n in NAMES}
            assert calls("cuLaunchKernel") == launches + 2 * LAYERS
            assert isinstance(graph, CudaGraph) and graph.ready
            assert STUB.stub_live_graphs() == 1 and STUB.stub_live_graph_execs() == 1
            after_capture = [pool_bytes(cache, gpu, layer, side) for layer in range(LAYERS) for side in "kv"]
            assert all(np.array_equal(a, b) for a, b in zip(after_capture, before_pools)), "the capture ran the step"
            for round_ in range(3):
                if round_:
                    # the next decode step: new tokens, new slots exported into the same buffer
                    for t in (table, want_table):
                        t.append("a", TOKENS)
                    new_slots = table.slot_mapping(["a"], pad_to=TOKENS)
                    want_slots = want_table.slot_mapping(["a"], pad_to=TOKENS).host
                    assert int(new_slots.device) == int(slots.device), "the slot buffer moved"
                    assert np.array_equal(new_slots.host, want_slots) and not np.array_equal(new_slots.host, slots.host)
                data = rows(round_)
                for layer, (k, v) in enumerate(data):
                    gpu.copy_h2d(k.view(np.uint16), ks[layer].ptr)
                    gpu.copy_h2d(v, vs[layer].ptr)
                    want.write_tokens(layer, want_slots, k, v, host, 0, 0.5, 2.0)
                graph.launch(stream)
                gpu.synchronize(stream)
                for layer in range(LAYERS):
                    for side in "kv":
                        got, exp = pool_bytes(cache, gpu, layer, side), pool_bytes(want, host, layer, side)
                        bad = np.flatnonzero(got != exp)
                        assert bad.size == 0, (round_, layer, side, bad[:5].tolist())
                    reads = want.read_tokens(layer, want_slots, host, True, 0.5, 2.0)
                    for out, exp in zip(outs[layer], reads):
                        got = np.empty((TOKENS, HEADS, DIM), np.float32)
                        gpu.copy_d2h(out.ptr, got)
                        assert np.array_equal(got.view(np.uint32), exp.view(np.uint32)), (round_, layer)
            graph.close()
            graph.close()
            assert STUB.stub_live_graphs() == 0 and STUB.stub_live_graph_execs() == 0
            try:
                graph.launch(stream)
            except RuntimeError as err:
                assert "closed" in str(err)
            else:
                raise AssertionError("a closed graph launched")
            # a graph still open when the backend closes is freed with it
            with gpu.capture(stream) as left_open:
                cache.write_tokens(0, slots, ks[0], vs[0], gpu, stream)
            assert STUB.stub_live_graph_execs() == 1
            for buf in ks + vs + [o for pair in outs for o in pair]:
                gpu.free(buf.ptr)
            table.release()
            cache.release(gpu)
        assert STUB.stub_live_graphs() == 0 and STUB.stub_live_graph_execs() == 0 and not left_open.ready
        print("CHECK step ok")
    '''), timeout=300)
    assert "CHECK step ok" in out


def test_a_host_staged_call_inside_a_capture_fails_cleanly(stub_env):
    """Host arrays take the staged path (a stream synchronisation and host copies): inside a
    capture the driver refuses the first of those, before any byte is written, and the
    capture is discarded; the device call captured before it never runs."""
    out = run_on_stub(stub_env, _STEP + textwrap.dedent('''
        with CudaBackend() as gpu:
            stream = gpu.create_stream()
            cache = PagedKvCache(KvCacheConfig(**CONFIG), 8, gpu)
            clear_pools(cache, gpu, stream)
            table = SequenceTable(cache, gpu=gpu, stream=stream)
            table.add("a", list(range(TOKENS)))
            slots = table.slot_mapping(["a"], pad_to=TOKENS)
            (k, v), = rows(0)[:1]
            dk = DeviceArray(gpu.alloc(k.nbytes), k.shape, "bfloat16")
            dv = DeviceArray(gpu.alloc(v.nbytes), v.shape, "float32")
            gpu.copy_h2d(k.view(np.uint16), dk.ptr)
            gpu.copy_h2d(v, dv.ptr)
            gpu.synchronize(stream)
            before = [pool_bytes(cache, gpu, layer, side) for layer in range(LAYERS) for side in "kv"]
            attempts = [
                ("write", lambda: cache.write_tokens(1, slots, k, v, gpu, stream), "cuStreamSynchronize", 900),
                ("read", lambda: cache.read_tokens(1, slots, gpu, stream=stream), "cuMemcpyDtoHAsync", 906),
            ]
            for name, call, refused, status in attempts:
                try:
                    with gpu.capture(stream) as graph:
                        cache.write_tokens(0, slots, dk, dv, gpu, stream)     # captured, never run
                        call()
                except GraphCaptureError as err:
                    assert err.call == refused and err.status == status, (name, err.call, err.status)
                    assert "inside a CUDA graph capture" in str(err) and "device arrays" in str(err), str(err)
                else:
                    raise AssertionError(f"a host-staged {name} was captured")
                assert not graph.ready and STUB.stub_live_graphs() == 0 and STUB.stub_live_graph_execs() == 0
                assert int(D.cuStreamIsCapturing(D.CUstream(int(stream)))[1].value) == 0, "capture left open"
                gpu.synchronize(stream)
                after = [pool_bytes(cache, gpu, layer, side) for layer in range(LAYERS) for side in "kv"]
                assert all(np.array_equal(a, b) for a, b in zip(after, before)), (name, "something was written")
            # a refused call whose error the block swallows still voids the capture
            try:
                with gpu.capture(stream) as graph:
                    cache.write_tokens(0, slots, dk, dv, gpu, stream)
                    try:
                        gpu.synchronize(stream)
                    except Exception:
                        pass
            except GraphCaptureError as err:
                assert err.status == 901 and err.call == "cuStreamEndCapture", err
            else:
                raise AssertionError("an invalidated capture gave a graph")
            # any other error from the block ends the capture and passes through unchanged
            try:
                with gpu.capture(stream):
                    cache.write_tokens(0, slots, DeviceArray(dk.ptr, (3, HEADS, DIM), "bfloat16"), dv, gpu, stream)
            except ValueError as err:
                assert "k must be shaped [20, 2, 128]" in str(err), err
            assert int(D.cuStreamIsCapturing(D.CUstream(int(stream)))[1].value) == 0
            for bad, message in ((0, "legacy default stream cannot be captured"), (12345, "unknown stream")):
                try:
                    gpu.capture(bad)
                except ValueError as err:
                    assert message in str(err), err
                else:
                    raise AssertionError(bad)
            try:
                gpu.capture(stream, mode="loose")
            except ValueError as err:
                assert "global, thread_local, relaxed" in str(err), err
            # a table whose exports are ordered on stream 0: the slots' DLPack wait would record an
            # event on the legacy stream, which a capture of a blocking stream refuses
            legacy_table = SequenceTable(cache, gpu=gpu)
            legacy_table.add("b", list(range(4)))
            legacy_slots = legacy_table.slot_mapping(["b"])
            events = STUB.stub_live_events()
            try:
                with gpu.capture(stream):
                    cache.write_tokens(0, legacy_slots, DeviceArray(dk.ptr, (4, HEADS, DIM), "bfloat16"),
                                       DeviceArray(dv.ptr, (4, HEADS, DIM), "float32"), gpu, stream)
            except GraphCaptureError as err:
                assert err.call == "cuEventRecord" and err.status == 906, (err.call, err.status)
            else:
                raise AssertionError("a legacy-stream event was captured")
            assert STUB.stub_live_events() == events, "the wait's event was not destroyed"
            legacy_table.release()
            # the device path still works on the stream afterwards, outside a capture
            cache.write_tokens(0, slots, dk, dv, gpu, stream)
            want_table.add("a", list(range(TOKENS)))
            want.write_tokens(0, want_table.slot_mapping(["a"], pad_to=TOKENS).host, k, v, host, 0)
            gpu.synchronize(stream)
            assert np.array_equal(pool_bytes(cache, gpu, 0, "k"), pool_bytes(want, host, 0, "k"))
            gpu.free(dk.ptr); gpu.free(dv.ptr)
            table.release()
            cache.release(gpu)
        print("CHECK staged ok")
    '''), timeout=300)
    assert "CHECK staged ok" in out
