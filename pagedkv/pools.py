"""KvPools: every layer's K and V pool on a backend, their strides and the block-region table.

A pool is one backend allocation of `num_blocks` blocks of its side's stride; under
`v_aliases_k` a layer's V pool is its K pool. The region table has a row per pool, K then V
per layer. Pools are freed only by `release`, on the backend that allocated them; a pool
whose free fails stays recorded, so a later `release` retries it.
"""

from __future__ import annotations

from .backend import BlockRegions, DevicePtr, GpuBackend
from .config import KvCacheConfig
from .errors import KvCacheError
from .log import get_logger
from .validate import block_index, positive_int

_log = get_logger("pools")


class KvPools:
    """The K and V pools of every layer of `config`, `num_blocks` blocks each, on `gpu`.
    Construction is all or nothing: a failed allocation frees what was allocated."""

    def __init__(self, config: KvCacheConfig, num_blocks: int, gpu: GpuBackend):
        if not isinstance(config, KvCacheConfig):
            raise TypeError(f"config must be a KvCacheConfig, got {type(config).__name__}")
        num_blocks = positive_int(num_blocks, "num_blocks")
        if gpu is None or not isinstance(gpu, GpuBackend):
            raise TypeError(f"gpu must be a GpuBackend (HostBackend, CudaBackend), got {type(gpu).__name__} {gpu!r:.60}")
        self._config = config
        self._num_blocks = num_blocks
        self._gpu = gpu
        layers = range(config.num_layers)
        self._k_stride = [config.k_block_bytes_for_layer(i) for i in layers]
        self._v_stride = [
            self._k_stride[i] if config.v_aliases_k else config.v_block_bytes_for_layer(i) for i in layers
        ]
        self._k_pools: list[DevicePtr] = []
        self._v_pools: list[DevicePtr] = []
        self._owned: list[DevicePtr] = []  # distinct allocations not yet freed
        self._regions: BlockRegions | None = None
        self._live = True
        try:
            self._allocate(gpu)
        except BaseException:
            self._live = False
            self._free_owned(gpu, raise_first=False)
            raise

    def _allocate(self, gpu: GpuBackend) -> None:
        rows = []
        for layer in range(self._config.num_layers):
            k_pool = gpu.alloc(self._num_blocks * self._k_stride[layer])
            self._owned.append(k_pool)
            self._k_pools.append(k_pool)
            rows.append((int(k_pool), self._k_stride[layer], self._k_stride[layer]))
            if self._config.v_aliases_k:
                self._v_pools.append(k_pool)
            else:
                v_pool = gpu.alloc(self._num_blocks * self._v_stride[layer])
                self._owned.append(v_pool)
                self._v_pools.append(v_pool)
                rows.append((int(v_pool), self._v_stride[layer], self._v_stride[layer]))
        self._regions = gpu.create_block_regions(rows)

    # -- release ----------------------------------------------------------------------

    def check_backend(self, gpu: object) -> None:
        """KvCacheError unless `gpu` is the backend the pools were allocated on."""
        if gpu is not self._gpu:
            raise KvCacheError(
                f"release with {type(gpu).__name__} {gpu!r:.60}: the pools were allocated on "
                f"{type(self._gpu).__name__} {self._gpu!r:.60}; release them with that backend"
            )

    def release(self, gpu: GpuBackend) -> None:
        """Free the region table and every pool on `gpu`, which must be the backend that
        allocated them (KvCacheError before anything is forgotten otherwise). Every free is
        attempted, after every stream of `gpu` has finished its queued work; what failed
        stays recorded and the first error is raised, so a second call retries just those.
        A call with nothing left to free does nothing."""
        self.check_backend(gpu)
        if self._owned or self._regions is not None:
            gpu.synchronize_all()  # queued work on any stream may still touch the pools
        self._live = False
        self._k_pools, self._v_pools = [], []
        self._free_owned(gpu, raise_first=True)

    def _free_owned(self, gpu: GpuBackend, raise_first: bool) -> None:
        first: BaseException | None = None
        if self._regions is not None:
            try:
                gpu.destroy_block_regions(self._regions)
                self._regions = None
            except Exception as err:  # noqa: BLE001 - every pool must still be attempted
                first = err
                _log.error("kv_region_table_free_failed", error=str(err))
        kept = []
        for pool in self._owned:
            try:
                gpu.free(pool)
            except Exception as err:  # noqa: BLE001 - every pool must be attempted
                kept.append(pool)
                first = first or err
                _log.error("kv_pool_free_failed", pool=repr(pool), error=str(err))
        self._owned = kept
        if first is not None and raise_first:
            raise first

    def pending(self) -> int:
        """How many allocations (pools and the region table) are still to be freed."""
        return len(self._owned) + (self._regions is not None)

    def is_live(self) -> bool:
        """True until `release` (or a failed construction)."""
        return self._live

    # -- addressing -------------------------------------------------------------------

    def config(self) -> KvCacheConfig:
        """The configuration the pools were sized for."""
        return self._config

    def num_blocks(self) -> int:
        """Blocks per pool."""
        return self._num_blocks

    def layer(self, layer: object) -> int:
        """`layer` as a valid layer index; KvCacheError once released."""
        if not self._live:
            raise KvCacheError("the cache has been released")
        return self._config._check_layer(layer)  # type: ignore[arg-type]

    def block(self, block: object) -> int:
        """`block` as a valid block index; KvCacheError once released."""
        if not self._live:
            raise KvCacheError(f"block {block}: the cache has been released")
        return block_index(block, self._num_blocks)

    def k_block_ptr(self, layer: int, block: int) -> DevicePtr:
        """Device address of `block` in `layer`'s K pool."""
        layer, block = self.layer(layer), self.block(block)
        return self._k_pools[layer].offset(block * self._k_stride[layer])

    def v_block_ptr(self, layer: int, block: int) -> DevicePtr:
        """Device address of `block` in `layer`'s V pool (the K block under `v_aliases_k`)."""
        layer, block = self.layer(layer), self.block(block)
        return self._v_pools[layer].offset(block * self._v_stride[layer])

    def block_ptrs(self, layer: int, block: int) -> tuple[DevicePtr, DevicePtr]:
        """(K address, V address) of `block` in `layer`, both checked once."""
        layer, block = self.layer(layer), self.block(block)
        return (
            self._k_pools[layer].offset(block * self._k_stride[layer]),
            self._v_pools[layer].offset(block * self._v_stride[layer]),
        )

    def k_pool(self, layer: int) -> DevicePtr:
        """Base address of `layer`'s K pool."""
        return self._k_pools[self.layer(layer)]

    def v_pool(self, layer: int) -> DevicePtr:
        """Base address of `layer`'s V pool (the K pool under `v_aliases_k`)."""
        return self._v_pools[self.layer(layer)]

    def k_stride(self, layer: int) -> int:
        """Bytes between consecutive blocks of `layer`'s K pool."""
        return self._k_stride[self._config._check_layer(layer)]

    def v_stride(self, layer: int) -> int:
        """Bytes between consecutive blocks of `layer`'s V pool (the K stride under aliasing)."""
        return self._v_stride[self._config._check_layer(layer)]

    def regions(self) -> BlockRegions:
        """The backend region table: a row per layer, K then V (V absent under `v_aliases_k`)."""
        if not self._live or self._regions is None:
            raise KvCacheError("the cache has been released")
        return self._regions

    def region_index(self, layer: int, side: str) -> int:
        """The row of `regions()` holding `layer`'s `side` ("K" or "V") pool."""
        layer = self.layer(layer)
        if side not in ("K", "V"):
            raise ValueError(f"side must be 'K' or 'V', got {side!r}")
        if self._config.v_aliases_k:
            return layer
        return 2 * layer + (side == "V")
