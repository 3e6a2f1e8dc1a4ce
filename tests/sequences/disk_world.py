"""A three-tier world for the disk tests: a cache, a host tier, a disk tier in a directory,
a prefix cache and a table on a HostBackend, with block contents that are a function of
the block's tokens (so another process can say what a block must hold)."""

from __future__ import annotations

import numpy as np

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.tiers.disk_tier import DiskTier
from pagedkv.tiers.host_tier import HostTier

BS = 4
CONFIG = KvCacheConfig(block_size=BS, num_kv_heads=2, head_dim=32, num_layers=2, dtype="bf16",
                       layer_dtypes=("bf16", "turbo4k_turbo3v"), layer_dims=((2, 32), (1, 64)))


def content(cache: PagedKvCache, layer: int, first_token: int) -> tuple[np.ndarray, np.ndarray]:
    """The K and V bytes a block whose first token id is `first_token` holds in `layer`."""
    rng = np.random.default_rng([first_token, layer])
    k = rng.integers(0, 256, cache.k_block_stride_bytes_for_layer(layer), dtype=np.uint8)
    v = rng.integers(0, 256, cache.v_block_stride_bytes_for_layer(layer), dtype=np.uint8)
    return k, v


def prompt(chain: int, blocks: int, shared: int = 0) -> list[int]:
    """A prompt of `blocks` whole blocks plus one token: its first `shared` blocks are chain
    0's, the rest chain `chain`'s; every block's tokens are its own (first ids differ)."""
    out: list[int] = []
    for j in range(blocks):
        base = (0 if j < shared else chain) * 10_000 + j * BS
        out.extend(range(base, base + BS))
    return out + [9_999_999]


class DiskWorld:
    """The tiers over `directory`: `device`, `host` blocks, `disk_bytes` of disk."""

    def __init__(self, directory, device: int = 4, host: int = 3, disk_bytes: int | None = 1 << 20,
                 config: KvCacheConfig = CONFIG, gpu=None, events: list | None = None, **disk_args):
        self.gpu = gpu or HostBackend(capacity_bytes=1 << 26)
        self.cache = PagedKvCache(config, device, self.gpu)
        self.tier = HostTier(self.cache, host, self.gpu)
        self.disk = DiskTier(directory, disk_bytes, **disk_args)
        self.events = events
        self.prefix = PrefixCache(self.cache, on_event=None if events is None else events.append,
                                  host_tier=self.tier, disk_tier=self.disk)
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)

    def fill(self, seq_id, tokens: list[int]) -> None:
        """Add `tokens`, write the content of every full block not matched, and free: the
        blocks are cached."""
        matched = self.table.add(seq_id, tokens) // BS
        for i, block in enumerate(self.table.blocks(seq_id)[: len(tokens) // BS]):
            if i < matched:
                continue
            for layer in range(self.cache.num_layers()):
                self.cache.write_block(layer, block, *content(self.cache, layer, tokens[i * BS]), self.gpu)
        self.table.free(seq_id)

    def pressure(self) -> None:
        """Allocate every device block and free them: cached blocks move down a tier."""
        held = self.cache.alloc_blocks(self.cache.num_blocks())
        self.cache.free_blocks(held)

    def served(self, seq_id, tokens: list[int]) -> int:
        """Add `tokens`; assert every matched block holds its content and write the content
        of the other full blocks (as the engine computes them); returns the matched token
        count (the sequence stays added)."""
        matched = self.table.add(seq_id, tokens)
        for i, block in enumerate(self.table.blocks(seq_id)[: len(tokens) // BS]):
            for layer in range(self.cache.num_layers()):
                want_k, want_v = content(self.cache, layer, tokens[i * BS])
                if i >= matched // BS:
                    self.cache.write_block(layer, block, want_k, want_v, self.gpu)
                    continue
                k, v = self.cache.read_block(layer, block, self.gpu)
                assert (k == want_k).all() and (v == want_v).all(), (seq_id, i, layer)
        return matched

    def close(self) -> None:
        self.table.release(self.gpu)
        self.prefix.close()
        self.disk.close()
        self.tier.release(self.gpu)
        self.cache.release(self.gpu)
