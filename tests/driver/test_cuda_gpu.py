"""CudaBackend on a real NVIDIA GPU: every kernel against HostBackend on the same random
data (byte-exact for fill and copy, blocks starting anywhere; the reductions exactly equal
to the host's and to math.fsum, on any data, from run to run and grid to grid),
out-of-memory, streams, pinned copies, threads.
Skipped with a reason on machines without a GPU; run them with `pytest -m cuda`."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def cuda():
    """One CudaBackend for the module, or a skip saying why there is none."""
    from pagedkv import driver

    if not driver.is_available():
        pytest.skip("no CUDA driver or GPU on this machine")
    backend = driver.CudaBackend()
    yield backend
    backend.close()


@pytest.fixture
def host():
    return HostBackend(capacity_bytes=1 << 30)


# (block bytes, stride, base offset) per region: blocks starting on 16 bytes, and blocks
# starting elsewhere (odd sizes, strides that are not multiples of 16, offset bases) whose
# heads are peeled before the vector body; copies between blocks of different skews
ROW_SHAPES = [
    (65536, 65536, 0), (4096, 4096, 0), (1000, 1008, 0), (777, 800, 0), (6, 24, 0), (4096, 4112, 0),
    (4096, 4096, 6), (5000, 5003, 1), (300, 301, 9), (33, 40, 15), (4098, 4100, 2),
]
NUM_BLOCKS = 40


class Mirrored:
    """The same pools, with the same random bytes, on the GPU and on the host."""

    def __init__(self, cuda, host, seed: int, shapes=ROW_SHAPES, num_blocks=NUM_BLOCKS):
        rng = np.random.default_rng(seed)
        self.cuda, self.host = cuda, host
        self.pools = []
        g_rows, h_rows = [], []
        for nbytes, stride, offset in shapes:
            size = stride * num_blocks + offset + 16  # guard bytes after the last block
            data = rng.integers(0, 256, size, dtype=np.uint8)
            g, h = cuda.alloc(size), host.alloc(size)
            cuda.copy_h2d(data, g)
            host.copy_h2d(data, h)
            self.pools.append((g, h, size))
            g_rows.append((int(g) + offset, stride, nbytes))
            h_rows.append((int(h) + offset, stride, nbytes))
        self.g_regions = cuda.create_block_regions(g_rows)
        self.h_regions = host.create_block_regions(h_rows)

    def assert_equal(self) -> None:
        self.cuda.synchronize(0)
        for r, (g, h, size) in enumerate(self.pools):
            out = np.empty(size, np.uint8)
            self.cuda.copy_d2h(g, out)
            diff = np.flatnonzero(out != self.host.view(h, size))
            assert diff.size == 0, f"region {r}: {diff.size} bytes differ, first at {diff[:5].tolist()}"

    def release(self) -> None:
        self.cuda.destroy_block_regions(self.g_regions)
        for g, h, _ in self.pools:
            self.cuda.free(g)
            self.host.free(h)


def test_fill_blocks_matches_host_byte_for_byte(cuda, host):
    m = Mirrored(cuda, host, seed=1)
    rng = np.random.default_rng(2)
    try:
        for value in (0x00, 0xFF, 0x3C):
            blocks = rng.choice(NUM_BLOCKS, size=int(rng.integers(1, NUM_BLOCKS)), replace=False)
            cuda.fill_blocks(m.g_regions, blocks, value, 0)
            host.fill_blocks(m.h_regions, blocks, value, 0)
            m.assert_equal()
    finally:
        m.release()


def test_copy_blocks_matches_host_byte_for_byte(cuda, host):
    m = Mirrored(cuda, host, seed=3)
    rng = np.random.default_rng(4)
    try:
        for _ in range(3):
            perm = rng.permutation(NUM_BLOCKS)
            n = int(rng.integers(1, NUM_BLOCKS // 2))
            src, dst = perm[:n], perm[n : 2 * n]
            cuda.copy_blocks(m.g_regions, src, dst, 0)
            host.copy_blocks(m.h_regions, src, dst, 0)
            m.assert_equal()
    finally:
        m.release()


def exactly_summable_bf16(rng, count: int) -> np.ndarray:
    """BF16 values whose sums, squares and |x| sums are exact in float64 in any order
    (8-bit mantissas, magnitudes in [1/4, 8), a few zeros), so GPU and host must agree exactly."""
    mantissa = rng.integers(128, 256, count)
    exponent = rng.integers(-2, 3, count) - 7
    sign = rng.choice([-1.0, 1.0], count)
    values = sign * mantissa * np.exp2(exponent)
    values[rng.random(count) < 0.01] = 0.0
    return values.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("num_blocks", [1, 7, 3000])
def test_reduce_bf16_equals_host_float64_sums(cuda, host, num_blocks):
    rng = np.random.default_rng(num_blocks)
    block_bytes = 4096
    values = exactly_summable_bf16(rng, num_blocks * block_bytes // 2)
    raw = values.view(np.uint8)
    g, h = cuda.alloc(raw.size), host.alloc(raw.size)
    try:
        cuda.copy_h2d(raw, g)
        host.copy_h2d(raw, h)
        g_regions = cuda.create_block_regions([(int(g), block_bytes, block_bytes)])
        h_regions = host.create_block_regions([(int(h), block_bytes, block_bytes)])
        blocks = rng.permutation(num_blocks)[: max(1, num_blocks - 1)] if num_blocks > 1 else [0]
        got = cuda.reduce_bf16_blocks(g_regions, 0, blocks, 0)
        want = host.reduce_bf16_blocks(h_regions, 0, blocks, 0)
        x = values.astype(np.float64).reshape(num_blocks, -1)[np.asarray(blocks)]
        assert want == (x.sum(), (x * x).sum(), np.abs(x).sum())
        assert got == want
        cuda.destroy_block_regions(g_regions)
    finally:
        cuda.free(g)
        host.free(h)


def adversarial_bf16_bits(rng, count: int) -> np.ndarray:
    """Finite BF16 bit patterns a float64 accumulation gets wrong: random bits over every
    exponent, +-max finite pairs that cancel, every subnormal."""
    bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    bits[((bits >> 7) & 0xFF) == 0xFF] = 0x0003
    bits[: 4] = (0x7F7F, 0xFF7F, 0xFF7F, 0x7F7F)
    bits[100 : 100 + 127] = np.arange(1, 128, dtype=np.uint16)
    return bits


@pytest.mark.parametrize("offset", [0, 2, 6, 14])
def test_reduce_bf16_is_exact_on_adversarial_data_and_unaligned_blocks(cuda, host, offset):
    """The exact checksum: equal to math.fsum over the float64 values and squares, with
    blocks starting on every even offset from a 16-byte boundary (the u16 head path)."""
    import math

    rng = np.random.default_rng(offset)
    block_bytes, stride, num_blocks = 2054, 2070, 300
    bits = adversarial_bf16_bits(rng, (stride * num_blocks + offset + 16) // 2)
    g, h = cuda.alloc(bits.nbytes), host.alloc(bits.nbytes)
    try:
        cuda.copy_h2d(bits, g)
        host.copy_h2d(bits, h)
        g_regions = cuda.create_block_regions([(int(g) + offset, stride, block_bytes)])
        h_regions = host.create_block_regions([(int(h) + offset, stride, block_bytes)])
        blocks = rng.permutation(num_blocks)[:257]
        got = cuda.reduce_bf16_blocks(g_regions, 0, blocks, 0)
        raw = bits.view(np.uint8)
        x = np.concatenate([
            raw[offset + b * stride : offset + b * stride + block_bytes].view(np.uint16) for b in blocks
        ]).view(ml_dtypes.bfloat16).astype(np.float64).tolist()
        assert got == (math.fsum(x), math.fsum(v * v for v in x), math.fsum(abs(v) for v in x))
        assert got == host.reduce_bf16_blocks(h_regions, 0, blocks, 0)
        cuda.destroy_block_regions(g_regions)
    finally:
        cuda.free(g)
        host.free(h)


def test_reduce_bf16_is_bit_identical_run_to_run(cuda, host):
    rng = np.random.default_rng(9)
    values = rng.normal(scale=3.0, size=2000 * 2048).astype(ml_dtypes.bfloat16)  # not exactly summable
    raw = values.view(np.uint8)
    g, h = cuda.alloc(raw.size), host.alloc(raw.size)
    try:
        cuda.copy_h2d(raw, g)
        host.copy_h2d(raw, h)
        g_regions = cuda.create_block_regions([(int(g), 4096, 4096)])
        h_regions = host.create_block_regions([(int(h), 4096, 4096)])
        blocks = rng.permutation(2000)
        stream = cuda.create_stream()
        runs = {cuda.reduce_bf16_blocks(g_regions, 0, blocks, s) for s in (0, stream, 0, stream, 0)}
        assert len(runs) == 1, runs
        (got,) = runs
        want = host.reduce_bf16_blocks(h_regions, 0, blocks, 0)
        assert got == want, (got, want)
        cuda.destroy_stream(stream)
        cuda.destroy_block_regions(g_regions)
    finally:
        cuda.free(g)
        host.free(h)


def test_out_of_memory_is_a_cuda_error_and_the_backend_stays_usable(cuda):
    from pagedkv.driver import CudaError, CudaOutOfMemory
    from pagedkv.errors import DeviceOutOfMemory

    free_before, total = cuda.mem_info()
    huge = total + (64 << 30)
    with pytest.raises(CudaError) as info:
        cuda.alloc(huge)
    err = info.value
    assert isinstance(err, CudaOutOfMemory) and isinstance(err, DeviceOutOfMemory)
    assert str(err) == f"cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory) asking {huge / 2**30:.1f} GiB"
    ptr = cuda.alloc(1 << 20)
    cuda.memset_async(ptr, 0x11, 1 << 20, 0)
    out = np.empty(1 << 20, np.uint8)
    cuda.copy_d2h(ptr, out)
    assert (out == 0x11).all()
    cuda.free(ptr)


def test_streams_pinned_copies_and_other_threads(cuda):
    size = 8 << 20
    a, b = cuda.alloc(size), cuda.alloc(size)
    s1, s2 = cuda.create_stream(), cuda.create_stream()
    pin = cuda.alloc_pinned(size)
    try:
        pin.array[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
        expect = pin.array.copy()
        cuda.copy_h2d_async(pin, a, s1)
        cuda.synchronize(s1)
        cuda.copy_d2d(a, b, size, s2)
        cuda.synchronize(s2)
        pin.array[:] = 0
        errors = []

        def read_back():
            try:
                cuda.copy_d2h_async(b, pin, s1)
                cuda.synchronize(s1)
            except BaseException as err:  # noqa: BLE001 - reported by the main thread
                errors.append(err)

        worker = threading.Thread(target=read_back)
        worker.start()
        worker.join()
        assert not errors, errors
        assert np.array_equal(pin.array, expect)
    finally:
        pin.free()
        cuda.destroy_stream(s1)
        cuda.destroy_stream(s2)
        cuda.free(a)
        cuda.free(b)


def test_paged_cache_on_cuda_matches_host(cuda, host):
    config = KvCacheConfig(block_size=16, num_kv_heads=2, head_dim=64, num_layers=4, dtype="bf16k_turbo3v")
    rng = np.random.default_rng(6)
    caches = [(PagedKvCache(config, 32, cuda), cuda), (PagedKvCache(config, 32, host), host)]
    for cache, _ in caches:
        cache.alloc_blocks(32)  # only held blocks may be written
    try:
        for layer in range(config.num_layers):
            for block in range(32):
                k = rng.integers(0, 256, config.k_block_bytes_for_layer(layer), dtype=np.uint8)
                v = rng.integers(0, 256, config.v_block_bytes_for_layer(layer), dtype=np.uint8)
                for cache, backend in caches:
                    cache.write_block(layer, block, k, v, backend)
        for cache, backend in caches:
            cache.zero_blocks([1, 4, 30], backend, 0)
            cache.poison_block(7, backend, 0)
            cache.copy_blocks([(2, 9), (5, 10), (4, 11), (31, 0)], backend, 0)
            backend.synchronize(0)
        for layer in range(config.num_layers):
            for block in range(32):
                (gk, gv), (hk, hv) = (cache.read_block(layer, block, backend) for cache, backend in caches)
                assert np.array_equal(gk, hk) and np.array_equal(gv, hv), (layer, block)
    finally:
        for cache, backend in caches:
            cache.release(backend)
