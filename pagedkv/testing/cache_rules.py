"""Conformance rules for the cache over the backend: the core (pools, fill, copy, block
reads and writes, checksums), token rows in mixed formats, sequences with copy-on-write
and kernel exports, and the prefix cache sharing blocks. Each runs the same steps on the
backend under test and on a HostBackend and compares every byte; all are small.
"""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from ..backends.host import HostBackend
from ..cache.paged_cache import PagedKvCache
from ..core.config import KvCacheConfig
from ..sequences.prefix_cache import PrefixCache
from ..sequences.sequence_table import SequenceTable
from .registry import expect, expect_bytes, read, rule

_MIXED = KvCacheConfig(block_size=4, num_kv_heads=2, head_dim=16, num_layers=3, dtype="bf16k_turbo3v")


def _twins(gpu: Any, config: KvCacheConfig, num_blocks: int, held: bool = False) -> list[tuple[PagedKvCache, Any]]:
    """The same cache on the backend under test and on a HostBackend, as (cache, backend),
    every block zeroed; with `held`, every block allocated (only held blocks are written)."""
    host = HostBackend(capacity_bytes=1 << 26)
    pairs = [(PagedKvCache(config, num_blocks, gpu), gpu)]
    try:
        pairs.append((PagedKvCache(config, num_blocks, host), host))
    except BaseException:
        pairs[0][0].release(gpu)
        raise
    for cache, backend in pairs:  # fresh device memory is undefined: compare only what was set
        cache.zero_blocks(range(num_blocks), backend, backend.default_stream())
        backend.synchronize(backend.default_stream())
        if held:
            cache.alloc_blocks(num_blocks)
    return pairs


def _release(pairs: list[tuple[PagedKvCache, Any]]) -> None:
    for cache, backend in pairs:
        cache.release(backend)


def _expect_same_blocks(pairs: list[tuple[PagedKvCache, Any]], what: str) -> None:
    (cache, gpu), (twin, host) = pairs
    for layer in range(cache.num_layers()):
        for block in range(cache.num_blocks()):
            got, want = cache.read_block(layer, block, gpu), twin.read_block(layer, block, host)
            for side, g, w in zip("KV", got, want):
                expect_bytes(g, w, f"{what}: layer {layer} block {block} {side}")


def _both(pairs: list[tuple[PagedKvCache, Any]], step: Callable[[PagedKvCache, Any], None]) -> None:
    for cache, backend in pairs:
        step(cache, backend)
        backend.synchronize(backend.default_stream())


@rule("cache")
def rule_cache_core(gpu: Any) -> None:
    """A PagedKvCache of mixed per-layer formats over the backend: written blocks, then
    zero_blocks, poison_block, init_blocks and copy_blocks read back byte for byte as on
    HostBackend; the BF16 checksums of the K pools match; release frees every pool (the
    runner's leak check)."""
    pairs = _twins(gpu, _MIXED, 10, held=True)
    try:
        rng = np.random.default_rng(5)
        for layer in range(_MIXED.num_layers):
            for block in range(10):
                k_values = rng.standard_normal(_MIXED.k_block_bytes_for_layer(layer) // 2)  # BF16 K: finite sums
                k = k_values.astype(ml_dtypes.bfloat16).view(np.uint8)
                v = rng.integers(0, 256, _MIXED.v_block_bytes_for_layer(layer), dtype=np.uint8)
                for cache, backend in pairs:
                    cache.write_block(layer, block, k, v, backend)
        _expect_same_blocks(pairs, "write_block")

        def steps(cache: PagedKvCache, backend: Any) -> None:
            s = backend.default_stream()
            cache.zero_blocks([1, 4], backend, s)
            cache.poison_block(7, backend, s)
            cache.init_blocks([8], backend, s)
            cache.copy_blocks([(2, 9), (5, 0), (4, 3)], backend, s)

        _both(pairs, steps)
        _expect_same_blocks(pairs, "zero, poison, init and copy")
        (cache, _), (twin, host) = pairs
        for layer in range(_MIXED.num_layers):
            row = cache.region_index(layer, "K")
            got = gpu.reduce_bf16_blocks(cache.block_regions(), row, [0, 3, 6, 9], gpu.default_stream())
            want = host.reduce_bf16_blocks(twin.block_regions(), row, [0, 3, 6, 9], 0)
            expect(np.array_equal(np.array(got), np.array(want), equal_nan=True),
                   f"layer {layer} K checksum {tuple(got)}, HostBackend gives {tuple(want)}")
    finally:
        _release(pairs)


@rule("cache")
def rule_cache_tokens(gpu: Any) -> None:
    """write_tokens of token rows into scattered slots (one skipped with -1), in BF16 K and
    turbo3 V layers, stores the same bytes as on HostBackend and read_tokens decodes the
    same values."""
    pairs = _twins(gpu, _MIXED, 6, held=True)
    try:
        rng = np.random.default_rng(9)
        slots = np.array([0, 5, -1, 13, 22, 7], np.int64)
        rows = rng.standard_normal((6, 2, 16)).astype(np.float32)
        for layer in (0, 2):
            _both(pairs, lambda c, b: c.write_tokens(layer, slots, rows, rows * 0.5, b, b.default_stream()))
        _expect_same_blocks(pairs, "write_tokens")
        (cache, _), (twin, host) = pairs
        keep = slots[slots >= 0]
        for layer in (0, 2):
            got, want = cache.read_tokens(layer, keep, gpu), twin.read_tokens(layer, keep, host)
            for side, g, w in zip("KV", got, want):
                expect(np.array_equal(g, w), f"read_tokens layer {layer} {side} differs from HostBackend")
    finally:
        _release(pairs)


@rule("cache")
def rule_cache_sequences(gpu: Any) -> None:
    """A SequenceTable over the backend: add, append and fork with a copy-on-write of the
    shared last block done on the backend; the block table, page table and slot mapping
    exports read back from device memory equal to their host arrays; blocks match
    HostBackend; release frees the export buffers and free() every block."""
    config = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")
    pairs = _twins(gpu, config, 8)
    tables = []
    try:
        for cache, backend in pairs:
            table = SequenceTable(cache, gpu=backend, stream=backend.default_stream())
            tables.append(table)
            table.add("a", list(range(6)))
            data = np.arange(cache.k_block_stride_bytes_for_layer(0), dtype=np.uint16).astype(np.uint8)
            for block in table.blocks("a"):
                cache.write_block(0, block, data, data[::-1].copy(), backend)
            table.fork("a", "b")
            table.append("b", 1)  # b writes into the shared, partly filled last block: copied first
            backend.synchronize(backend.default_stream())
        (table, twin_table), ((cache, _), _) = tables, pairs
        expect(table.blocks("b") == twin_table.blocks("b"), f"blocks {table.blocks('b')} vs {twin_table.blocks('b')}")
        expect(table.blocks("b")[-1] != table.blocks("a")[-1], "fork then append did not copy the shared last block")
        _expect_same_blocks(pairs, "copy-on-write")
        for export in (table.block_table(["a", "b"]), table.slot_mapping(["a", "b"], pad_to=12)):
            expect_bytes(read(gpu, export.device, export.host.nbytes), export.host.view(np.uint8), "an export")
        page = table.page_table(["b", "a"])
        for host_array, ptr in zip(page.host, page.device):
            expect_bytes(read(gpu, ptr, host_array.nbytes), host_array.view(np.uint8), "a page table array")
        for seq in ("a", "b"):
            table.free(seq)
        expect(cache.num_free_blocks() == 8, f"{cache.num_free_blocks()} of 8 blocks free after freeing both sequences")
    finally:
        for table, (_, backend) in zip(tables, pairs):
            table.release(backend)
        _release(pairs)


@rule("cache")
def rule_cache_prefix(gpu: Any) -> None:
    """A PrefixCache over the backend: a second sequence with the same prompt shares the
    cached blocks (their bytes as the first wrote them), eviction under pressure frees
    cached blocks for new ones, and clear() returns every block."""
    config = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(config, 6, gpu)
    table = None
    try:
        prefix = PrefixCache(cache)
        table = SequenceTable(cache, prefix, gpu=gpu, stream=gpu.default_stream())
        prompt = list(range(100, 109))
        table.add("first", prompt)
        data = np.random.default_rng(2).integers(0, 256, cache.k_block_stride_bytes_for_layer(0), dtype=np.uint8)
        first_blocks = table.blocks("first")
        cache.write_block(0, first_blocks[0], data, data, gpu)
        expect(table.cache_prefix("first") == 2, "cache_prefix of 9 tokens in blocks of 4 did not cache 2 blocks")
        table.free("first")
        hit = table.add("second", prompt)
        expect(hit == 8, f"the same prompt reused {hit} tokens, expected 8")
        expect(table.blocks("second")[:2] == first_blocks[:2], "the second sequence did not share the cached blocks")
        k, _ = cache.read_block(0, table.blocks("second")[0], gpu)
        expect_bytes(k, data, "a shared block read through the second sequence")
        table.free("second")
        table.add("other", list(range(20)))  # 5 blocks of 6: evicts cached ones
        expect(prefix.stats().evictions >= 1, "allocating past the free blocks evicted nothing")
        table.free("other")
        prefix.clear()
        expect(cache.num_free_blocks() == 6, f"{cache.num_free_blocks()} of 6 blocks free after clear()")
    finally:
        if table is not None:
            table.release(gpu)
        cache.release(gpu)
