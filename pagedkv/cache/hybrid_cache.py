"""HybridKvCache: the cache of a config with `layer_groups`, one `PagedKvCache` per attention
group (its own block ids, free list and pools, its layers renumbered from 0 in the group's
order) and one `StateGroup` per state group (slot pools and a slot allocator).

`PagedKvCache(config, ...)` builds one when `config.layer_groups` is not empty. Calls that
name a layer (`write_tokens`, `read_tokens`, `k_cache_ptr`, `k_view`, ...) take the model's
global layer index and go to that layer's group. Calls that name only a block id
(`alloc_block`, `copy_blocks`, ...) are ambiguous here, since a block id is meaningful within
its group: they raise AttributeError pointing to `cache.group(g)`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backends.protocol import DevicePtr, GpuBackend
from ..core.allocator import BlockAllocator
from ..core.config import KvCacheConfig
from ..core.env import flags
from ..core.guard import ThreadGuard
from ..core.log import get_logger
from ..core.validate import positive_int
from ..errors import KvCacheError
from ..groups import state_checksums
from ..groups.layout import GroupLayout
from ..groups.state_pools import StatePools
from .guarding import GuardedCalls, PoolHolders
from .paged_cache import HYBRID_FACTORY, POISON_BYTE, PagedKvCache

_log = get_logger("cache")

_ROUTED = (
    "write_tokens", "read_tokens", "k_cache_ptr", "v_cache_ptr", "k_pool_ptr", "v_pool_ptr", "read_block",
    "write_block", "k_view", "v_view", "block_stride_bytes_for_layer", "k_block_stride_bytes_for_layer",
    "v_block_stride_bytes_for_layer", "debug_kv_per_block", "region_index",
)
"""Seed methods whose first argument is a layer: routed to that layer's group."""

_BOUND = ("alloc_block", "try_alloc_block", "alloc_blocks", "inc_ref", "inc_refs", "dec_ref", "free_block",
          "free_blocks", "return_evicted_block", "ref_count", "num_free_blocks", "num_blocks")
_GUARDED_BOUND = tuple(n for n in _BOUND if n not in ("ref_count", "num_free_blocks", "num_blocks"))
_GUARDED_METHODS = ("fill_slots", "zero_slots", "poison_slots", "init_slots", "free_slots")
"""A state group's calls that change it: guarded while a prefix cache is attached (as
PagedKvCache's are)."""


class StateGroup(GuardedCalls, PoolHolders):
    """One state group of a hybrid cache: `StatePools` and a `BlockAllocator` over its slots
    (the seed's bookkeeping names: `alloc_block` hands out a slot, `ref_count(slot)`, ...).
    `tp` is the cache's (tp_rank, tp_size): state tensors are not split by head, so every
    rank of a TP group holds whole slots (a transfer replicates them, sent by one rank)."""

    _GUARD_BOUND = _GUARDED_BOUND
    _GUARD_METHODS = _GUARDED_METHODS

    def __init__(self, index: int, layers: tuple, pools: StatePools, allocator: BlockAllocator,
                 tp: tuple[int, int] = (0, 1)):
        self.index = index
        self.layers = layers
        self.tp = (int(tp[0]), int(tp[1]))
        """(tp_rank, tp_size) of the cache this group belongs to."""
        self._pools = pools
        self._allocator = allocator
        self._holders: dict[int, str] = {}  # id(holder) -> label, as PagedKvCache keeps them
        for name in _BOUND:
            setattr(self, name, getattr(allocator, name))

    def check_releasable(self, gpu: GpuBackend) -> None:
        """The checks the hybrid cache's `release` makes of this group first (KvCacheError,
        nothing changed): `gpu` the pools' backend, no holder, no live DLPack export of a
        state view. Nothing to check once the pools are released."""
        if not self._pools.is_live():
            return
        self._pools.check_backend(gpu)
        if self._holders:
            raise KvCacheError(f"release of state group {self.index} while {', '.join(self._holders.values())} "
                               "still uses its pools: close it first (nothing was released)")
        from ..interop.views import live_exports_from

        exported = live_exports_from(self._pools)
        if exported:
            raise KvCacheError(f"release of state group {self.index} while {exported} DLPack export(s) of its "
                               "state views are alive (a consumer's tensor would write into freed memory): drop "
                               "them first; nothing was released")

    def pools(self) -> StatePools:
        """The slot pools."""
        return self._pools

    def allocator(self) -> BlockAllocator:
        """The slot allocator (free list and counts)."""
        return self._allocator

    def block_regions(self):
        """The slot pools' region table (a row per layer and tensor), as a cache's
        `block_regions()`: a `HostTier` of the group swaps slots through it."""
        return self._pools.regions()

    def state_ptr(self, layer: int, slot: int, tensor: int = 0) -> DevicePtr:
        """See `StatePools.state_ptr` (`layer` a global layer index)."""
        return self._pools.state_ptr(layer, slot, tensor)

    # -- fill: zero, poison, init (the state counterparts of the block calls) ----------

    def fill_slots(self, slots: Sequence[int], value: int, gpu: GpuBackend, stream: int) -> None:
        """Set every byte of the listed slots, in every layer and tensor, to `value` (one
        backend fill call: one launch on CudaBackend)."""
        self._pools.fill(slots, value, gpu, stream)

    def zero_slots(self, slots: Sequence[int], gpu: GpuBackend, stream: int) -> None:
        """Zero the listed slots (the recurrence's initial state), in one fill call."""
        self._pools.fill(slots, 0, gpu, stream)

    def poison_slots(self, slots: Sequence[int], gpu: GpuBackend, stream: int) -> None:
        """Fill the listed slots with POISON_BYTE (0xFF: a NaN in bfloat16, float16 and
        float32, so a read of a stale slot shows), in one fill call."""
        self._pools.fill(slots, POISON_BYTE, gpu, stream)

    def init_slots(self, slots: Sequence[int], gpu: GpuBackend, stream: int) -> None:
        """Prepare slots the engine writes before anything reads them (checkpoint slots):
        zero them, or poison them when METRALE_KV_POISON is on, like `init_blocks`."""
        self._pools.fill(slots, POISON_BYTE if flags().kv_poison else 0, gpu, stream)

    def free_slots(self, slots: Sequence[int], gpu: GpuBackend | None = None, stream: int = 0) -> list[int]:
        """Drop one reference to each listed slot (`free_blocks`); returns the slots that went
        back on the free list. Under METRALE_KV_POISON, with a backend, those are poisoned
        (one fill call on `stream`), so a kernel still reading a freed sequence's state
        reads NaN."""
        slots = list(slots)
        self._allocator.free_blocks(slots)
        freed = [s for s in dict.fromkeys(slots) if self._allocator.ref_count(s) == 0]
        if freed and gpu is not None and flags().kv_poison:
            self._pools.fill(freed, POISON_BYTE, gpu, stream)
        return freed


def per_group_counts(value, layout: GroupLayout, what: str, kinds: list[int], default) -> dict[int, int]:
    """`value` (an int for every group of `kinds`, or a sequence with one entry per group,
    None at the groups of the other kind) as {group: count}."""
    if value is None:
        return {g: default for g in kinds}
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return {g: positive_int(int(value), what) for g in kinds}
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{what} must be an int or a sequence of one entry per group, got {value!r:.60}")
    items = list(value)
    if len(items) != layout.num_groups():
        raise ValueError(f"{what} has {len(items)} entries but the config has {layout.num_groups()} groups")
    out = {}
    for g, item in enumerate(items):
        if g in kinds:
            out[g] = positive_int(item, f"{what}[{g}]")
        elif item is not None:
            raise ValueError(f"{what}[{g}] is {item!r}, but group {g} is a {layout.groups[g].kind!r} group (give None)")
    return out


class HybridKvCache(GuardedCalls):
    """A layer-grouped KV cache; see the module docstring and `PagedKvCache` for the seed API."""

    _GUARD_METHODS = ("write_state", "copy_state")

    def __init__(self, config: KvCacheConfig, num_blocks, gpu: GpuBackend, elastic: bool = False,
                 num_state_slots=None):
        if not isinstance(config, KvCacheConfig):
            raise TypeError(f"config must be a KvCacheConfig, got {type(config).__name__}")
        if elastic:
            raise ValueError("elastic=True is not supported for a cache with layer_groups")
        layout = GroupLayout(config)
        attention, states = layout.attention_groups(), layout.state_groups()
        blocks = per_group_counts(num_blocks, layout, "num_blocks", attention, None)
        default_slots = blocks[attention[0]]
        slots = per_group_counts(num_state_slots, layout, "num_state_slots", states, default_slots)
        self._config = config
        self._layout = layout
        self._gpu = gpu
        self._groups: list = []
        self._state_views: dict[tuple, object] = {}  # kept state views (state_view)
        try:
            for g, group in enumerate(layout.groups):
                if group.is_attention():
                    self._groups.append(PagedKvCache(layout.group_config(g), blocks[g], gpu))
                else:
                    pools = StatePools(group, slots[g], gpu)
                    alloc = BlockAllocator(slots[g], trace=flags().kv_trace)
                    self._groups.append(StateGroup(g, group.layers, pools, alloc, (config.tp_rank, config.tp_size)))
        except BaseException:
            self._release_groups(gpu, raise_first=False)
            raise
        _log.info("kv_hybrid_cache_allocated", groups=[g.kind for g in layout.groups],
                  blocks=[blocks.get(g) for g in range(layout.num_groups())],
                  state_slots=[slots.get(g) for g in range(layout.num_groups())])

    def __getattr__(self, name: str):
        if name in _BOUND or name in ("copy_blocks", "zero_blocks", "init_blocks", "fill_blocks", "poison_blocks",
                                      "allocator", "pools", "block_regions"):
            raise AttributeError(
                f"HybridKvCache.{name}: block ids are per group in a cache with layer_groups; "
                f"call cache.group(g).{name}(...)"
            )
        if name in _ROUTED:
            def routed(layer, *args, **kwargs):
                g, local = self._attention_layer(layer)
                return getattr(self._groups[g], name)(local, *args, **kwargs)
            routed.__name__ = name
            routed.__doc__ = f"`PagedKvCache.{name}` of the group of `layer` (a global layer index)."
            return routed
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    compute_num_blocks = staticmethod(PagedKvCache.compute_num_blocks)

    # -- groups ---------------------------------------------------------------------

    def layout(self) -> GroupLayout:
        """The group layout (configs, layer-to-group map, costs)."""
        return self._layout

    def config(self) -> KvCacheConfig:
        """The configuration the cache was built with."""
        return self._config

    def num_groups(self) -> int:
        """How many layer groups."""
        return self._layout.num_groups()

    def group_of_layer(self, layer: int) -> int:
        """The group holding global layer `layer`."""
        self._config.dtype_for_layer(layer)  # IndexError naming a layer out of range
        return int(self._layout.group_of[layer])

    def layer_group_map(self) -> np.ndarray:
        """int32 `[num_layers]`: the group of every layer (read-only)."""
        return self._layout.group_of

    def local_layer(self, layer: int) -> int:
        """`layer`'s index within its group (`group(g)` numbers its layers so)."""
        self._config.dtype_for_layer(layer)
        return int(self._layout.local_of[layer])

    def group(self, g: int):
        """Group `g`: a `PagedKvCache` (attention; its layers are the group's, numbered from
        0) or a `StateGroup`."""
        return self._groups[self._layout.check_group(g)]

    def _attention_layer(self, layer: int) -> tuple[int, int]:
        g = self.group_of_layer(layer)
        if not self._layout.groups[g].is_attention():
            raise ValueError(f"layer {layer} is in state group {g}: it has no K/V (use state_ptr)")
        return g, int(self._layout.local_of[layer])

    def _state_group(self, group: int | None) -> StateGroup:
        states = self._layout.state_groups()
        if group is None:
            if len(states) != 1:
                raise ValueError(f"the cache has {len(states)} state groups: name one with group=")
            group = states[0]
        target = self.group(group)
        if not isinstance(target, StateGroup):
            raise ValueError(f"group {group} is a {self._layout.groups[group].kind!r} group, not a state group")
        return target

    def block_size(self, group: int = 0) -> int:
        """Tokens per block of attention group `group`."""
        return self._layout.block_size(group)

    def num_free_blocks(self, group: int = 0) -> int:
        """Free blocks (attention) or free slots (state) of group `group`."""
        return self.group(group).num_free_blocks()

    def num_blocks(self, group: int = 0) -> int:
        """Blocks (attention) or slots (state) of group `group`."""
        return self.group(group).num_blocks()

    def num_layers(self) -> int:
        """Layers in the model."""
        return self._config.num_layers

    def dtype_for_layer(self, layer: int):
        """The storage format of `layer`."""
        return self._config.dtype_for_layer(layer)

    # -- state ------------------------------------------------------------------------

    def state_ptr(self, layer: int, slot: int, tensor: int = 0) -> DevicePtr:
        """Device address of `slot` of state tensor `tensor` in state layer `layer`."""
        g = self.group_of_layer(layer)
        return self._state_group(g).state_ptr(layer, slot, tensor)

    def state_pools(self, group: int | None = None) -> StatePools:
        """The slot pools of a state group (the only one when `group` is None)."""
        return self._state_group(group).pools()

    def read_state(self, layer: int, slot: int, gpu: GpuBackend, tensor: int = 0) -> np.ndarray:
        """A host copy of `slot`'s state tensor `tensor` in `layer`."""
        return self._state_group(self.group_of_layer(layer)).pools().read(layer, slot, gpu, tensor)

    def write_state(self, layer: int, slot: int, value, gpu: GpuBackend, tensor: int = 0) -> None:
        """Write `slot`'s state tensor `tensor` in `layer` from a host array of its shape. The
        slot must be held (count > 0) and not a cached checkpoint: refused otherwise."""
        group = self._state_group(self.group_of_layer(layer))
        group.pools().check_backend(gpu)
        group.allocator().check_writable([group.pools().slot(slot)])
        group.pools().write(layer, slot, value, gpu, tensor)

    def copy_state(self, src_slots: Sequence[int], dst_slots: Sequence[int], gpu: GpuBackend, stream: int,
                   group: int | None = None) -> None:
        """Copy state slot `src_slots[i]` over `dst_slots[i]` in every layer and tensor of the
        state group (one backend copy, one launch on CudaBackend). Each destination must be
        held (count > 0); a cached checkpoint may be a destination only while its writer still
        holds it. Refused naming the slot before anything is copied (and for another backend)."""
        target = self._state_group(group)
        target.pools().check_backend(gpu)
        src, dst = list(src_slots), list(dst_slots)
        if len(src) != len(dst):
            raise ValueError(f"copy_state takes as many sources as destinations, got {len(src)} and {len(dst)}")
        reclaimer = target.allocator().reclaimer()
        for slot in dst:
            index = target.pools().slot(slot)
            refs = target.ref_count(index)
            if refs == 0:
                raise KvCacheError(f"copy_state destination slot {slot} is not held")
            if refs == 1 and reclaimer is not None and reclaimer.is_cached(index):
                raise KvCacheError(f"copy_state destination slot {slot} is a cached checkpoint only the prefix "
                                   "cache holds: shared state is read-only")
        target.pools().copy(src, dst, gpu, stream)

    def state_view(self, layer: int, gpu: GpuBackend, stream=0, readonly: bool = False, tensor: int = 0):
        """State tensor `tensor` of state layer `layer`, every slot, as a zero-copy DLPack
        tensor on `gpu` (work on `stream`): shape `(num_slots, *shape)` in the tensor's dtype,
        slot `s` at index `s` (see `pagedkv.interop.state_views`). Kept like `k_view`: the
        same (layer, tensor, gpu, stream, readonly) gives the same view object."""
        group = self._state_group(self.group_of_layer(layer))
        group.pools().check_backend(gpu)
        key = None
        if type(layer) is int and type(tensor) is int and type(readonly) is bool and type(stream) not in (bool, float):
            key = (layer, tensor, id(gpu), stream, readonly)
            try:
                kept = self._state_views.get(key)
            except TypeError:  # an unhashable stream object: a fresh view each time
                kept, key = None, None
            if kept is not None and kept._gpu is gpu:
                return kept
        from ..interop.state_views import StateView

        view = StateView(group.pools(), layer, tensor, gpu, stream, readonly)
        if key is not None:
            self._state_views[key] = view
        return view

    # -- diagnostics --------------------------------------------------------------------

    def debug_state_checksum_per_layer(self, slots: Sequence[int], gpu: GpuBackend, stream: int, tag: str,
                                       group: int | None = None) -> None:
        """Per layer and state tensor of state group `group` (the only one when None), one
        structlog `state_checksum` event with the exact float64 sum, ssq and sabs over
        `slots` (the state counterpart of `debug_kv_checksum_per_layer`; see
        `pagedkv.groups.state_checksums` for what each dtype sums)."""
        target = self._state_group(group)
        state_checksums.checksum_per_layer(target.pools(), slots, gpu, stream, tag, target.index)

    def debug_state_per_slot(self, layer: int, slots: Sequence[int], gpu: GpuBackend, stream: int, tag: str) -> None:
        """One structlog `state_slot_checksum` event per entry of `slots`: logical index,
        slot and the exact sum of squares of each state tensor of `layer`."""
        target = self._state_group(self.group_of_layer(layer))
        state_checksums.per_slot(target.pools(), layer, slots, gpu, stream, tag)

    # -- lifecycle ----------------------------------------------------------------------

    def label(self) -> str:
        """A short name for teardown messages."""
        return f"HybridKvCache({self._config.num_layers} layers in {self.num_groups()} groups)"

    def _take_guard(self, guard: ThreadGuard, pending, deliver) -> None:
        """Every group's calls that change it, and this cache's `write_state` / `copy_state`,
        enter `guard` (an attached HybridPrefixCache's): ConcurrentUseError from a second thread."""
        for group in self._groups:
            group._take_guard(guard, pending, deliver)
        super()._take_guard(guard, pending, deliver)

    def _drop_guard(self) -> None:
        """Undo `_take_guard`."""
        for group in self._groups:
            group._drop_guard()
        super()._drop_guard()

    def release(self, gpu: GpuBackend) -> None:
        """Release every group's pools (each attempted, the first error raised). KvCacheError,
        nothing released, when any group refuses (`check_releasable`: another backend, a holder
        such as an open KvTransfer of a group, a live DLPack export of a pool or state view).
        A second call after a release does nothing."""
        for group in self._groups:  # every group's checks before anything is closed or freed
            group.check_releasable(gpu)
        self._release_groups(gpu, raise_first=True)

    def _release_groups(self, gpu: GpuBackend, raise_first: bool) -> None:
        first = None
        for group in self._groups:  # close an attached prefix cache once, while every group is live
            alloc = group.allocator()
            close = getattr(alloc.reclaimer(), "close", None) if not alloc.released() else None
            if close is not None:
                try:
                    close()
                except Exception as err:  # noqa: BLE001 - the pools must be freed regardless
                    first = err
                    _log.error("kv_prefix_cache_close_failed", error=str(err))
                break
        for group in self._groups:
            try:
                if isinstance(group, StateGroup):
                    group.allocator().release() if not group.allocator().released() else None
                    group.pools().release(gpu)
                else:
                    group.release(gpu)
            except Exception as err:  # noqa: BLE001 - every group attempted
                first = first or err
        if first is not None and raise_first:
            raise first

    def check_invariants(self) -> None:
        """Every group's allocator invariants."""
        for group in self._groups:
            group.check_invariants() if isinstance(group, PagedKvCache) else group.allocator().check_invariants()


HYBRID_FACTORY[0] = HybridKvCache

