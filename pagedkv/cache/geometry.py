"""Where a cache's blocks are and what they cost: the seed API's addresses, strides and
per-format sizes of a `PagedKvCache`, read from its pools and its config."""

from __future__ import annotations

from ..backends.protocol import BlockRegions, DevicePtr
from ..core.config import KvCacheConfig
from ..core.validate import non_negative_int
from ..groups.layout import split_budget
from ..kv.pools import KvPools


class CacheGeometry:
    """The addresses and sizes half of `PagedKvCache` (it sets `_pools` and `_config`)."""

    _pools: KvPools
    _config: KvCacheConfig

    def block_regions(self) -> BlockRegions:
        """The backend region table: row per layer, K then V (V absent under `v_aliases_k`)."""
        return self._pools.regions()

    def region_index(self, layer: int, side: str) -> int:
        """The row of `block_regions()` holding `layer`'s `side` ("K" or "V") pool."""
        return self._pools.region_index(layer, side)

    def k_cache_ptr(self, layer: int, block: int) -> DevicePtr:
        """Device address of `block` in `layer`'s K pool."""
        return self._pools.k_block_ptr(layer, block)

    def v_cache_ptr(self, layer: int, block: int) -> DevicePtr:
        """Device address of `block` in `layer`'s V pool (the K block under `v_aliases_k`)."""
        return self._pools.v_block_ptr(layer, block)

    def k_pool_ptr(self, layer: int) -> DevicePtr:
        """Base address of `layer`'s K pool."""
        return self._pools.k_pool(layer)

    def v_pool_ptr(self, layer: int) -> DevicePtr:
        """Base address of `layer`'s V pool (the K pool under `v_aliases_k`)."""
        return self._pools.v_pool(layer)

    def cache_stride(self) -> int:
        """Elements per block side at the global dims."""
        return self._config.cache_stride_elements()

    def block_stride_bytes(self) -> int:
        """Bytes of one block side at the global dtype and dims (K side)."""
        return self._config.block_bytes()

    def block_stride_bytes_for_layer(self, layer: int) -> int:
        """Bytes between consecutive blocks of `layer`'s K pool."""
        return self.k_block_stride_bytes_for_layer(layer)

    def k_block_stride_bytes_for_layer(self, layer: int) -> int:
        """Bytes between consecutive blocks of `layer`'s K pool."""
        return self._pools.k_stride(layer)

    def v_block_stride_bytes_for_layer(self, layer: int) -> int:
        """Bytes between consecutive blocks of `layer`'s V pool (the K stride under aliasing)."""
        return self._pools.v_stride(layer)

    def nvfp4_data_bytes(self) -> int:
        """See `KvCacheConfig.nvfp4_data_bytes`."""
        return self._config.nvfp4_data_bytes()

    def turbo4_data_bytes(self) -> int:
        """See `KvCacheConfig.turbo4_data_bytes`."""
        return self._config.turbo4_data_bytes()

    def turbo4_scale_bytes(self) -> int:
        """See `KvCacheConfig.turbo4_scale_bytes`."""
        return self._config.turbo4_scale_bytes()

    def turbo3_data_bytes(self) -> int:
        """See `KvCacheConfig.turbo3_data_bytes`."""
        return self._config.turbo3_data_bytes()

    def turbo2_data_bytes(self) -> int:
        """See `KvCacheConfig.turbo2_data_bytes`."""
        return self._config.turbo2_data_bytes()

    def turbo8_data_bytes(self) -> int:
        """See `KvCacheConfig.turbo8_data_bytes`."""
        return self._config.turbo8_data_bytes()

    def config(self) -> KvCacheConfig:
        """The configuration the cache was built with."""
        return self._config

    def dtype(self):
        """The global storage format."""
        return self._config.dtype

    def dtype_for_layer(self, layer: int):
        """The storage format of `layer`."""
        return self._config.dtype_for_layer(layer)

    def block_size(self) -> int:
        """Tokens per block."""
        return self._config.block_size

    def num_layers(self) -> int:
        """Layers in the cache."""
        return self._config.num_layers

    @staticmethod
    def compute_num_blocks(config: KvCacheConfig, available_bytes: int, context: int | None = None,
                           concurrency: int = 1, checkpoints_per_seq: int | None = None):
        """How many blocks fit in `available_bytes` across every layer's K and V pools. For a
        config with `layer_groups`, the budget is split across the groups for `concurrency`
        sequences of `context` tokens (required there): a list with one count per group
        (blocks, or state slots: one live slot per sequence and the checkpoint slots a
        sequence of `context` tokens can hold, `GroupLayout.checkpoints_per_sequence`, or
        `checkpoints_per_seq` when given: 0 for a table without a prefix cache), the
        `num_blocks` / `num_state_slots` a hybrid `PagedKvCache` takes (see
        `pagedkv.groups.layout.split_budget`)."""
        if config.layer_groups:
            if context is None:
                raise ValueError("a config with layer_groups is sized for a context: give context= (tokens)")
            return [row.count for row in split_budget(config, available_bytes, context, concurrency,
                                                      checkpoints_per_seq)]
        available_bytes = non_negative_int(available_bytes, "available_bytes")
        per_block = config.block_bytes_kv_all_layers()
        if per_block <= 0:
            raise ValueError(f"a block costs {per_block} bytes: cannot size a cache")
        return available_bytes // per_block

