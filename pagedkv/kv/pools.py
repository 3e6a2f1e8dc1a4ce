"""KvPools: every layer's K and V pool on a backend, their strides and the block-region table.

A pool is one backend allocation of `num_blocks` blocks of its side's stride; under
`v_aliases_k` a layer's V pool is its K pool. The region table has a row per pool, K then V
per layer. Pools are freed only by `release`, on the backend that allocated them; a pool
whose free fails stays recorded, so a later `release` retries it.

Elastic pools (`elastic=True`, a backend that `supports("vmm")`) reserve address space for
`num_blocks` blocks per pool and map memory in granules as blocks are needed
(`ElasticMapping`): every block keeps its address for the pools' life, so region tables and
views stay valid, and blocks `[0, resident_blocks())` are backed in every pool.
"""

from __future__ import annotations

from ..backends.capabilities import require
from ..backends.protocol import BlockRegions, DevicePtr, GpuBackend
from ..core.config import MAX_NUM_BLOCKS, KvCacheConfig
from ..core.log import get_logger
from ..core.teardown import free_each
from ..core.validate import block_index, positive_int
from ..errors import ChunkNotMapped, DeviceOutOfMemory, KvCacheError

_log = get_logger("pools")


class KvPools:
    """The K and V pools of every layer of `config`, `num_blocks` blocks each, on `gpu`.
    Construction is all or nothing: a failed allocation frees what was allocated. Either
    block layout (config.layout) runs on every backend."""

    def __init__(self, config: KvCacheConfig, num_blocks: int, gpu: GpuBackend, elastic: bool = False):
        if not isinstance(config, KvCacheConfig):
            raise TypeError(f"config must be a KvCacheConfig, got {type(config).__name__}")
        num_blocks = positive_int(num_blocks, "num_blocks")
        if num_blocks > MAX_NUM_BLOCKS:
            raise ValueError(
                f"num_blocks is {num_blocks}, more than {MAX_NUM_BLOCKS} (block indices are int32)"
            )
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
        self._elastic: ElasticMapping | None = None
        if elastic is not False:
            if elastic is not True:
                raise TypeError(f"elastic must be True or False, got {elastic!r}")
            self._elastic = ElasticMapping(num_blocks, max(self._k_stride + self._v_stride), gpu)
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
            k_pool = self._new_pool(gpu, self._k_stride[layer])
            self._k_pools.append(k_pool)
            rows.append((int(k_pool), self._k_stride[layer], self._k_stride[layer]))
            if self._config.v_aliases_k:
                self._v_pools.append(k_pool)
            else:
                v_pool = self._new_pool(gpu, self._v_stride[layer])
                self._v_pools.append(v_pool)
                rows.append((int(v_pool), self._v_stride[layer], self._v_stride[layer]))
        self._regions = gpu.create_block_regions(rows)

    def _new_pool(self, gpu: GpuBackend, stride: int) -> DevicePtr:
        """One pool of `num_blocks` blocks of `stride` bytes: allocated, or (elastic)
        reserved with nothing mapped; recorded in `_owned` before anything else can fail."""
        if self._elastic is None:
            pool = gpu.alloc(self._num_blocks * stride)
            self._owned.append(pool)
            return pool
        pool = gpu.reserve_address(self._elastic.reserved_bytes(stride))
        self._owned.append(pool)
        self._elastic.add_pool(pool, stride)
        return pool

    # -- release ----------------------------------------------------------------------

    def check_backend(self, gpu: object, what: str = "release") -> None:
        """KvCacheError, naming `what` was called, unless `gpu` is the backend the pools were
        allocated on."""
        if gpu is not self._gpu:
            tail = "release them with that backend" if what == "release" else "use that backend"
            raise KvCacheError(
                f"{what} with {type(gpu).__name__} {gpu!r:.60}: the pools were allocated on "
                f"{type(self._gpu).__name__} {self._gpu!r:.60}; {tail}"
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
        def free_pool(pool: DevicePtr) -> None:
            if self._elastic is None:
                gpu.free(pool)
            else:
                gpu.release_address(pool)  # unmaps what is still mapped
                self._elastic.forget_pool(pool)

        self._owned, failed = free_each(self._owned, free_pool, _log, "kv_pool_free_failed", field="pool")
        first = first or failed
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

    # -- elastic mapping --------------------------------------------------------------

    def elastic(self) -> ElasticMapping | None:
        """The mapping state of elastic pools, or None for pools allocated whole."""
        return self._elastic

    def resident_blocks(self) -> int:
        """Blocks backed by memory in every pool: `num_blocks()` unless elastic."""
        return self._num_blocks if self._elastic is None else self._elastic.resident

    def step_blocks(self) -> int:
        """Blocks of one mapping step (1 unless elastic): `grow` and `trim` work in these."""
        return 1 if self._elastic is None else self._elastic.step_blocks

    def check_resident(self, top: int) -> None:
        """IndexError naming block `top` (a valid index) when elastic pools do not back it."""
        if self._elastic is not None and top >= self._elastic.resident:
            raise self._elastic.not_resident(top)

    def grow(self, min_blocks: int) -> int:
        """Map granules of every pool, in one step, until at least `min_blocks` blocks (rounded
        up to a whole step, capped at `num_blocks`) are resident; returns the resident count.
        All or nothing: DeviceOutOfMemory (or the backend's error) with nothing new mapped.
        NOTE: it maps on the backend the pools were made on, because allocation (which
        takes no backend) calls it when the mapped free blocks run out."""
        if not self._live or self._elastic is None:
            raise KvCacheError("grow needs live elastic pools")
        return self._elastic.grow(self._gpu, min_blocks)

    def trim(self, keep_blocks: int) -> int:
        """Unmap every granule of every pool above what `keep_blocks` blocks (rounded up to a
        whole step) need; returns the resident count. Every pool is attempted; the first
        backend error is raised after. A granule whose unmap failed is no longer resident
        (no block over it is handed out: the unmap may have taken effect) and is unmapped
        again by the next `trim`, or by `grow` before it is mapped anew."""
        if not self._live or self._elastic is None:
            raise KvCacheError("trim needs live elastic pools")
        return self._elastic.trim(self._gpu, keep_blocks)

    def num_blocks(self) -> int:
        """Blocks per pool."""
        return self._num_blocks

    def layer(self, layer: object) -> int:
        """`layer` as a valid layer index; KvCacheError once released."""
        if not self._live:
            raise KvCacheError("the cache has been released")
        return self._config._check_layer(layer)  # type: ignore[arg-type]

    def block(self, block: object) -> int:
        """`block` as a valid block index (for elastic pools, a resident one: IndexError
        naming it otherwise); KvCacheError once released."""
        if not self._live:
            raise KvCacheError(f"block {block}: the cache has been released")
        block = block_index(block, self._num_blocks)
        if self._elastic is not None and block >= self._elastic.resident:
            raise self._elastic.not_resident(block)
        return block

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


class ElasticMapping:
    """Which granules of each reserved pool are mapped. Granules are mapped from the start of
    a pool upwards and unmapped from the top down, one backend `map_chunk` per granule, so a
    pool's mapped part is always `[0, mapped_granules * granularity)`.

    Growth goes in steps of `step_blocks` blocks (a granule of the widest pool, at least one
    block); `resident` is the number of blocks every pool backs. Worked example: granularity
    4096, pools with strides 512 and 1024, 20 blocks: the reservations are 12288 and 20480
    bytes (3 and 5 granules), a step is 4 blocks; growing to 1 block maps granule 0 of each
    pool (resident = min(4096 // 512, 4096 // 1024) = 4); growing to 9 blocks maps 3 granules
    of the 512-byte pool (capped at its 3) and 3 of the other: resident 12.

    A granule whose `map_chunk` or `unmap_chunk` failed (other than for lack of memory) is
    "unsettled": the backend may or may not have it mapped (an unmap can fail after taking
    effect). It never counts as resident, so no block over it is handed out; it is unmapped
    again (a retry: success or ChunkNotMapped settles it) by the next `trim`, and by a `grow`
    before it is mapped anew. Invariant: a pool's granules `[0, mapped)` are mapped, its
    unsettled ones lie at or above `mapped`, every other one is unmapped.
    """

    def __init__(self, num_blocks: int, widest_stride: int, gpu: GpuBackend):
        require(gpu, "vmm", "elastic pools")
        self.granularity = positive_int(gpu.vmm_granularity(), "vmm_granularity")
        self.num_blocks = num_blocks
        self.step_blocks = max(1, self.granularity // widest_stride)
        self.resident = 0
        self._pools: list[list[int]] = []  # [base, stride, reserved granules, mapped granules]
        self._unsettled: dict[int, set[int]] = {}  # pool base -> granules whose map/unmap failed

    def reserved_bytes(self, stride: int) -> int:
        """Bytes to reserve for a pool of `num_blocks` blocks of `stride` (whole granules)."""
        return -(-self.num_blocks * stride // self.granularity) * self.granularity

    def add_pool(self, base: DevicePtr, stride: int) -> None:
        """Track a pool reserved at `base` with nothing mapped."""
        self._pools.append([int(base), stride, self.reserved_bytes(stride) // self.granularity, 0])
        self.resident = 0

    def forget_pool(self, base: DevicePtr) -> None:
        """Stop tracking the pool at `base` (its reservation was released)."""
        self._pools = [p for p in self._pools if p[0] != int(base)]
        self._unsettled.pop(int(base), None)
        self.resident = 0

    def unsettled(self) -> int:
        """How many granules wait for a retried unmap (their map or unmap failed)."""
        return sum(map(len, self._unsettled.values()))

    def _doubt(self, pool: list[int], granule: int) -> None:
        self._unsettled.setdefault(pool[0], set()).add(granule)

    def _settle(self, gpu: GpuBackend, pool: list[int], granule: int) -> None:
        """Unmap an unsettled granule again; it is settled when that works or the backend
        says nothing is mapped there. Any other error is raised with it still unsettled."""
        doubts = self._unsettled.get(pool[0])
        if not doubts or granule not in doubts:
            return
        try:
            gpu.unmap_chunk(DevicePtr(pool[0] + granule * self.granularity), self.granularity)
        except ChunkNotMapped:
            pass
        doubts.discard(granule)
        if not doubts:
            del self._unsettled[pool[0]]

    def mapped_bytes(self) -> int:
        """Bytes mapped over every pool."""
        return sum(p[3] for p in self._pools) * self.granularity

    def _target(self, blocks: int) -> int:
        blocks = max(0, blocks)
        return min(self.num_blocks, -(-blocks // self.step_blocks) * self.step_blocks)

    def _need(self, pool: list[int], blocks: int) -> int:
        return min(pool[2], -(-blocks * pool[1] // self.granularity))

    def _update_resident(self) -> int:
        if not self._pools:
            self.resident = 0
        else:
            self.resident = min(self.num_blocks, min(p[3] * self.granularity // p[1] for p in self._pools))
        return self.resident

    def grow(self, gpu: GpuBackend, min_blocks: int) -> int:
        """See `KvPools.grow`."""
        target = self._target(min_blocks)
        if target <= self.resident:
            return self.resident
        g = self.granularity
        done: list[tuple[list[int], int]] = []  # (pool, granule) mapped by this call
        try:
            for pool in self._pools:
                for granule in range(pool[3], self._need(pool, target)):
                    self._settle(gpu, pool, granule)
                    try:
                        gpu.map_chunk(DevicePtr(pool[0] + granule * g), g)
                    except DeviceOutOfMemory:
                        raise  # nothing was created
                    except BaseException:
                        self._doubt(pool, granule)  # it may be mapped: unmapped before any reuse
                        raise
                    pool[3] = granule + 1
                    done.append((pool, granule))
        except BaseException:
            self._undo(gpu, done)
            raise
        return self._update_resident()

    def _undo(self, gpu: GpuBackend, done: list[tuple[list[int], int]]) -> None:
        """Unmap what a failed `grow` mapped, last first; a granule whose unmap fails is no
        longer resident and stays unsettled (retried later)."""
        for pool, granule in reversed(done):
            pool[3] = granule
            try:
                gpu.unmap_chunk(DevicePtr(pool[0] + granule * self.granularity), self.granularity)
            except Exception as err:  # noqa: BLE001 - the growth error is the one to raise
                self._doubt(pool, granule)
                _log.error("kv_elastic_unmap_failed", pool=hex(pool[0]), granule=granule, error=str(err))
        self._update_resident()

    def trim(self, gpu: GpuBackend, keep_blocks: int) -> int:
        """See `KvPools.trim`."""
        target = self._target(keep_blocks)
        g = self.granularity
        first: BaseException | None = None
        for pool in self._pools:
            for granule in sorted(self._unsettled.get(pool[0], ())):
                try:
                    self._settle(gpu, pool, granule)
                except Exception as err:  # noqa: BLE001 - every granule must be attempted
                    first = first or err
                    _log.error("kv_elastic_unmap_failed", pool=hex(pool[0]), granule=granule, error=str(err))
            keep = self._need(pool, target)
            while pool[3] > keep:
                pool[3] -= 1  # not resident from here on, whatever the unmap says
                try:
                    gpu.unmap_chunk(DevicePtr(pool[0] + pool[3] * g), g)
                except Exception as err:  # noqa: BLE001 - every granule must be attempted
                    first = first or err
                    self._doubt(pool, pool[3])  # it may have been unmapped: retried, never used
                    _log.error("kv_elastic_unmap_failed", pool=hex(pool[0]), granule=pool[3], error=str(err))
        self._update_resident()
        if first is not None:
            raise first
        return self.resident

    def not_resident(self, block: int) -> IndexError:
        """The error for an access to block `block`, which no memory backs."""
        return IndexError(
            f"block {block} is not resident: the elastic pools back blocks [0, {self.resident}) "
            f"of {self.num_blocks} (allocate it first)"
        )
