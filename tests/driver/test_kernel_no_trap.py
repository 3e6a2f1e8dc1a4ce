"""No kernel kills the shared CUDA context (issue 19): no `__trap()` in any kernel source, and
the reductions, which used to trap on a block size other than REDUCE_THREADS, give the exact
result at any block size (they loop by blockDim.x), over the libcuda stub."""

from __future__ import annotations

import re

from pagedkv.driver import nvrtc

from kernel_harness.stub import run_on_stub


def test_no_kernel_source_calls_trap():
    for path in nvrtc.kernel_sources():
        code = re.sub(r"//[^\n]*", "", path.read_text())
        assert "__trap" not in code, f"{path.name} calls __trap(), which kills every library's context"


def test_reductions_at_another_block_size_give_the_exact_result(stub_env):
    run_on_stub(stub_env, '''
        from pagedkv.driver import CudaBackend
        from pagedkv.backends.protocol import BlockRegions
        from pagedkv.core.exact_sum import RESULT_WORDS, F32_RESULT_WORDS, bf16_stats, stats_from_words, stats_from_f32_words
        rng = np.random.default_rng(7)
        values = rng.normal(size=3 * 2048).astype(np.float32).view(np.uint32) >> 16
        values = values.astype(np.uint16)
        values[5] = 0x7FC0  # a NaN in one block: every result NaN
        with CudaBackend() as gpu:
            pool = gpu.alloc(values.nbytes)
            gpu.copy_h2d(values, pool)
            idx, partials, out = gpu.alloc(12), gpu.alloc(8 * RESULT_WORDS * 3), gpu.alloc(8 * RESULT_WORDS)
            for blocks, want_nan in (([1, 2], False), ([0, 2, 1], True)):
                gpu.copy_h2d(np.asarray(blocks, np.int32), idx)
                _, partial = raw_kernel("reduce_bf16.cu", "pagedkv_reduce_bf16_partial")
                _, final = raw_kernel("reduce_bf16.cu", "pagedkv_reduce_bf16_final")
                for threads in (32, 96, 128):
                    assert raw_launch(partial, 3, threads, 0, ctypes.c_int64(int(pool)), ctypes.c_int64(4096),
                                      ctypes.c_int64(4096), ctypes.c_uint64(int(idx)), ctypes.c_int32(len(blocks)),
                                      ctypes.c_uint64(int(partials))) == 0
                    assert raw_launch(final, 1, threads, 0, ctypes.c_uint64(int(partials)), ctypes.c_int32(3),
                                      ctypes.c_uint64(int(out))) == 0
                    gpu.synchronize(0)
                    words = np.zeros(RESULT_WORDS, np.int64)
                    gpu.copy_d2h(out, words)
                    got = stats_from_words(words.tolist())
                    want = bf16_stats(np.concatenate([values[2048 * b: 2048 * (b + 1)] for b in blocks]))
                    if want_nan:
                        assert all(x != x for x in got), got
                    else:
                        assert tuple(got) == tuple(want), (threads, got, want)
            for p in (pool, idx, partials, out):
                gpu.free(p)
        print("ok")
    ''')
