"""The batched-copy check run over the libcuda stub: the body of a subprocess script
(kernel_harness.stub.PRELUDE comes first) that runs CudaBackend.copy_batch_async on
random ranges and compares every byte of the device allocation and of the swap memory
with a numpy model of the same copies.

Ranges have random lengths (1 byte to two kernel chunks; one range of each swap batch
spans three chunks, the last partial) and offsets, so every
head/tail and word size occurs (half of them with source and destination equally
misaligned, the 16-byte path); batches go device -> host (swap out), host -> device
(swap in) and mixed (device -> device and host -> host too). In "kernel" mode each batch
is exactly one cuLaunchKernel and no upload; at 1 CTA per SM on 2 SMs the grid-stride
loop wraps; two CTA orders. In "driver" mode each batch is exactly one
cuMemcpyBatchAsync. It prints `CHECK copy_batch ok` when every assertion held.
"""

from __future__ import annotations

from .checks import ORDERS

_BODY = '''
import os
from pagedkv.driver import CudaBackend
from pagedkv.driver.swaps import COPY_BATCH_CHUNK
STUB.stub_set_device({sms}, 9, 0)
STUB.stub_set_occupancy(1)
MODE = {mode!r}
SIZE = 6 * COPY_BATCH_CHUNK + 4099

def layout(rng, count, src_span, dst_span, long=False):
    """count ranges: (src offset in src_span, dst offset in dst_span, size), destinations disjoint."""
    lo, hi = dst_span
    sizes = [int(s) for s in rng.choice([1, 7, 15, 16, 17, 100, 4096, 5000, COPY_BATCH_CHUNK + 33,
                                          2 * COPY_BATCH_CHUNK - 5], count)]
    if long:  # the first range spans three chunks, its last one partial
        sizes[0] = 2 * COPY_BATCH_CHUNK + 37
    while sum(sizes) + 64 * count > hi - lo:
        k = 1 + int(np.argmax(sizes[1:]))
        sizes[k] //= 2
    slack = (hi - lo) - sum(sizes)
    gaps = np.sort(rng.integers(0, slack, count))
    out, at, prev = [], lo, 0
    for k, (size, gap) in enumerate(zip(sizes, gaps.tolist())):
        at += gap - prev
        prev = gap
        dst = at
        at += size
        src = int(rng.integers(src_span[0], src_span[1] - size + 1))
        if k % 2 == 0:  # equal misalignment at both ends: the 16-byte path
            src -= (src - dst) % 16
            if src < src_span[0]:
                src += 16
        out.append((src, dst, size))
    return out

rng = np.random.default_rng(20261201)
for order in {orders!r}:
    os.environ["PAGEDKV_HARNESS_ORDER"] = order
    with CudaBackend(copy_batch="kernel" if MODE == "kernel" else "auto") as gpu:
        assert gpu.copy_batch_path == MODE, gpu.copy_batch_path
        stream = gpu.create_stream()
        dev = gpu.alloc(SIZE)
        swap = gpu.alloc_swap_memory(SIZE)
        want_dev = rng.integers(0, 256, SIZE, dtype=np.uint8)
        gpu.copy_h2d(want_dev, dev)
        swap.array[:] = want_host = rng.integers(0, 256, SIZE, dtype=np.uint8)
        half = SIZE // 2
        D, H = int(dev), swap.address
        q = (SIZE - half) // 2
        # mixed: sources in the first halves, each kind's destinations in its own quarter
        mixed = []
        for (base_s, base_d, lo) in ((D, H, half), (H, H, half + q), (H, D, half), (D, D, half + q)):
            mixed += [(base_s + s, base_d + d, n) for s, d, n in layout(rng, 3, (0, half), (lo, lo + q))]
        batches = {{
            "swap out": [(D + s, H + d, n) for s, d, n in layout(rng, 9, (0, SIZE), (0, SIZE), long=True)],
            "swap in": [(H + s, D + d, n) for s, d, n in layout(rng, 9, (0, SIZE), (0, SIZE), long=True)],
            "mixed": mixed,
        }}
        wrapped = False
        for name, ranges in batches.items():
            model = {{D: want_dev.copy(), H: want_host.copy()}}
            before = {{D: want_dev.copy(), H: want_host.copy()}}
            def region(address):
                return (D, address - D) if D <= address < D + SIZE else (H, address - H)
            for s, d, n in ranges:
                (sb, so), (db, do) = region(s), region(d)
                model[db][do:do + n] = before[sb][so:so + n]
            counts = {{c: calls(c) for c in ("cuLaunchKernel", "cuMemcpyBatchAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync")}}
            dsts = np.array([d for _, d, _ in ranges], np.uint64)
            gpu.copy_batch_async(dsts, [s for s, _, _ in ranges], [n for _, _, n in ranges], stream)
            delta = {{c: calls(c) - v for c, v in counts.items()}}
            if MODE == "kernel":
                assert delta == {{"cuLaunchKernel": 1, "cuMemcpyBatchAsync": 0, "cuMemcpyHtoDAsync": 0, "cuMemcpyDtoHAsync": 0}}, delta
                chunks = sum(-(-n // COPY_BATCH_CHUNK) for _, _, n in ranges)
                wrapped |= launch(-1)[0].grid[0] < chunks
            else:
                assert delta == {{"cuLaunchKernel": 0, "cuMemcpyBatchAsync": 1, "cuMemcpyHtoDAsync": 0, "cuMemcpyDtoHAsync": 0}}, delta
            gpu.synchronize(stream)
            got_dev = np.empty(SIZE, np.uint8)
            gpu.copy_d2h(dev, got_dev)
            for label, got, want in (("device", got_dev, model[D]), ("host", swap.array, model[H])):
                bad = np.flatnonzero(got != want)
                assert bad.size == 0, (name, order, label, "first differing bytes", bad[:8].tolist(), ranges)
            want_dev, want_host = model[D], model[H]
        assert MODE != "kernel" or {sms} > 2 or wrapped, "some batch must have more chunks than CTAs"
        gpu.free(dev)
        swap.free()
        gpu.destroy_stream(stream)
print("CHECK copy_batch ok")
'''


def copy_batch_body(sms: int, mode: str, orders=ORDERS) -> str:
    """The subprocess body of the batched-copy check on a stub of `sms` SMs through the
    `mode` path: "kernel" (CudaBackend(copy_batch="kernel")) or "driver" (cuMemcpyBatchAsync)."""
    return _BODY.format(sms=sms, mode=mode, orders=tuple(orders))
