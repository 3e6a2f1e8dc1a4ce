"""Where a cache's blocks are and what they cost: the seed API's addresses, strides and
per-format sizes of a `PagedKvCache`, read from its pools and its config."""

from __future__ import annotations

from ..backends.protocol import BlockRegions, DevicePtr
from ..core.config import KvCacheConfig
from ..core.validate import non_negative_int
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
    def compute_num_blocks(config: KvCacheConfig, available_bytes: int) -> int:
        """How many blocks fit in `available_bytes` across every layer's K and V pools."""
        available_bytes = non_negative_int(available_bytes, "available_bytes")
        per_block = config.block_bytes_kv_all_layers()
        if per_block <= 0:
            raise ValueError(f"a block costs {per_block} bytes: cannot size a cache")
        return available_bytes // per_block

