"""A decode step on CudaBackend over the libcuda stub (kernels on the CPU harness): one
`plan_layer_reads` launch reads every layer byte-identically to a `read_tokens` per layer
(and replays from a CUDA graph), and repeated per-layer calls take their prepared launch
without going stale (a new buffer, new slots or a new scale is a new launch)."""

from __future__ import annotations

from kernel_harness.stub import run_on_stub

BODY = '''
import ml_dtypes
from pagedkv import DeviceArray, HostBackend, KvCacheConfig, PagedKvCache
from pagedkv.driver import CudaBackend

FORMATS = ("bf16", "turbo4k_turbo3v", "fp8", "nvfp4")
HEADS, DIM, TOKENS, NB = 4, 128, 6, 4
config = KvCacheConfig(block_size=16, num_kv_heads=HEADS, head_dim=DIM, num_layers=4, dtype=FORMATS[0],
                       layer_dtypes=FORMATS)
rng = np.random.default_rng(3)
rows = [rng.normal(size=(TOKENS, HEADS, DIM)).astype(ml_dtypes.bfloat16) for _ in range(8)]
with CudaBackend() as gpu:
    stream = gpu.create_stream()
    cache = PagedKvCache(config, NB, gpu)
    cache.alloc_blocks(NB)
    n = TOKENS * HEADS * DIM
    bufs = [gpu.alloc(2 * n) for _ in range(8)]
    for b, r in zip(bufs, rows):
        gpu.copy_h2d(r.view(np.uint16), b)
    ks = [DeviceArray(b, (TOKENS, HEADS, DIM), "bfloat16") for b in bufs[:4]]
    vs = [DeviceArray(b, (TOKENS, HEADS, DIM), "bfloat16") for b in bufs[4:]]
    slot_buf = gpu.alloc(8 * TOKENS)
    gpu.copy_h2d(np.array([5, 17, 40, -1, 2, 63], np.int64), slot_buf)
    slots = DeviceArray(slot_buf, (TOKENS,), "int64")
    wplan = cache.plan_layer_writes(range(4), ks, vs, gpu)
    wplan.write(slots, stream)
    outs = [gpu.alloc(4 * n) for _ in range(16)]
    planned = [DeviceArray(o, (TOKENS, HEADS, DIM), "float32") for o in outs[:8]]
    single = [DeviceArray(o, (TOKENS, HEADS, DIM), "float32") for o in outs[8:]]
    rplan = cache.plan_layer_reads(range(4), planned[:4], planned[4:], gpu)
    before = calls("cuLaunchKernel")
    rplan.read(slots, stream)
    assert calls("cuLaunchKernel") == before + 1
    for layer in range(4):
        cache.read_tokens(layer, slots, gpu, out_k=single[layer], out_v=single[4 + layer], stream=stream)
    gpu.synchronize(stream)
    def host(o):
        x = np.zeros(n, np.float32)
        gpu.copy_d2h(o, x)
        return x
    for a, b in zip(outs[:8], outs[8:]):
        assert host(a).tobytes() == host(b).tobytes()
    assert (host(outs[0]).reshape(TOKENS, -1)[3] == 0).all()   # the -1 slot reads as zeros
    # replayed from a graph after new rows were written
    with gpu.capture(stream) as graph:
        rplan.read(slots, stream)
    for b, r in zip(bufs, rows[::-1]):
        gpu.copy_h2d(r.view(np.uint16), b)
    wplan.write(slots, stream)
    graph.launch(stream)
    for layer in range(4):
        cache.read_tokens(layer, slots, gpu, out_k=single[layer], out_v=single[4 + layer], stream=stream)
    gpu.synchronize(stream)
    for a, b in zip(outs[:8], outs[8:]):
        assert host(a).tobytes() == host(b).tobytes()
    graph.close()
    wplan.close(); rplan.close()
    for b, r in zip(bufs, rows):
        gpu.copy_h2d(r.view(np.uint16), b)

    # repeated per-layer writes: the prepared launch, never a stale one
    ref = HostBackend()
    want = PagedKvCache(config, NB, ref)
    want.alloc_blocks(NB)
    gpu.memset_async(cache.k_pool_ptr(0), 0, NB * cache.k_block_stride_bytes_for_layer(0), stream)
    gpu.memset_async(cache.v_pool_ptr(0), 0, NB * cache.v_block_stride_bytes_for_layer(0), stream)
    slot_values = np.array([5, 17, 40, -1, 2, 63], np.int64)
    for step, (k, v, scale, new_slots) in enumerate(((0, 4, 1.0, None), (0, 4, 1.0, None), (1, 5, 1.0, None),
                                                      (1, 5, 1.0, [9, 8, 7, 6, 5, 4]))):
        if new_slots is not None:
            slot_values = np.asarray(new_slots, np.int64)
            gpu.copy_h2d(slot_values, slot_buf)
        before = calls("cuLaunchKernel")
        cache.write_tokens(0, slots, DeviceArray(bufs[k], (TOKENS, HEADS, DIM), "bfloat16"),
                           DeviceArray(bufs[v], (TOKENS, HEADS, DIM), "bfloat16"), gpu, stream)
        assert calls("cuLaunchKernel") == before + 1, step
        want.write_tokens(0, slot_values, rows[k].astype(np.float32), rows[v].astype(np.float32), ref, 0)
        gpu.synchronize(stream)
        for side in "kv":
            size = NB * getattr(cache, f"{side}_block_stride_bytes_for_layer")(0)
            got = np.zeros(size, np.uint8)
            gpu.copy_d2h(getattr(cache, f"{side}_pool_ptr")(0), got)
            exp = ref.view(getattr(want, f"{side}_pool_ptr")(0), size)
            bad = np.flatnonzero(got != np.frombuffer(bytes(exp), np.uint8))
            assert bad.size == 0, (step, side, bad[:8].tolist(), got[bad[:8]].tolist(), np.frombuffer(bytes(exp), np.uint8)[bad[:8]].tolist())
    for p in bufs + outs + [slot_buf]:
        gpu.free(p)
    cache.release(gpu)
    want.release(ref)
    gpu.destroy_stream(stream)
print("ok")
'''


def test_one_launch_reads_every_layer_and_prepared_launches_never_go_stale(stub_env):
    assert "ok" in run_on_stub(stub_env, BODY, timeout=300)
