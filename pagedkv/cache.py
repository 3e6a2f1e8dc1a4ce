"""PagedKvCache: per-layer K and V block pools, a free list and a reference count per block.

Invariants (checked by `check_invariants`):
- a block is on the free list exactly when its count is 0, and at most once;
- free blocks plus referenced blocks make `num_blocks`;
- a fresh cache hands out 0, 1, 2, ...; the last block freed is the first reused (a stack).

Bookkeeping calls (`alloc_block`, `inc_ref`, `dec_ref`, ...) touch no memory and run in
O(1). Calls that touch memory take the backend `gpu` (and a `stream` where work is
enqueued); the cache never owns the backend.
"""

from __future__ import annotations

import collections
import operator
from typing import Iterable, Mapping, Sequence

import numpy as np

from . import diagnostics, tokens
from .backend import BlockRegions, DevicePtr, GpuBackend, as_block_array, check_copy_pairs, host_bytes
from .config import KvCacheConfig
from .env import flags
from .errors import KvCacheError, KvCacheExhausted, RefCountError
from .log import get_logger
from .trace import BlockTracer
from .validate import as_int, non_negative_int, positive_int

POISON_BYTE = 0xFF
"""The byte `poison_block` writes: BF16 0xFFFF is a NaN, so a read of a stale block shows."""

_log = get_logger("cache")


class PagedKvCache:
    """A paged KV cache: for every layer a K pool and a V pool of `num_blocks` blocks."""

    def __init__(self, config: KvCacheConfig, num_blocks: int, gpu: GpuBackend):
        if not isinstance(config, KvCacheConfig):
            raise TypeError(f"config must be a KvCacheConfig, got {type(config).__name__}")
        num_blocks = positive_int(num_blocks, "num_blocks")
        self._config = config
        self._num_blocks = num_blocks
        layers = range(config.num_layers)
        self._k_stride = [config.k_block_bytes_for_layer(i) for i in layers]
        self._v_stride = [
            self._k_stride[i] if config.v_aliases_k else config.v_block_bytes_for_layer(i) for i in layers
        ]
        self._k_pools: list[DevicePtr] = []
        self._v_pools: list[DevicePtr] = []
        self._regions: BlockRegions | None = None
        try:
            self._allocate_pools(gpu)
        except BaseException:
            self._free_pools(gpu, raise_first=False)
            raise
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks
        env = flags()
        self._tracer: BlockTracer | None = BlockTracer() if env.kv_trace else None
        self._init_value = POISON_BYTE if env.kv_poison else 0
        self._released = False
        self._prefix_cache = None
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
        )

    # -- construction and release -----------------------------------------------------

    def _allocate_pools(self, gpu: GpuBackend) -> None:
        rows = []
        for layer in range(self._config.num_layers):
            k_pool = gpu.alloc(self._num_blocks * self._k_stride[layer])
            self._k_pools.append(k_pool)
            rows.append((int(k_pool), self._k_stride[layer], self._k_stride[layer]))
            if self._config.v_aliases_k:
                self._v_pools.append(k_pool)
            else:
                v_pool = gpu.alloc(self._num_blocks * self._v_stride[layer])
                self._v_pools.append(v_pool)
                rows.append((int(v_pool), self._v_stride[layer], self._v_stride[layer]))
        self._regions = gpu.create_block_regions(rows)

    def _free_pools(self, gpu: GpuBackend, raise_first: bool) -> None:
        """Free the region table and every distinct pool, attempting all; raise the first error."""
        first: BaseException | None = None
        actions = []
        if self._regions is not None:
            regions = self._regions
            actions.append(lambda: gpu.destroy_block_regions(regions))
        seen = set()
        for pool in self._k_pools + self._v_pools:
            if int(pool) not in seen:
                seen.add(int(pool))
                actions.append(lambda pool=pool: gpu.free(pool))
        self._regions = None
        self._k_pools, self._v_pools = [], []
        for action in actions:
            try:
                action()
            except Exception as err:  # noqa: BLE001 - every pool must be attempted
                first = first or err
                _log.error("kv_pool_free_failed", error=str(err))
        if first is not None and raise_first:
            raise first

    def label(self) -> str:
        """A short name for teardown messages."""
        return f"PagedKvCache({self._config.num_layers} layers x {self._num_blocks} blocks, {self._config.dtype})"

    def release(self, gpu: GpuBackend) -> None:
        """Close an attached prefix cache, free every pool (all attempted; the first error
        raised) and empty the bookkeeping. Afterwards allocation fails; a second call does
        nothing."""
        if self._released:
            return
        if self._prefix_cache is not None:
            try:
                self._prefix_cache.close()  # hands its references back and detaches
            except Exception as err:  # noqa: BLE001 - the pools must be freed regardless
                _log.error("kv_prefix_cache_close_failed", error=str(err))
        self._released = True
        self._free, self._refs, self._num_blocks = [], [], 0
        self._free_pools(gpu, raise_first=True)

    # -- validation -------------------------------------------------------------------

    def _block(self, block: object) -> int:
        """`block` as an in-range int index, or IndexError/TypeError naming it."""
        if type(block) is not int:
            block = as_int(block, "block index")
        if not 0 <= block < self._num_blocks:
            if self._released:
                raise KvCacheError(f"block {block}: the cache has been released")
            raise IndexError(f"block {block} out of range for a cache of {self._num_blocks} blocks")
        return block

    def _layer(self, layer: object) -> int:
        if self._released:
            raise KvCacheError("the cache has been released")
        return self._config._check_layer(layer)  # type: ignore[arg-type]

    def _blocks(self, blocks: Iterable[int]) -> np.ndarray:
        """`blocks` as an int64 array; IndexError names the first index outside [0, num_blocks)."""
        if not isinstance(blocks, np.ndarray):
            blocks = list(blocks)
            if bool in set(map(type, blocks)):
                raise TypeError(f"block indices must be ints, got {blocks!r}")
        arr = np.asarray(blocks)
        if arr.size and arr.ndim == 1 and np.issubdtype(arr.dtype, np.integer):
            bad = arr[(arr < 0) | (arr >= self._num_blocks)]
            if bad.size:
                self._block(int(bad[0]))  # raises IndexError (KvCacheError once released)
        return as_block_array(arr)

    # -- allocation and reference counts ---------------------------------------------

    def alloc_block(self) -> int:
        """Pop a free block and give it count 1. With an empty free list an attached prefix
        cache evicts one block first; KvCacheExhausted when none is free or evictable."""
        try:
            block = self._free.pop()
        except IndexError:
            block = self._pop_after_eviction()
        self._refs[block] = 1
        if self._tracer is not None:
            self._tracer.record(block, "alloc", 1)
        return block

    def _pop_after_eviction(self) -> int:
        if self._prefix_cache is None or not self._prefix_cache.reclaim(1):
            raise self._exhausted(1)
        return self._free.pop()

    def try_alloc_block(self) -> int | None:
        """Like `alloc_block`, but None when no block is free or evictable (or after `release`)."""
        if self._released:
            return None
        try:
            return self.alloc_block()
        except KvCacheExhausted:
            return None

    def alloc_blocks(self, n: int) -> list[int]:
        """`n` blocks, each with count 1, in the order `n` `alloc_block` calls would give.
        When the free list is short, an attached prefix cache evicts just enough first. All
        or nothing: KvCacheExhausted, nothing taken and nothing evicted when even eviction
        cannot make `n` free."""
        n = non_negative_int(n, "number of blocks")
        free = self._free
        if n > len(free) and (self._prefix_cache is None or not self._prefix_cache.reclaim(n - len(free))):
            raise self._exhausted(n)
        if n == 0:
            return []
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        refs = self._refs
        for block in taken:
            refs[block] = 1
        if self._tracer is not None:
            for block in taken:
                self._tracer.record(block, "alloc", 1)
        return taken

    def _exhausted(self, wanted: int) -> KvCacheError:
        if self._released:
            return KvCacheError("the cache has been released: no block can be allocated")
        evicting = "" if self._prefix_cache is None else " and the prefix cache cannot evict enough"
        return KvCacheExhausted(
            f"asked for {wanted} block(s) but {len(self._free)} of {self._num_blocks} are free{evicting}"
        )

    def inc_ref(self, block: int) -> None:
        """Add a reference to an allocated block; a free block raises RefCountError."""
        block = self._block(block)
        count = self._refs[block]
        if count == 0:
            raise RefCountError(f"inc_ref of free block {block}{self._history_suffix(block)}")
        self._refs[block] = count + 1
        if self._tracer is not None:
            self._tracer.record(block, "inc_ref", count + 1)

    def inc_refs(self, blocks: Sequence[int]) -> None:
        """`inc_ref` of every block of `blocks`; all are checked before any count changes."""
        blocks = list(blocks)
        if not self._all_valid(blocks):
            blocks = [self._block(b) for b in blocks]
        refs = self._refs
        for block in blocks:
            if refs[block] == 0:
                raise RefCountError(f"inc_ref of free block {block}{self._history_suffix(block)}")
        if self._tracer is not None:
            for block in blocks:
                self.inc_ref(block)
            return
        for block in blocks:
            refs[block] += 1

    def dec_ref(self, block: int) -> bool:
        """Drop a reference; True when the count reached 0 and the block went back on the
        free list. At count 0 nothing changes: an error event, False (RefCountError while
        Python assertions are on). A count falling to 1 is reported to an attached prefix
        cache (the block may have become evictable)."""
        if type(block) is not int or block < 0:
            block = self._block(block)
        refs = self._refs
        try:
            count = refs[block]
        except IndexError:
            raise self._block_error(block) from None
        if count == 1:
            refs[block] = 0
            self._free.append(block)
            if self._tracer is not None:
                self._tracer.record(block, "dec_ref", 0)
            return True
        if count == 0:
            return self._dec_at_zero(block)
        refs[block] = count - 1
        if self._tracer is not None:
            self._tracer.record(block, "dec_ref", count - 1)
        if count == 2 and self._prefix_cache is not None:
            self._prefix_cache.on_sole_reference(block)
        return False

    free_block = dec_ref  # the owner's release is one dec_ref; an alias keeps the hot path one call

    def _block_error(self, block: int) -> Exception:
        try:
            self._block(block)
        except (IndexError, KvCacheError) as err:
            return err
        return IndexError(f"block {block} out of range for a cache of {self._num_blocks} blocks")

    def _dec_at_zero(self, block: int) -> bool:
        history = self._history(block)
        _log.error("kv_dec_ref_at_zero", block=block, history=history)
        if __debug__:
            raise RefCountError(f"dec_ref of block {block} at count 0{self._history_suffix(block)}")
        return False

    def _history(self, block: int) -> list[str] | None:
        return None if self._tracer is None else [str(e) for e in self._tracer.history(block)]

    def _history_suffix(self, block: int) -> str:
        history = self._history(block)
        return f"; history: {', '.join(history)}" if history else ""

    def free_blocks(self, table: Sequence[int]) -> None:
        """Drop one reference to each block of `table`, last first, so the blocks come back
        in the order they were allocated. Every index is checked before any count changes,
        and while Python assertions are on so is every count (a block listed more often
        than it is referenced raises RefCountError with nothing changed)."""
        blocks = list(table)
        refs, done = self._refs, 0
        if self._tracer is None:
            try:  # the common case, every block at count 1, in one tight loop
                for block in reversed(blocks):
                    if type(block) is not int or block < 0 or refs[block] != 1:
                        break
                    refs[block] = 0
                    done += 1
            except IndexError:
                pass
        if done == len(blocks):
            self._free.extend(reversed(blocks))
            return
        for block in blocks[len(blocks) - done :]:
            refs[block] = 1  # undo the partial fast path; the general path below redoes it
        if not self._all_valid(blocks):
            blocks = [self._block(b) for b in blocks]  # raises naming the bad entry
        if __debug__ and (len(set(blocks)) != len(blocks) or 0 in _counts_of(refs, blocks)):
            for block, times in collections.Counter(blocks).items():
                if refs[block] < times:
                    self._dec_at_zero(block)  # logs and raises before any count changes
        for block in reversed(blocks):
            self.dec_ref(block)

    def _all_valid(self, blocks: list) -> bool:
        """True when every entry is a plain int index in range (checked at C speed)."""
        return not blocks or (
            set(map(type, blocks)) == {int} and min(blocks) >= 0 and max(blocks) < self._num_blocks
        )

    def return_evicted_block(self, block: int) -> None:
        """The prefix cache handing back its own reference: one decrement, pushed onto the
        free list only on 1 -> 0; at count 0 a warning and nothing else."""
        block = self._block(block)
        count = self._refs[block]
        if count == 0:
            _log.warning("kv_return_evicted_at_zero", block=block, history=self._history(block))
            return
        count -= 1
        self._refs[block] = count
        if self._tracer is not None:
            self._tracer.record(block, "return_evicted", count)
        if count == 0:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        """The block's reference count (0 = free)."""
        return self._refs[self._block(block)]

    def num_free_blocks(self) -> int:
        """How many blocks are on the free list."""
        return len(self._free)

    def block_history(self, block: int) -> list[str]:
        """The block's refcount events (`op->count@file:line`) when tracing is on, else []."""
        return self._history(self._block(block)) or []

    def attach_prefix_cache(self, prefix_cache) -> None:
        """Register the prefix cache that evicts for allocation (`reclaim(n) -> bool`, which
        frees exactly `n` blocks or nothing) and hears of counts falling to 1
        (`on_sole_reference(block)`). One per cache; `PrefixCache(cache)` calls this."""
        if self._prefix_cache is not None and self._prefix_cache is not prefix_cache:
            raise KvCacheError("this cache already has a prefix cache attached")
        self._prefix_cache = prefix_cache

    def detach_prefix_cache(self, prefix_cache) -> None:
        """Undo `attach_prefix_cache` (a no-op for a prefix cache that is not attached)."""
        if self._prefix_cache is prefix_cache:
            self._prefix_cache = None

    def attached_prefix_cache(self):
        """The attached prefix cache, or None."""
        return self._prefix_cache

    def check_invariants(self, held: Mapping[int, int] | None = None) -> None:
        """Raise RefCountError if the free list and counts disagree (O(num_blocks)). With
        `held` (block -> references its holders account for), every block's count must
        equal its entry (0 when absent)."""
        free = self._free
        if len(set(free)) != len(free):
            raise RefCountError(f"free list holds duplicates: {sorted(free)}")
        for block in free:
            if self._refs[block] != 0:
                raise RefCountError(f"free block {block} has count {self._refs[block]}")
        referenced = sum(1 for c in self._refs if c > 0)
        if any(c < 0 for c in self._refs):
            raise RefCountError("a block has a negative count")
        if referenced + len(free) != self._num_blocks:
            raise RefCountError(
                f"{len(free)} free + {referenced} referenced != {self._num_blocks} blocks"
            )
        if held is None:
            return
        for block in held:
            if not 0 <= block < self._num_blocks:
                raise RefCountError(f"holders account for block {block}, outside a cache of {self._num_blocks}")
        for block, count in enumerate(self._refs):
            expected = held.get(block, 0)
            if count != expected:
                raise RefCountError(
                    f"block {block} has count {count} but its holders account for {expected}"
                    f"{self._history_suffix(block)}"
                )

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
        idx = self._blocks(blocks)
        if idx.size:
            gpu.fill_blocks(self._live_regions(), idx, value, stream)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]], gpu: GpuBackend, stream: int) -> None:
        """Copy block `src` over block `dst` for every `(src, dst)` pair, in every layer's K
        and V pool, in one backend call (the copy-on-write primitive)."""
        pairs = list(pairs)
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"copy_blocks takes (src, dst) pairs, got {pair!r}")
        src = self._blocks([p[0] for p in pairs])
        dst = self._blocks([p[1] for p in pairs])
        check_copy_pairs(src, dst)
        if src.size:
            gpu.copy_blocks(self._live_regions(), src, dst, stream)

    def _live_regions(self) -> BlockRegions:
        if self._regions is None:
            raise KvCacheError("the cache has been released")
        return self._regions

    def read_block(self, layer: int, block: int, gpu: GpuBackend) -> tuple[np.ndarray, np.ndarray]:
        """(K bytes, V bytes) of `block` in `layer`, each its side's stride long (uint8)."""
        k_ptr, v_ptr = self.k_cache_ptr(layer, block), self.v_cache_ptr(layer, block)
        k = np.empty(self._k_stride[layer], dtype=np.uint8)
        gpu.copy_d2h(k_ptr, k)
        if self._config.v_aliases_k:
            return k, k.copy()
        v = np.empty(self._v_stride[layer], dtype=np.uint8)
        gpu.copy_d2h(v_ptr, v)
        return k, v

    def write_block(self, layer: int, block: int, k_data, v_data, gpu: GpuBackend) -> None:
        """Write raw bytes at the start of `block`'s K and V in `layer`; a side given None is
        left alone, and V is skipped under `v_aliases_k`. Data longer than the side's stride
        raises ValueError before anything is written."""
        k_ptr, v_ptr = self.k_cache_ptr(layer, block), self.v_cache_ptr(layer, block)
        aliased = self._config.v_aliases_k
        k_bytes = None if k_data is None else _as_bytes(k_data)
        v_bytes = None if v_data is None or aliased else _as_bytes(v_data)
        for side, data, stride in (("K", k_bytes, self._k_stride[layer]), ("V", v_bytes, self._v_stride[layer])):
            if data is not None and data.nbytes > stride:
                raise ValueError(
                    f"layer {layer} {side} data is {data.nbytes} bytes, longer than the {stride}-byte block"
                )
        if k_bytes is not None and k_bytes.nbytes:
            gpu.copy_h2d(k_bytes, k_ptr)
        if v_bytes is not None and v_bytes.nbytes:
            gpu.copy_h2d(v_bytes, v_ptr)

    def write_tokens(self, layer: int, slots, k, v, gpu: GpuBackend, stream: int,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Encode and write token rows of K and V into `layer`'s slots (`block * block_size +
        offset`, -1 skips), each side in its own format; see `pagedkv.tokens.write_tokens`."""
        tokens.write_tokens(self, layer, slots, k, v, gpu, stream, k_scale, v_scale)

    def read_tokens(self, layer: int, slots, gpu: GpuBackend, unrotate: bool = True,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) float32 rows decoded from `layer`'s slots; see `pagedkv.tokens.read_tokens`."""
        return tokens.read_tokens(self, layer, slots, gpu, unrotate, k_scale, v_scale)

    # -- diagnostics ------------------------------------------------------------------

    def debug_kv_checksum_per_layer(
        self, blocks: Sequence[int], boundary_idx: int, gpu: GpuBackend, stream: int, tag: str
    ) -> None:
        """Per BF16 layer, region (prefix/suffix of `blocks` at `boundary_idx`) and side, one
        structlog event with float64 sum, ssq and sabs computed on the backend."""
        diagnostics.checksum_per_layer(self, blocks, boundary_idx, gpu, stream, tag)

    def debug_kv_per_block(
        self, layer: int, blocks: Sequence[int], gpu: GpuBackend, stream: int, tag: str
    ) -> None:
        """One structlog event per entry of `blocks`: logical index, physical block, K and V
        sums of squares (nothing for a non-BF16 layer)."""
        diagnostics.per_block(self, layer, blocks, gpu, stream, tag)

    def block_regions(self) -> BlockRegions:
        """The backend region table: row per layer, K then V (V absent under `v_aliases_k`)."""
        return self._live_regions()

    def region_index(self, layer: int, side: str) -> int:
        """The row of `block_regions()` holding `layer`'s `side` ("K" or "V") pool."""
        layer = self._layer(layer)
        if side not in ("K", "V"):
            raise ValueError(f"side must be 'K' or 'V', got {side!r}")
        if self._config.v_aliases_k:
            return layer
        return 2 * layer + (side == "V")

    # -- geometry ---------------------------------------------------------------------

    def k_cache_ptr(self, layer: int, block: int) -> DevicePtr:
        """Device address of `block` in `layer`'s K pool."""
        layer, block = self._layer(layer), self._block(block)
        return self._k_pools[layer].offset(block * self._k_stride[layer])

    def v_cache_ptr(self, layer: int, block: int) -> DevicePtr:
        """Device address of `block` in `layer`'s V pool (the K block under `v_aliases_k`)."""
        layer, block = self._layer(layer), self._block(block)
        return self._v_pools[layer].offset(block * self._v_stride[layer])

    def k_pool_ptr(self, layer: int) -> DevicePtr:
        """Base address of `layer`'s K pool."""
        return self._k_pools[self._layer(layer)]

    def v_pool_ptr(self, layer: int) -> DevicePtr:
        """Base address of `layer`'s V pool (the K pool under `v_aliases_k`)."""
        return self._v_pools[self._layer(layer)]

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
        return self._k_stride[self._config._check_layer(layer)]

    def v_block_stride_bytes_for_layer(self, layer: int) -> int:
        """Bytes between consecutive blocks of `layer`'s V pool (the K stride under aliasing)."""
        return self._v_stride[self._config._check_layer(layer)]

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

    def num_blocks(self) -> int:
        """Blocks per pool (0 after `release`)."""
        return self._num_blocks

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

    def k_view(self, layer: int, gpu: GpuBackend, stream=0, readonly: bool = False):
        """`layer`'s K pool as a zero-copy DLPack tensor on `gpu` (work on `stream`); see `pagedkv.views`."""
        from .views import PoolView

        return PoolView(self, layer, "K", gpu, stream, readonly)

    def v_view(self, layer: int, gpu: GpuBackend, stream=0, readonly: bool = False):
        """`layer`'s V pool as a zero-copy DLPack tensor (the K view under `v_aliases_k`)."""
        from .views import PoolView

        return PoolView(self, layer, "V", gpu, stream, readonly)


def _counts_of(refs: list[int], blocks: list[int]) -> tuple[int, ...]:
    """The counts of `blocks` (valid indices), gathered at C speed."""
    return operator.itemgetter(*blocks)(refs) if len(blocks) > 1 else tuple(refs[b] for b in blocks)


def _as_bytes(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return host_bytes(data, writable=False)
