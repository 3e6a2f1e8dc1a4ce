"""torch (the CPU build, the `interop` extra) as a real DLPack consumer of pagedkv's pools and
tables on HostBackend, and the paged-attention example of docs/INTEROP.md."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[interop]' (torch==2.13.0, CPU)")
F = pytest.importorskip("torch.nn.functional")

from pagedkv import KvCacheConfig, PagedKvCache, SequenceTable  # noqa: E402

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "INTEROP.md"


def _cache(host, dtype="bf16", num_blocks=6):
    config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype=dtype)
    return PagedKvCache(config, num_blocks=num_blocks, gpu=host)


def test_torch_reads_a_bf16_layer_as_bfloat16_blocks_zero_copy(host):
    cache = _cache(host)
    k = torch.from_dlpack(cache.k_view(1, host))
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == (6, 4, 2, 16) and k.stride() == (128, 32, 16, 1)
    assert k.data_ptr() == host.view(cache.k_pool_ptr(1), 1).__array_interface__["data"][0]
    k[2, 3, 1] = torch.arange(16, dtype=torch.bfloat16)  # torch writes, pagedkv reads
    k_bytes, v_bytes = cache.read_block(1, 2, host)
    row = k_bytes[(3 * 2 + 1) * 32 : (3 * 2 + 2) * 32].view(np.uint16)
    assert row.tolist() == torch.arange(16, dtype=torch.bfloat16).view(torch.int16).tolist()
    assert k_bytes.sum() == row.view(np.uint8).sum() and v_bytes.sum() == 0
    rows = np.full((1, 2, 16), -1.5, dtype=np.float32)  # pagedkv writes, torch reads
    cache.alloc_blocks(cache.num_free_blocks())  # writes go only into held blocks
    cache.write_tokens(1, [4 * 4 + 0], rows, rows, host, 0)
    assert k[4, 0].float().tolist() == rows[0].tolist()
    assert torch.from_dlpack(cache.v_view(1, host))[4, 0].float().tolist() == rows[0].tolist()
    del k  # the consumer lets go first: a release is refused while its tensor is alive
    cache.release(host)


def test_torch_reads_fp8_and_packed_views(host):
    fp8 = _cache(host, "fp8")
    k = torch.from_dlpack(fp8.k_view(0, host))
    assert k.dtype == torch.float8_e4m3fn and tuple(k.shape) == (6, 4, 2, 16)
    k[1, 0, 0, 0] = 2.0
    assert fp8.read_block(0, 1, host)[0][0] == 0x40  # E4M3 2.0
    packed = _cache(host, "turbo3")
    scales = torch.from_dlpack(packed.v_view(1, host).scale_view())
    assert scales.dtype == torch.uint8 and tuple(scales.shape) == (6, 4, 2) and scales.stride() == (56, 2, 1)
    scales[5, 3, 1] = 0x21
    assert packed.read_block(1, 5, host)[1][48 + 3 * 2 + 1] == 0x21
    del k, scales
    fp8.release(host)
    packed.release(host)


def test_torch_reads_every_table_export(host):
    cache = _cache(host, num_blocks=8)
    table = SequenceTable(cache, gpu=host)
    table.add("a", list(range(6)))
    table.add("b", list(range(3)))
    block_table = torch.from_dlpack(table.block_table(["a", "b"]))
    assert block_table.dtype == torch.int32 and block_table.tolist() == [[0, 1], [2, -1]]
    indptr, indices, last = (torch.from_dlpack(t) for t in table.page_table(["a", "b"]).device)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2, 3], [0, 1, 2], [2, 3])
    slots = torch.from_dlpack(table.slot_mapping(["a", "b"], pad_to=10))
    assert slots.dtype == torch.int64 and slots.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, -1]
    table.release()
    cache.release(host)


def test_paged_attention_over_the_pools_equals_attention_over_what_was_written(host):
    """Gather pages through the page table, SDPA, with a grouped-query layout (4 query heads
    over 2 KV heads); bit-equal to SDPA over the BF16-rounded K and V that were written."""
    config = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=2, dtype="bf16")
    cache = PagedKvCache(config, num_blocks=16, gpu=host)
    table = SequenceTable(cache, gpu=host)
    rng = np.random.default_rng(5)
    lengths = {"s0": 11, "s1": 4, "s2": 1}
    written = {}
    for seq_id, n in lengths.items():
        table.add(seq_id, list(range(n)))
        k, v = rng.standard_normal((2, n, 2, 16), dtype=np.float32)
        cache.write_tokens(1, table.slot_mapping([seq_id]).host, k, v, host, 0)
        written[seq_id] = k, v
    table.append("s1", 2)  # decode steps: two more tokens for s1 in a fresh block
    k_new, v_new = rng.standard_normal((2, 2, 2, 16), dtype=np.float32)
    cache.write_tokens(1, table.slot_mapping(["s1"]).host, k_new, v_new, host, 0)
    written["s1"] = tuple(np.concatenate([old, new]) for old, new in zip(written["s1"], (k_new, v_new)))

    k_pool = torch.from_dlpack(cache.k_view(1, host))
    v_pool = torch.from_dlpack(cache.v_view(1, host))
    indptr, indices, last = (torch.from_dlpack(t) for t in table.page_table(list(lengths)).device)
    assert last.tolist() == [3, 2, 1]
    for i, seq_id in enumerate(lengths):
        pages = indices[indptr[i] : indptr[i + 1]]
        n = (len(pages) - 1) * 4 + int(last[i])
        k = k_pool[pages].flatten(0, 1)[:n].float().transpose(0, 1).repeat_interleave(2, dim=0)
        v = v_pool[pages].flatten(0, 1)[:n].float().transpose(0, 1).repeat_interleave(2, dim=0)
        q = torch.from_numpy(rng.standard_normal((4, 3, 16), dtype=np.float32))
        got = F.scaled_dot_product_attention(q, k, v)
        k_ref, v_ref = (
            torch.from_numpy(x).bfloat16().float().transpose(0, 1).repeat_interleave(2, dim=0) for x in written[seq_id]
        )
        assert n == written[seq_id][0].shape[0]
        assert torch.equal(got, F.scaled_dot_product_attention(q, k_ref, v_ref)), seq_id
    for seq_id in lengths:
        table.free(seq_id)
    table.release()
    del k_pool, v_pool  # the consumer lets go first
    cache.release(host)


def test_the_interop_guide_example_runs():
    (example,) = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    namespace: dict = {}
    exec(compile(example, str(GUIDE), "exec"), namespace)
    assert namespace["cache"].num_blocks() == 0 and namespace["gpu"].live_allocations() == 0
