"""The exact every-format checksum kernels (pagedkv_kv_checksum_* in nvrtc_src/kv_rows.cu)
executed on the CPU by the kernel harness, through CudaBackend and the libcuda stub: the
diagnostics events on CudaBackend (device reduction) equal HostBackend's (host decode)
and math.fsum over the host decode, for every format and asymmetric pair, block sizes
1/16/32, head_dim 48/64/128/256/512, encoded rows, garbage bytes and NaN/inf inputs, two
CTA orders, at 2 and 132 SMs (kernel_harness/kv_checksum_checks.py says what each case
holds); and the checksum calls never copy pool bytes to the host.
"""

from __future__ import annotations

import pytest

from kernel_harness.kv_checksum_checks import CASES, checksum_case_body
from kernel_harness.stub import run_on_stub


_CASES = sorted(set(CASES) - {"mutation_small"})  # that one runs in the mutation test
# every case at 2 SMs (each CTA's partial pass loops over several blocks); the all-format
# case again at 132 (one block or none per CTA, most partials empty)
_RUNS = [(case, 2) for case in _CASES] + [("all_formats_hd128_bs16", 132)]


@pytest.mark.parametrize("case,sms", _RUNS, ids=[f"{c}-{s}" for c, s in _RUNS])
def test_device_checksums_equal_host_checksums_and_fsum(stub_env, case, sms):
    out = run_on_stub(stub_env, checksum_case_body(case, sms), timeout=300)
    assert "CHECK checksum ok" in out


def test_checksums_never_copy_pool_bytes_to_the_host(stub_env):
    """debug_kv_checksum_per_layer and debug_kv_per_block on CudaBackend, every format: the
    only device-to-host copies are the result words of each side's reduction (one per side
    and region), none from a pool, and every such copy goes through the one entry point
    watched here; the events equal HostBackend's."""
    out = run_on_stub(stub_env, '''
        from cuda.bindings import driver as D
        from structlog.testing import capture_logs
        from pagedkv import HostBackend, KvCacheConfig, PagedKvCache
        from pagedkv.driver import CudaBackend
        from pagedkv.core.exact_sum import F32_RESULT_WORDS, RESULT_WORDS

        formats = ("fp8", "bf16", "nvfp4", "turbo4", "turbo3", "turbo2", "turbo8", "fp8k_turbo2v")
        cfg = KvCacheConfig(block_size=16, num_kv_heads=2, head_dim=64, num_layers=len(formats), dtype="bf16",
                            layer_dtypes=formats)
        rng = np.random.default_rng(4)
        rows = {layer: (rng.normal(size=(32, 2, 64)).astype(np.float32), rng.normal(size=(32, 2, 64)).astype(np.float32))
                for layer in range(len(formats))}

        def checksums(gpu, stream):
            cache = PagedKvCache(cfg, 2, gpu)
            cache.alloc_blocks(2)
            for layer, (k, v) in rows.items():
                cache.write_tokens(layer, np.arange(32, dtype=np.int64), k, v, gpu, stream)
            gpu.synchronize(stream)
            pools = [(int(cache.k_pool_ptr(layer)), int(cache.v_pool_ptr(layer)), cache.k_block_stride_bytes_for_layer(layer),
                      cache.v_block_stride_bytes_for_layer(layer)) for layer in range(len(formats))]
            copies = []
            real = D.cuMemcpyDtoHAsync

            def spy(dst, src, nbytes, s):
                copies.append((int(src), int(nbytes)))
                return real(dst, src, nbytes, s)

            before = calls("cuMemcpyDtoHAsync"), calls("cuMemcpyDtoH")
            D.cuMemcpyDtoHAsync = spy
            try:
                with capture_logs() as logs:
                    cache.debug_kv_checksum_per_layer([1, 0, 1], 1, gpu, stream, "t")
                    cache.debug_kv_per_block(6, [1, 0], gpu, stream, "t")
            finally:
                D.cuMemcpyDtoHAsync = real
            after = calls("cuMemcpyDtoHAsync"), calls("cuMemcpyDtoH")
            if hasattr(gpu, "reduce_kv_blocks"):   # bad arguments are refused before any launch
                launches, pools_of = STUB.stub_launch_count(), cache.pools()
                from pagedkv import KvCacheDtype
                for bad, error in (((0, [2], KvCacheDtype.FP8, 16, 128), "block 2 out of range"),
                                   ((0, [0], KvCacheDtype.NVFP4, 16, 128), "region 0 holds 2048-byte blocks; nvfp4"),
                                   ((0, [0], KvCacheDtype.FP8, 16, 120), "row_elements must be a multiple of 16"),
                                   ((0, [-1], KvCacheDtype.FP8, 16, 128), "negative block index -1")):
                    try:
                        gpu.reduce_kv_blocks(pools_of.regions(), *bad, stream)
                    except (IndexError, ValueError) as err:
                        assert error in str(err), (bad, err)
                    else:
                        raise AssertionError(("accepted", bad))
                assert STUB.stub_launch_count() == launches
            cache.release(gpu)
            return logs, copies, pools, before, after

        host_logs = checksums(HostBackend(1 << 26), 0)[0]
        with CudaBackend() as gpu:
            stream = gpu.create_stream()
            logs, copies, pools, before, after = checksums(gpu, stream)
            gpu.destroy_stream(stream)
        assert logs == host_logs and len(logs) == len(formats) * 4 + 2, (logs, host_logs)
        assert after[0] - before[0] == len(copies) and after[1] == before[1], (before, after, len(copies))
        assert len(copies) == len(formats) * 2 * 2 + 2 * 2, len(copies)
        assert {n for _, n in copies} == {8 * RESULT_WORDS, 8 * F32_RESULT_WORDS}, copies
        for src, n in copies:
            for k_pool, v_pool, k_stride, v_stride in pools:
                for pool, stride in ((k_pool, k_stride), (v_pool, v_stride)):
                    assert not (pool <= src < pool + 2 * stride), ("a pool byte copied to the host", src, n)
        print("CHECK no pool bytes ok")
    ''')
    assert "CHECK no pool bytes ok" in out
