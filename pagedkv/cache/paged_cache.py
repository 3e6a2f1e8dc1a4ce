"""PagedKvCache: a paged KV cache, composed of a `BlockAllocator` and the `KvPools`.

The allocator (`pagedkv.allocator`) keeps the free list and the reference count of every
block; the pools (`pagedkv.pools`) own every layer's K and V memory on the backend. The
cache joins them: its bookkeeping calls (`alloc_block`, `free_block`, `inc_ref`, `dec_ref`,
...) are the allocator's own bound methods, one call deep, touching no memory; calls that
touch memory take the backend `gpu` (and a `stream` where work is enqueued) and check
with the allocator that a destination block is held and not shared. The cache never owns
the backend.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from ..backends.protocol import GpuBackend, check_copy_pairs, host_bytes
from ..core.allocator import BlockAllocator, BlockReclaimer
from ..core.config import KvCacheConfig
from ..core.config import _scale as _checked_scale
from ..core.elastic_allocator import ElasticBlockAllocator
from ..core.env import flags
from ..core.guard import ThreadGuard
from ..core.log import get_logger
from ..core.validate import non_negative_int, positive_int
from ..errors import KvCacheError, KvCacheExhausted
from ..kv import device_path as kv_device
from ..kv import diagnostics
from ..kv import prefill as kv_prefill
from ..kv import rows as kv_rows
from ..kv.pools import KvPools
from .geometry import CacheGeometry
from .guarding import GuardedCalls, PoolHolders

POISON_BYTE = 0xFF
"""The byte `poison_block` writes: BF16 0xFFFF is a NaN, so a read of a stale block shows."""

_log = get_logger("cache")

HYBRID_FACTORY: list = [None]
"""What builds the cache of a config with `layer_groups`: `HybridKvCache`, registered by
`pagedkv.cache` when it imports `hybrid_cache` (this module never imports it)."""

_BOUND = (
    "alloc_block",
    "try_alloc_block",
    "alloc_blocks",
    "inc_ref",
    "inc_refs",
    "dec_ref",
    "free_block",
    "free_blocks",
    "return_evicted_block",
    "ref_count",
    "num_free_blocks",
    "num_blocks",
    "block_history",
)


_GUARDED_BOUND = tuple(n for n in _BOUND if n not in ("ref_count", "num_free_blocks", "num_blocks", "block_history"))
"""The allocator's bound methods that change state: guarded while a prefix cache is attached."""

_GUARDED_METHODS = ("release", "shrink", "reserve", "fill_blocks", "copy_blocks", "write_block", "write_tokens",
                    "take_nonfinite_inputs")
"""The cache's own methods that change state (zero/poison/init go through `fill_blocks`)."""


def _wait_list(items, what: str) -> list:
    """`items` (streams or events to wait for) as a list; TypeError naming `what` otherwise."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{what} must be a sequence of {what}, got {type(items).__name__} {items!r:.60}")
    return list(items)


class PagedKvCache(GuardedCalls, PoolHolders, CacheGeometry):
    """A paged KV cache: for every layer a K pool and a V pool of `num_blocks` blocks, and a
    reference count per block. See `BlockAllocator` for the bookkeeping contract.

    With `elastic=True` (a backend that `supports("vmm")`), `num_blocks` is a ceiling: the
    pools reserve address space for it and memory is mapped in steps as blocks are
    allocated (lowest block id first), given back by `shrink(gpu)` and mapped ahead by
    `reserve(n, gpu)`; see `ElasticBlockAllocator` and `pagedkv.pools.ElasticMapping`."""

    _GUARD_BOUND = _GUARDED_BOUND
    _GUARD_METHODS = _GUARDED_METHODS

    def __new__(cls, config: KvCacheConfig, *args, **kwargs):
        """A `HybridKvCache` (`pagedkv.cache.hybrid_cache`) for a config with `layer_groups`;
        otherwise a PagedKvCache."""
        if cls is PagedKvCache and isinstance(config, KvCacheConfig) and config.layer_groups:
            return HYBRID_FACTORY[0](config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, config: KvCacheConfig, num_blocks: int, gpu: GpuBackend, elastic: bool = False,
                 num_state_slots: int | None = None):
        if not isinstance(config, KvCacheConfig):
            raise TypeError(f"config must be a KvCacheConfig, got {type(config).__name__}")
        if num_state_slots is not None:
            raise ValueError(f"num_state_slots is {num_state_slots!r}, but the config has no state group")
        num_blocks = positive_int(num_blocks, "num_blocks")
        env = flags()
        self._config = config
        self._pools = KvPools(config, num_blocks, gpu, elastic=elastic)
        self._views: dict[tuple, object] = {}  # kept pool views (k_view / v_view)
        self._elastic = elastic is True
        self._nonfinite = None
        if kv_device.has_kv_kernels(gpu):
            try:
                self._nonfinite = kv_device.NonfiniteCounter(gpu)
            except BaseException:
                self._pools.release(gpu)
                raise
        if self._elastic:
            self._allocator = ElasticBlockAllocator(num_blocks, self._pools, trace=env.kv_trace)
        else:
            self._allocator = BlockAllocator(num_blocks, trace=env.kv_trace)
        self._init_value = POISON_BYTE if env.kv_poison else 0
        for name in _BOUND:  # the hot paths run as the allocator's bound methods
            setattr(self, name, getattr(self._allocator, name))
        self._block = self._allocator.block
        self._holders: dict[int, str] = {}  # id(holder) -> label: what must close before release
        per_block = config.block_bytes_kv_all_layers()
        _log.info(
            "kv_cache_allocated",
            blocks=num_blocks,
            layers=config.num_layers,
            bytes_per_block=per_block,
            total_gib=round(per_block * num_blocks / 2**30, 4),
            dtype=str(config.dtype),
            mixed_formats=config.has_mixed_formats(),
            v_aliased=config.v_aliases_k,
            elastic=self._elastic,
        )

    # -- construction and release -----------------------------------------------------

    def label(self) -> str:
        """A short name for teardown messages."""
        return f"PagedKvCache({self._config.num_layers} layers x {self._pools.num_blocks()} blocks, {self._config.dtype})"

    def release(self, gpu: GpuBackend) -> None:
        """Close an attached prefix cache (a reclaimer with a `close()`; any other is
        detached), empty the bookkeeping and free every pool on
        `gpu` (all attempted; the first error raised). `gpu` must be the backend the cache
        was built on: KvCacheError, with nothing forgotten, otherwise. Afterwards allocation
        fails. A pool whose free failed stays recorded, so a second call retries it; with
        nothing left to free a second call does nothing. KvCacheError, nothing changed, while
        a holder (`hold`: an open KvTransfer) still uses the pools, or while a DLPack
        export of a pool view (`k_view`, `v_view`) is alive in a consumer (a torch tensor, a
        numpy array): the release is refused, not deferred."""
        if self._allocator.released() and not self._pools.pending() and self._nonfinite is None:
            return
        self.check_releasable(gpu)
        if not self._allocator.released():
            prefix_cache = self._allocator.reclaimer()
            close = getattr(prefix_cache, "close", None)
            if close is not None:
                try:
                    close()  # hands its references back and detaches
                except Exception as err:  # noqa: BLE001 - the pools must be freed regardless
                    _log.error("kv_prefix_cache_close_failed", error=str(err))
            if prefix_cache is not None:
                self._allocator.detach_reclaimer(prefix_cache)
            self._drop_guard()
            self._allocator.release()
        try:
            self._pools.release(gpu)  # waits for every stream before the first free
        finally:
            if self._nonfinite is not None:  # a kernel queued before may still count into it
                self._nonfinite.free(gpu)
                self._nonfinite = None

    # -- validation -------------------------------------------------------------------

    def _blocks(self, blocks: Iterable[int], what: str = "blocks") -> np.ndarray:
        """`blocks` as an int64 array of in-range (and, elastic, resident) indices; the first
        bad entry is named."""
        idx = np.asarray(self._allocator.blocks(blocks, what), dtype=np.int64)
        if self._elastic and idx.size:
            self._pools.check_resident(int(idx.max()))
        return idx

    # -- allocation and reference counts (instances run the allocator's bound methods) --

    def alloc_block(self) -> int:
        """See `BlockAllocator.alloc_block`."""
        return self._allocator.alloc_block()

    def try_alloc_block(self) -> int | None:
        """See `BlockAllocator.try_alloc_block`."""
        return self._allocator.try_alloc_block()

    def alloc_blocks(self, n: int) -> list[int]:
        """See `BlockAllocator.alloc_blocks`."""
        return self._allocator.alloc_blocks(n)

    def inc_ref(self, block: int) -> None:
        """See `BlockAllocator.inc_ref`."""
        self._allocator.inc_ref(block)

    def inc_refs(self, blocks: Sequence[int]) -> None:
        """See `BlockAllocator.inc_refs`."""
        self._allocator.inc_refs(blocks)

    def dec_ref(self, block: int) -> bool:
        """See `BlockAllocator.dec_ref`."""
        return self._allocator.dec_ref(block)

    def free_block(self, block: int) -> bool:
        """See `BlockAllocator.free_block` (one `dec_ref`)."""
        return self._allocator.dec_ref(block)

    def free_blocks(self, table: Sequence[int]) -> None:
        """See `BlockAllocator.free_blocks`."""
        self._allocator.free_blocks(table)

    def return_evicted_block(self, block: int) -> None:
        """See `BlockAllocator.return_evicted_block`."""
        self._allocator.return_evicted_block(block)

    def ref_count(self, block: int) -> int:
        """See `BlockAllocator.ref_count`."""
        return self._allocator.ref_count(block)

    def num_free_blocks(self) -> int:
        """How many blocks are on the free list."""
        return self._allocator.num_free_blocks()

    def num_available_blocks(self) -> int:
        """The blocks an engine admits against: free ones plus the cached blocks the
        attached prefix cache would evict for an allocation (its `num_evictable_blocks()`;
        pinned chains and blocks a sequence holds are not counted). Equals
        `num_free_blocks()` with no prefix cache attached. O(cached blocks)."""
        free = self._allocator.num_free_blocks()
        evictable = getattr(self._allocator.reclaimer(), "num_evictable_blocks", None)
        return free if evictable is None else free + evictable()

    def num_blocks(self) -> int:
        """Blocks per pool (0 after `release`)."""
        return self._allocator.num_blocks()

    def block_history(self, block: int) -> list[str]:
        """See `BlockAllocator.block_history`."""
        return self._allocator.block_history(block)

    # -- elastic memory ---------------------------------------------------------------

    def pools_live(self) -> bool:
        """True until `release` frees the pools (a view checks it before reusing its
        prepared export)."""
        return self._pools.is_live()

    def is_elastic(self) -> bool:
        """True for a cache made with `elastic=True`."""
        return self._elastic

    def resident_blocks(self) -> int:
        """Blocks backed by memory, `[0, resident_blocks())` (`num_blocks()` unless elastic)."""
        return self._allocator.resident_blocks() if self._elastic else self._allocator.num_blocks()

    def mapped_bytes(self) -> int:
        """Bytes of pool memory held on the device now (all of it unless elastic)."""
        elastic = self._pools.elastic()
        if elastic is not None:
            return elastic.mapped_bytes()
        return self._config.block_bytes_kv_all_layers() * self._allocator.num_blocks()

    def shrink(self, gpu: GpuBackend, streams: Sequence = (), events: Sequence = ()) -> int:
        """Unmap and release, in every pool, the memory of whole steps at the tail that no
        block uses (count 0); returns the bytes given back (0 for a cache that is not
        elastic). It first waits for each of `streams` (a stream of `gpu`, or another
        library's stream: an int handle or an object with `__cuda_stream__`) and each of
        `events` (handles from `gpu.record_event`), then for every stream of `gpu`: work
        another library enqueued on the pools (an attention kernel on a torch stream) is only
        waited for when its stream or an event after it is given here; unmapping under it
        faults the device and loses the context. `gpu` must be the cache's backend
        (KvCacheError otherwise). A backend error is raised after every pool was attempted;
        a granule whose unmap failed is no longer resident (it may be unmapped) and the next
        `shrink` unmaps it again. A host array or DLPack export taken of an elastic
        pool before the shrink must not be used after it (on a GPU its unmapped part faults;
        a HostBackend export does not see the unmap)."""
        self._pools.check_backend(gpu)
        streams, events = _wait_list(streams, "streams"), _wait_list(events, "events")
        if events and not callable(getattr(gpu, "wait_event", None)):
            raise TypeError(f"events given, but {type(gpu).__name__} has no wait_event")
        if not self._elastic or self._allocator.released():
            return 0
        for stream in streams:
            gpu.synchronize(stream)
        for event in events:
            gpu.wait_event(event)
        gpu.synchronize_all()  # queued work may still touch the tail about to be unmapped
        before = self.mapped_bytes()
        try:
            self._allocator.shrink()
        finally:
            given = before - self.mapped_bytes()
            if given:
                _log.info("kv_cache_shrunk", bytes=given, resident_blocks=self.resident_blocks())
        return given

    def reserve(self, n: int, gpu: GpuBackend) -> int:
        """Map ahead so that at least `n` free blocks are resident; returns the bytes mapped.
        KvCacheExhausted, nothing mapped, when the ceiling or the device cannot give them
        (for a cache that is not elastic: when fewer than `n` blocks are free)."""
        self._pools.check_backend(gpu)
        n = non_negative_int(n, "number of blocks")
        if not self._elastic:
            if n > self._allocator.num_free_blocks():
                raise KvCacheExhausted(
                    f"reserve of {n} block(s): {self._allocator.num_free_blocks()} of "
                    f"{self._allocator.num_blocks()} are free"
                )
            return 0
        before = self.mapped_bytes()
        self._allocator.reserve(n)
        return self.mapped_bytes() - before

    def allocator(self) -> BlockAllocator:
        """The block allocator (free list and counts)."""
        return self._allocator

    def pools(self) -> KvPools:
        """The K and V pools."""
        return self._pools

    def attach_prefix_cache(self, prefix_cache: BlockReclaimer) -> None:
        """Register the prefix cache that evicts for allocation; it must be a
        `BlockReclaimer`. One per cache; `PrefixCache(cache)` calls this.

        A prefix cache holding a `ThreadGuard` (`_guard`, as PrefixCache does) lends it to
        the cache: while attached, every method that changes the cache (allocation and
        counts, `release`, `shrink`, `reserve`, fills, copies, writes) enters that guard,
        so a call from a second thread while another is inside the cache, its prefix cache
        or a SequenceTable on it raises `ConcurrentUseError` with nothing changed. Reads
        (`ref_count`, `num_free_blocks`, `read_block`, ...) are not guarded."""
        self._allocator.attach_reclaimer(prefix_cache)
        guard = getattr(prefix_cache, "_guard", None)
        events = getattr(prefix_cache, "_events", None)
        if isinstance(guard, ThreadGuard) and events is not None:
            self._take_guard(guard, events.pending, prefix_cache.deliver_events)

    def detach_prefix_cache(self, prefix_cache: BlockReclaimer) -> None:
        """Undo `attach_prefix_cache` (a no-op for a prefix cache that is not attached);
        the cache's methods are unguarded again."""
        if self._allocator.reclaimer() is prefix_cache:
            self._drop_guard()
        self._allocator.detach_reclaimer(prefix_cache)

    def check_releasable(self, gpu: GpuBackend) -> None:
        """The checks `release` makes before it changes anything (KvCacheError naming what is
        wrong): `gpu` the cache's backend, no holder, no live DLPack export of a pool view.
        Nothing to check once released."""
        if self._allocator.released() and not self._pools.pending() and self._nonfinite is None:
            return
        self._pools.check_backend(gpu)
        if self._holders:
            raise KvCacheError(f"release of {self.label()} while {', '.join(self._holders.values())} still "
                               "uses its pools: close it first (nothing was released)")
        if not self._allocator.released():
            from ..interop.views import live_exports_from

            exported = live_exports_from(self)
            if exported:
                raise KvCacheError(
                    f"release of {self.label()} while {exported} DLPack export(s) of its pools are alive (a "
                    "consumer's tensor from k_view/v_view would write into freed memory): drop them first; "
                    "nothing was released")

    def guard(self) -> ThreadGuard | None:
        """The ThreadGuard the cache's mutating methods enter (its prefix cache's), or None."""
        return self._guard

    def attached_prefix_cache(self) -> BlockReclaimer | None:
        """The attached prefix cache, or None."""
        return self._allocator.reclaimer()

    def check_invariants(self, held: Mapping[int, int] | None = None) -> None:
        """See `BlockAllocator.check_invariants`."""
        self._allocator.check_invariants(held)

    # -- memory: fill, copy, read, write ----------------------------------------------

    def zero_block(self, block: int, gpu: GpuBackend, stream: int) -> None:
        """Zero every byte of `block` in every layer's K and V pool."""
        self.zero_blocks([block], gpu, stream)

    def poison_block(self, block: int, gpu: GpuBackend, stream: int) -> None:
        """Fill every byte of `block` in every layer's K and V pool with 0xFF."""
        self.poison_blocks([block], gpu, stream)

    def zero_blocks(self, blocks: Sequence[int], gpu: GpuBackend, stream: int) -> None:
        """Zero many blocks in every layer, in one backend fill call."""
        self.fill_blocks(blocks, 0, gpu, stream)

    def poison_blocks(self, blocks: Sequence[int], gpu: GpuBackend, stream: int) -> None:
        """Fill many blocks with 0xFF in every layer, in one backend fill call."""
        self.fill_blocks(blocks, POISON_BYTE, gpu, stream)

    def init_block(self, block: int, gpu: GpuBackend, stream: int) -> None:
        """Prepare a fresh block: zero it, or poison it when METRALE_KV_POISON is on."""
        self.init_blocks([block], gpu, stream)

    def init_blocks(self, blocks: Sequence[int], gpu: GpuBackend, stream: int) -> None:
        """`init_block` for many blocks, in one backend fill call."""
        self.fill_blocks(blocks, self._init_value, gpu, stream)

    def fill_blocks(self, blocks: Sequence[int], value: int, gpu: GpuBackend, stream: int) -> None:
        """Set every byte of the listed blocks, in every layer's K and V pool, to `value`."""
        self._pools.check_backend(gpu, "fill_blocks")
        idx = self._blocks(blocks)
        if idx.size:
            gpu.fill_blocks(self._pools.regions(), idx, value, stream)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]], gpu: GpuBackend, stream: int) -> None:
        """Copy block `src` over block `dst` for every `(src, dst)` pair, in every layer's K
        and V pool, in one backend call (the copy-on-write primitive). Each destination must
        be held (count > 0) and not in the prefix cache: refused naming the block otherwise,
        before anything is copied."""
        self._pools.check_backend(gpu, "copy_blocks")
        if pairs is None or isinstance(pairs, (str, bytes)):
            raise TypeError(f"copy_blocks takes a sequence of (src, dst) pairs, got {pairs!r}")
        pairs = list(pairs)
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"copy_blocks takes (src, dst) pairs, got {pair!r}")
        src = self._blocks([p[0] for p in pairs], "copy_blocks sources")
        dst = self._blocks([p[1] for p in pairs], "copy_blocks destinations")
        check_copy_pairs(src, dst)
        self._allocator.check_writable(dst.tolist())
        if src.size:
            gpu.copy_blocks(self._pools.regions(), src, dst, stream)

    def read_block(self, layer: int, block: int, gpu: GpuBackend) -> tuple[np.ndarray, np.ndarray]:
        """(K bytes, V bytes) of `block` in `layer`, each its side's stride long (uint8)."""
        self._pools.check_backend(gpu, "read_block")
        k_ptr, v_ptr = self._pools.block_ptrs(layer, block)
        k = np.empty(self._pools.k_stride(layer), dtype=np.uint8)
        gpu.copy_d2h(k_ptr, k)
        if self._config.v_aliases_k:
            return k, k.copy()
        v = np.empty(self._pools.v_stride(layer), dtype=np.uint8)
        gpu.copy_d2h(v_ptr, v)
        return k, v

    def write_block(self, layer: int, block: int, k_data, v_data, gpu: GpuBackend) -> None:
        """Write raw bytes at the start of `block`'s K and V in `layer`; a side given None is
        left alone, and V is skipped under `v_aliases_k`. Data longer than the side's stride
        raises ValueError, and a block not held (count 0) or in the prefix cache is refused
        naming it, before anything is written."""
        self._pools.check_backend(gpu, "write_block")
        k_ptr, v_ptr = self._pools.block_ptrs(layer, block)
        self._allocator.check_writable([int(block)])
        aliased = self._config.v_aliases_k
        k_bytes = None if k_data is None else _as_bytes(k_data)
        v_bytes = None if v_data is None or aliased else _as_bytes(v_data)
        strides = (self._pools.k_stride(layer), self._pools.v_stride(layer))
        for side, data, stride in (("K", k_bytes, strides[0]), ("V", v_bytes, strides[1])):
            if data is not None and data.nbytes > stride:
                raise ValueError(
                    f"layer {layer} {side} data is {data.nbytes} bytes, longer than the {stride}-byte block"
                )
        if k_bytes is not None and k_bytes.nbytes:
            gpu.copy_h2d(k_bytes, k_ptr)
        if v_bytes is not None and v_bytes.nbytes:
            gpu.copy_h2d(v_bytes, v_ptr)

    def _scales(self, k_scale: object, v_scale: object) -> tuple[float, float]:
        """The config's fp8 scales; an explicit scale must be the config's (ValueError naming both)."""
        config = self._config
        for name, given, own in (("k_scale", k_scale, config.k_scale), ("v_scale", v_scale, config.v_scale)):
            if given is not None and np.float32(_checked_scale(given, name)) != np.float32(own):
                raise ValueError(
                    f"{name} {given!r} differs from the cache's {name} {own!r}: the fp8 scales are part of the "
                    f"cache's layout, set them in KvCacheConfig({name}=...)"
                )
        return config.k_scale, config.v_scale

    def write_tokens(self, layer: int, slots, k, v, gpu: GpuBackend, stream: int,
                     k_scale: float | None = None, v_scale: float | None = None) -> None:
        """Encode and write token rows of K and V into `layer`'s slots (`block * block_size +
        offset`, -1 skips), each side in its own format; see `pagedkv.kv_rows.write_tokens`.
        Every destination block must be held (count > 0) and not in the prefix cache:
        refused naming the block otherwise, before anything is written. fp8 sides use the
        config's `k_scale` / `v_scale`; a scale given here must equal it (ValueError naming
        both otherwise)."""
        k_scale, v_scale = self._scales(k_scale, v_scale)
        self._pools.check_backend(gpu, "write_tokens")
        kv_rows.write_tokens(self._pools, layer, slots, k, v, gpu, stream, k_scale, v_scale,
                             check_blocks=self._allocator.check_writable,
                             nonfinite=0 if self._nonfinite is None else int(self._nonfinite.ptr))

    def plan_layer_writes(self, layers, k_rows, v_rows, gpu: GpuBackend, k_scale: float | None = None,
                          v_scale: float | None = None) -> kv_prefill.LayerWritePlan:
        """A `pagedkv.kv_prefill.LayerWritePlan`: the prefill writes of `layers` from the device
        rows `k_rows[i]`, `v_rows[i]`, each `plan.write(slots, stream)` one launch on
        CudaBackend (a `write_tokens` per layer elsewhere, destination blocks checked as
        there); `plan.close()` frees its device table. Scales as `write_tokens`."""
        k_scale, v_scale = self._scales(k_scale, v_scale)
        self._pools.check_backend(gpu, "plan_layer_writes")
        return kv_prefill.LayerWritePlan(
            self._pools, layers, k_rows, v_rows, gpu, k_scale, v_scale,
            nonfinite=0 if self._nonfinite is None else int(self._nonfinite.ptr),
            check_blocks=self._allocator.check_writable)

    def plan_layer_reads(self, layers, out_k, out_v, gpu: GpuBackend, unrotate: bool = True,
                         k_scale: float | None = None, v_scale: float | None = None) -> kv_prefill.LayerReadPlan:
        """A `pagedkv.kv_prefill.LayerReadPlan`: the reads of `layers` into the device outputs
        `out_k[i]`, `out_v[i]`, each `plan.read(slots, stream)` one launch on CudaBackend (a
        `read_tokens` per layer elsewhere); `plan.close()` frees its device table. Scales as
        `read_tokens`."""
        k_scale, v_scale = self._scales(k_scale, v_scale)
        self._pools.check_backend(gpu, "plan_layer_reads")
        return kv_prefill.LayerReadPlan(self._pools, layers, out_k, out_v, gpu, unrotate, k_scale, v_scale)

    def read_tokens(self, layer: int, slots, gpu: GpuBackend, unrotate: bool = True,
                    k_scale: float | None = None, v_scale: float | None = None, *, out_k=None, out_v=None,
                    stream: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) float32 rows decoded from `layer`'s slots, or the device output form
        (`out_k`, `out_v`, enqueued on `stream`); see `pagedkv.kv_rows.read_tokens`. fp8
        sides use the config's scales, as `write_tokens`."""
        k_scale, v_scale = self._scales(k_scale, v_scale)
        self._pools.check_backend(gpu, "read_tokens")
        return kv_rows.read_tokens(self._pools, layer, slots, gpu, unrotate, k_scale, v_scale,
                                   out_k=out_k, out_v=out_v, stream=stream)

    def take_nonfinite_inputs(self, gpu: GpuBackend, stream: int) -> int:
        """How many NaN/inf input values device writes met since the last call (waits for
        `stream`), reset to 0 by this call and logged as a `kv_nonfinite_inputs` warning when
        not 0. Always 0 on a backend without device writes: the host path refuses them.
        Under METRALE_KV_TRACE=1 each device write first checks its slots on the device, and
        this call raises `pagedkv.kv_device.DuplicateSlotError` naming a slot two tokens of
        one write named (host slots are always checked, before anything is written)."""
        if self._nonfinite is None:
            return 0
        count = self._nonfinite.take(gpu, stream)
        diagnostics.log_nonfinite_inputs(count)
        return count

    # -- diagnostics ------------------------------------------------------------------

    def debug_kv_checksum_per_layer(
        self, blocks: Sequence[int], boundary_idx: int, gpu: GpuBackend, stream: int, tag: str
    ) -> None:
        """Per layer (every format), region (prefix/suffix of `blocks` at `boundary_idx`) and
        side, one structlog event with the exact float64 sum, ssq and sabs of the stored
        values decoded without unrotation (see `pagedkv.diagnostics`)."""
        diagnostics.checksum_per_layer(self._pools, blocks, boundary_idx, gpu, stream, tag)

    def debug_kv_per_block(
        self, layer: int, blocks: Sequence[int], gpu: GpuBackend, stream: int, tag: str
    ) -> None:
        """One structlog event per entry of `blocks`: logical index, physical block, K and V
        exact sums of squares of the decoded stored values, every format."""
        diagnostics.per_block(self._pools, layer, blocks, gpu, stream, tag)

    def k_view(self, layer: int, gpu: GpuBackend, stream=0, readonly: bool = False):
        """`layer`'s K pool as a zero-copy DLPack tensor on `gpu` (work on `stream`); see
        `pagedkv.views`. Kept: the same (layer, gpu, stream, readonly) gives the same view
        object (its prepared export too) for the cache's life."""
        if type(layer) is int and type(stream) is int and stream == 0 and readonly is False:
            kept = self._views.get(("K", layer))  # the usual call: the default stream's view
            if kept is not None and kept._gpu is gpu and self._pools.is_live():
                return kept
        return self._view(layer, "K", gpu, stream, readonly)

    def v_view(self, layer: int, gpu: GpuBackend, stream=0, readonly: bool = False):
        """`layer`'s V pool as a zero-copy DLPack tensor (the K view under `v_aliases_k`);
        kept like `k_view`."""
        if type(layer) is int and type(stream) is int and stream == 0 and readonly is False:
            kept = self._views.get(("V", layer))
            if kept is not None and kept._gpu is gpu and self._pools.is_live():
                return kept
        return self._view(layer, "V", gpu, stream, readonly)

    def _view(self, layer, side: str, gpu, stream, readonly):
        """The kept view of (side, layer, gpu, stream, readonly), made on first use. Only
        exact ints, bools and hashable stream objects are keys (True is not layer 1).
        KvCacheError for a released cache; the backend must be the cache's."""
        if not self._pools.is_live():
            raise KvCacheError(f"{side.lower()}_view of a released cache: its pools are freed")
        try:
            self._pools.check_backend(gpu)
        except KvCacheError:
            raise KvCacheError(f"{side.lower()}_view with {type(gpu).__name__} {gpu!r:.60}: the cache was built "
                               "on another backend (a view works only on the pools' own)") from None
        key = None
        if type(layer) is int and type(readonly) is bool and type(stream) not in (bool, float):
            key = (side, layer, id(gpu), stream, readonly)
            try:
                kept = self._views.get(key)
            except TypeError:  # an unhashable stream object: a fresh view each time
                kept, key = None, None
            if kept is not None and kept._gpu is gpu:  # (a kept view holds its gpu: its id stays unique)
                return kept
        from ..interop.views import PoolView

        view = PoolView(self, layer, side, gpu, stream, readonly)
        if key is not None:
            self._views[key] = view
            if type(stream) is int and stream == 0 and not readonly:
                self._views[(side, layer)] = view  # k_view / v_view's first lookup (one per side and layer)
        return view


def _as_bytes(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return host_bytes(data, writable=False)
