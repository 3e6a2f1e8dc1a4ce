"""HybridHostTier: the host tier of a `HybridKvCache`, one `HostTier` per group.

An attention group's tier holds host blocks in that group's layout (its own block ids,
strides and formats); a state group's tier holds host slots, each row one layer's pool of
one state tensor (`StateGroup.block_regions()`), so a slot moves like a block. Ids are per
group on both sides: every call takes and returns `{group: [ids]}` maps.

A swap of several groups is still ONE `copy_batch_async`: each group's tier checks its
pairs and builds its ranges (`HostTier.checked_swap_out` / `descriptors`), then the ranges
of every group go to the backend together, and one event completes them all. Device-side
tier formats (`format=`) are per group through `HostTier` itself and not offered here.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..backends.protocol import GpuBackend
from ..cache.hybrid_cache import HybridKvCache, per_group_counts
from ..core.log import get_logger
from ..errors import KvCacheError
from .host_tier import HostTier, SwapHandle

_log = get_logger("host_tier")


class HybridHostTier:
    """Host blocks for every attention group and host slots for every state group of
    `cache`, on `gpu` (the cache's backend, stating "host_tier"). `num_blocks`: an int for
    every attention group or one entry per group (None at state groups);
    `num_state_slots` likewise for the state groups (default: the first attention group's
    count). All or nothing: a failed allocation frees what was allocated."""

    def __init__(self, cache: HybridKvCache, num_blocks, gpu: GpuBackend, num_state_slots=None):
        if not isinstance(cache, HybridKvCache):
            raise TypeError(f"cache must be a HybridKvCache (a config with layer_groups), got {type(cache).__name__}; "
                            f"use HostTier for a one-group cache")
        layout = cache.layout()
        attention, states = layout.attention_groups(), layout.state_groups()
        blocks = per_group_counts(num_blocks, layout, "host tier num_blocks", attention, None)
        slots = per_group_counts(num_state_slots, layout, "host tier num_state_slots", states, blocks[attention[0]])
        counts = {**blocks, **slots}
        self._cache, self._gpu = cache, gpu
        self._tiers: list[HostTier] = []
        try:
            for g in range(layout.num_groups()):
                self._tiers.append(HostTier(cache.group(g), counts[g], gpu))
        except BaseException:
            for tier in self._tiers:
                tier.release(gpu)
            raise
        _log.info("hybrid_host_tier_allocated", counts=[counts[g] for g in range(layout.num_groups())])

    # -- facts ----------------------------------------------------------------------------

    def cache(self) -> HybridKvCache:
        """The device cache whose groups the tier mirrors."""
        return self._cache

    def num_groups(self) -> int:
        """How many groups (the cache's)."""
        return len(self._tiers)

    def group(self, g: int) -> HostTier:
        """Group `g`'s `HostTier` (host blocks, or host slots of a state group)."""
        return self._tiers[self._cache.layout().check_group(g)]

    def num_free_blocks(self, group: int) -> int:
        """Free host blocks (slots) of group `group`."""
        return self.group(group).num_free_blocks()

    # -- free lists -----------------------------------------------------------------------

    def _groups_of(self, ids: Mapping[int, Sequence[int]], what: str) -> dict[int, list[int]]:
        if not isinstance(ids, Mapping):
            raise TypeError(f"{what} must be a mapping {{group: [ids]}}, got {type(ids).__name__} {ids!r:.60}")
        return {self._cache.layout().check_group(g): list(v) for g, v in ids.items()}

    def alloc(self, counts: Mapping[int, int]) -> dict[int, list[int]]:
        """`counts[g]` free host blocks (slots) of each group; all or nothing
        (KvCacheExhausted naming the group's tier, nothing taken)."""
        if not isinstance(counts, Mapping):
            raise TypeError(f"counts must be a mapping {{group: n}}, got {type(counts).__name__} {counts!r:.60}")
        counts = {self._cache.layout().check_group(g): n for g, n in counts.items()}
        taken: dict[int, list[int]] = {}
        try:
            for g, n in counts.items():
                taken[g] = self._tiers[g].alloc(n)
        except BaseException:
            for g, ids in taken.items():
                self._tiers[g].free(ids)
            raise
        return taken

    def free(self, host: Mapping[int, Sequence[int]], after: SwapHandle | None = None) -> None:
        """Give host blocks (slots) back, per group (see `HostTier.free`; with `after`, once
        that swap is done). Every group's list is checked before any is freed."""
        host = self._groups_of(host, "host")
        for g, ids in host.items():
            self._tiers[g].checked_free(ids)
        for g, ids in host.items():
            self._tiers[g].free(ids, after=after)

    # -- swaps ----------------------------------------------------------------------------

    def swap_out(self, device: Mapping[int, Sequence[int]], host: Mapping[int, Sequence[int]], stream: Any,
                 after: Any = None) -> SwapHandle:
        """Copy device block (slot) `device[g][i]` of every group into host block
        `host[g][i]`, in ONE `copy_batch_async` on `stream` after `after`; every group's
        checks (`HostTier.swap_out`'s) run before anything is enqueued."""
        return self._swap(device, host, stream, after, to_host=True)

    def swap_in(self, host: Mapping[int, Sequence[int]], device: Mapping[int, Sequence[int]], stream: Any,
                after: Any = None) -> SwapHandle:
        """Copy host block (slot) `host[g][i]` of every group over device block `device[g][i]`
        (held by the caller, not cached), in ONE `copy_batch_async` on `stream`."""
        return self._swap(device, host, stream, after, to_host=False)

    def _swap(self, device, host, stream, after, to_host: bool) -> SwapHandle:
        device, host = self._groups_of(device, "device"), self._groups_of(host, "host")
        if set(device) != set(host):
            raise ValueError(f"the swap names groups {sorted(device)} on the device and {sorted(host)} on the host")
        parts, moved = [], 0
        for g in sorted(device):
            tier = self._tiers[g]
            if to_host:
                d, h = tier.checked_swap_out(device[g], host[g])
            else:
                d, h = tier.checked_swap_in(host[g], device[g])
            if d:
                parts.append(tier.descriptors(d, h))
                moved += len(d)
        lead = self._tiers[0]
        if not parts:
            return SwapHandle(self._gpu, None, 0)
        device_addr, host_addr, sizes = (np.concatenate([p[i] for p in parts]) for i in range(3))
        dsts, srcs = (host_addr, device_addr) if to_host else (device_addr, host_addr)
        lead.wait_for(after, stream)
        self._gpu.copy_batch_async(dsts, srcs, sizes, stream)
        return lead.handle_after(stream, moved)

    # -- release --------------------------------------------------------------------------

    def label(self) -> str:
        """A short name for teardown messages."""
        return f"HybridHostTier({len(self._tiers)} groups)"

    def release(self, gpu: GpuBackend) -> None:
        """Release every group's tier (each attempted, the first error raised)."""
        first = None
        for tier in self._tiers:
            try:
                tier.release(gpu)
            except Exception as err:  # noqa: BLE001 - every tier attempted
                first = first or err
        if first is not None:
            raise first


def check_tier_of(tier: object, cache: HybridKvCache) -> HybridHostTier:
    """`tier` as the HybridHostTier of `cache` (TypeError/KvCacheError naming it otherwise)."""
    if not isinstance(tier, HybridHostTier):
        raise TypeError(f"tier must be a HybridHostTier, got {type(tier).__name__}")
    if tier.cache() is not cache:
        raise KvCacheError("the host tier belongs to another cache")
    return tier
