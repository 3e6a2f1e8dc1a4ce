"""copy_batch_async on a real GPU (`cuda` marker; skipped without one, and run over the
libcuda stub by test_driver_stub's whole-suite test): swap out and swap in of unaligned
ranges through both paths, byte for byte, ordered by an event on another stream."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

SIZE = 3 << 20


def _ranges(rng, count, span):
    """count (src offset, dst offset, size) with disjoint destinations, odd sizes and offsets."""
    sizes = rng.integers(1, span // (2 * count), count)
    starts = np.cumsum(np.concatenate([[int(rng.integers(0, 64))], sizes[:-1] + rng.integers(1, 4096, count - 1)]))
    srcs = rng.integers(0, span - int(sizes.max()), count)
    return [(int(s), int(d), int(n)) for s, d, n in zip(srcs, starts, sizes)]


@pytest.mark.parametrize("mode", ["auto", "kernel"])
def test_swap_out_and_in_are_byte_exact(cuda_session, mode):
    from pagedkv.driver import CudaBackend

    gpu = cuda_session if mode == "auto" else CudaBackend(copy_batch="kernel")
    try:
        rng = np.random.default_rng(12)
        producer, copier = gpu.create_stream(), gpu.create_stream()
        dev = gpu.alloc(SIZE)
        swap = gpu.alloc_swap_memory(SIZE)
        data = rng.integers(0, 256, SIZE, dtype=np.uint8)
        swap.array[:] = 0
        gpu.copy_h2d(np.zeros(SIZE, np.uint8), dev)
        staged = gpu.alloc_pinned(SIZE)
        staged.array[:] = data
        gpu.copy_h2d_async(staged.array, dev, producer)  # the data arrives on another stream
        event = gpu.record_event(producer)
        gpu.stream_wait_event(copier, event)
        out = _ranges(rng, 40, SIZE)
        gpu.copy_batch_async([swap.address + d for _, d, _ in out], [int(dev) + s for s, _, _ in out],
                             [n for _, _, n in out], copier)
        done = gpu.record_event(copier)
        gpu.wait_event(done)
        assert gpu.event_done(done) and gpu.event_done(event)
        want = np.zeros(SIZE, np.uint8)
        for s, d, n in out:
            want[d:d + n] = data[s:s + n]
        assert np.array_equal(swap.array, want)
        # swap in: the host bytes back to other device offsets
        back = _ranges(rng, 40, SIZE)
        gpu.copy_batch_async([int(dev) + d for _, d, _ in back], [swap.address + s for s, _, _ in back],
                             [n for _, _, n in back], copier)
        gpu.synchronize(copier)
        got = np.empty(SIZE, np.uint8)
        gpu.copy_d2h(dev, got)
        expect = data.copy()
        for s, d, n in back:
            expect[d:d + n] = want[s:s + n]
        assert np.array_equal(got, expect)
        for e in (event, done):
            gpu.destroy_event(e)
        staged.free()
        swap.free()
        gpu.free(dev)
        gpu.destroy_stream(producer)
        gpu.destroy_stream(copier)
    finally:
        if gpu is not cuda_session:
            gpu.close()
