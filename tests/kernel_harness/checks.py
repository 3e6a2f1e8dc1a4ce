"""Kernel checks run over the libcuda stub: each is the body of a subprocess script
(kernel_harness.stub.PRELUDE comes first) that runs one kernel of CudaBackend and the same
operation on HostBackend and asserts they agree, under two CTA orders.

- fill / copy: every byte of every pool allocation, guard bytes around each pool
  included, equal to HostBackend's; the guards equal to the seed. Rows mix 16-byte
  aligned blocks with and without tails and unaligned block starts; at 2 SMs some
  launch has more items than CTAs, so the grid-stride loops wrap.
- reduce: the checksums are exact (pagedkv.core.exact_sum), so on any data (exactly summable,
  Gaussian, adversarial: +-max finite cancelling, subnormals, random bits) the three sums
  equal HostBackend's exactly and are identical across CTA orders and SM counts.

The harness runs CTAs one at a time, so these checks say nothing about the GPU's memory
model or concurrency between CTAs (see tests/kernel_harness/README.md).
"""

from __future__ import annotations

CHECKS = ("fill", "copy", "reduce")

ORDERS = ("ascending", "random:20261201")
"""The two CTA orders every check runs under (the second also shuffles threads)."""

_COMMON = '''
import os
import ml_dtypes
from pagedkv import HostBackend
from pagedkv.driver import CudaBackend
STUB.stub_set_device({sms}, 9, 0)
ORDERS = {orders!r}
GUARD = 64
# (stride, nbytes, offset of the pool in its allocation after the guard): vector bodies
# with and without tails, unaligned block starts (byte paths), one large block
ROWS = [(4096, 4096, 0), (112, 100, 0), (80, 64, 16), (37, 29, 3), (528, 520, 8)]
NBLOCKS = 16
SMS = {sms}

def pools(gpu, host, seed):
    """One allocation per row on both backends, seeded alike: [(gptr, hptr, size, base offset)]."""
    out = []
    rng = np.random.default_rng(seed)
    for stride, nbytes, offset in ROWS:
        size = GUARD + offset + NBLOCKS * stride + GUARD
        data = rng.integers(0, 256, size, dtype=np.uint8)
        g, h = gpu.alloc(size), host.alloc(size)
        gpu.copy_h2d(data, g)
        host.copy_h2d(data, h)
        out.append((g, h, size, GUARD + offset, data))
    return out

def regions_of(backend, allocations, which):
    return backend.create_block_regions(
        [(int(a[which]) + a[3], stride, nbytes) for a, (stride, nbytes, _) in zip(allocations, ROWS)])

def compare(gpu, host, allocations, what):
    for (g, h, size, start, seed), (stride, nbytes, _) in zip(allocations, ROWS):
        got = np.empty(size, np.uint8)
        gpu.copy_d2h(g, got)
        want = host.view(h, size)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (what, "row", (stride, nbytes), "first differing bytes", bad[:8].tolist(),
                               got[bad[:8]].tolist(), want[bad[:8]].tolist())
        end = start + NBLOCKS * stride
        assert np.array_equal(got[:GUARD], seed[:GUARD]) and np.array_equal(got[end:], seed[end:]), (what, "guard")

def release(gpu, host, allocations, regions):
    for r in regions[0]:
        gpu.destroy_block_regions(r)
    for g, h, *_ in allocations:
        gpu.free(g)
        host.free(h)
'''

_FILL = '''
for order in ORDERS:
    os.environ["PAGEDKV_HARNESS_ORDER"] = order
    with CudaBackend() as gpu:
        host = HostBackend(1 << 22)
        allocations = pools(gpu, host, 1)
        g, h = regions_of(gpu, allocations, 0), regions_of(host, allocations, 1)
        stream = gpu.create_stream()
        wrapped = False
        for blocks, value, s in (([5, 0, 7, 11, 2], 0xAB, stream), (list(range(NBLOCKS)), 0x00, 0), ([3], 0xFF, stream)):
            gpu.fill_blocks(g, blocks, value, s)
            host.fill_blocks(h, blocks, value, 0)
            wrapped |= launch(-1)[0].grid[0] < len(ROWS) * len(blocks)
            gpu.synchronize(s)
            compare(gpu, host, allocations, ("fill", order, blocks, value))
        assert wrapped or SMS > 2, "at 2 SMs some fill must have more items than CTAs (grid-stride loop)"
        gpu.destroy_stream(stream)
        release(gpu, host, allocations, [[g]])
print("CHECK fill ok")
'''

_COPY = '''
for order in ORDERS:
    os.environ["PAGEDKV_HARNESS_ORDER"] = order
    with CudaBackend() as gpu:
        host = HostBackend(1 << 22)
        allocations = pools(gpu, host, 2)
        g, h = regions_of(gpu, allocations, 0), regions_of(host, allocations, 1)
        stream = gpu.create_stream()
        wrapped = False
        for src, dst, s in (([1, 3, 8, 0], [4, 9, 10, 11], stream), ([11], [2], 0), (list(range(8)), list(range(8, 16)), stream)):
            gpu.copy_blocks(g, src, dst, s)
            host.copy_blocks(h, src, dst, 0)
            wrapped |= launch(-1)[0].grid[0] < len(ROWS) * len(src)
            gpu.synchronize(s)
            compare(gpu, host, allocations, ("copy", order, src, dst))
        assert wrapped or SMS > 2, "at 2 SMs some copy must have more items than CTAs (grid-stride loop)"
        gpu.destroy_stream(stream)
        release(gpu, host, allocations, [[g]])
print("CHECK copy ok")
'''

_REDUCE = '''
NB = 40
rng = np.random.default_rng(3)
# exactly summable: |m| < 128 times 2^-4..2^0 is a BF16 value, and every partial sum of
# values, squares and magnitudes fits float64's 53 bits, so any order gives the same sums
exact = (rng.integers(-127, 128, NB * 2048) * 2.0 ** rng.integers(-4, 1, NB * 2048)).astype(ml_dtypes.bfloat16)
gauss = rng.normal(size=NB * 2048).astype(ml_dtypes.bfloat16)
adversarial = rng.integers(0, 1 << 16, NB * 2048, dtype=np.uint16)
adversarial[((adversarial >> 7) & 0xFF) == 0xFF] = 0x0001
adversarial[:4] = (0x7F7F, 0xFF7F, 0xFF7F, 0x7F7F)
adversarial[2048 : 2048 + 127] = np.arange(1, 128)
blocks = [int(b) for b in rng.permutation(NB)[:37]]
results = {}
for order in ORDERS:
    os.environ["PAGEDKV_HARNESS_ORDER"] = order
    with CudaBackend() as gpu:
        host = HostBackend(1 << 24)
        for name, values in (("exact", exact), ("gauss", gauss), ("adversarial", adversarial)):
            raw = values.view(np.uint8)
            size = GUARD + raw.size + 2 * NB + GUARD
            g, h = gpu.alloc(size), host.alloc(size)
            for backend, p in ((gpu, g), (host, h)):
                backend.copy_h2d(np.full(size, 0x7F, np.uint8), p)   # NaN-ish padding: a stray read shows
                backend.copy_h2d(raw, p.offset(GUARD))
            # row 0: 16-byte aligned blocks (vector body); row 1: blocks starting 2 bytes off (u16 path)
            rows = lambda p: [(int(p) + GUARD, 4096, 4096), (int(p) + GUARD + 2, 4096 - 2, 4094)]
            gr, hr = gpu.create_block_regions(rows(g)), host.create_block_regions(rows(h))
            for region in (0, 1):
                got = gpu.reduce_bf16_blocks(gr, region, blocks, 0)
                want = host.reduce_bf16_blocks(hr, region, blocks, 0)
                assert tuple(got) == tuple(want), ("reduce", name, order, region, got, want)
                results.setdefault((name, region), set()).add(tuple(got))
                assert SMS > 2 or launch(-2)[0].grid[0] < len(blocks), "at 2 SMs the partial pass must wrap"
            gpu.destroy_block_regions(gr)
            gpu.free(g)
            host.free(h)
for key, values in results.items():
    assert len(values) == 1, ("reduce results depend on the CTA order", key, values)
print("CHECK reduce ok")
'''

_BODIES = {"fill": _FILL, "copy": _COPY, "reduce": _REDUCE}


def check_body(check: str, sms: int, orders=ORDERS) -> str:
    """The subprocess body of one check (`fill`, `copy` or `reduce`) on a stub of `sms` SMs;
    it prints `CHECK <name> ok` when every assertion held."""
    return _COMMON.format(sms=sms, orders=tuple(orders)) + _BODIES[check]
