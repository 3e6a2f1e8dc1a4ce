"""Fault injection over HostBackend: a backend whose N-th call of a watched method fails,
either before taking effect ("early": nothing happened) or after it ("late": the call did
its work, then reported an error, as a driver call can), and the scenarios the sweep runs.

`FaultyHost(plan)` is a HostBackend whose watched methods count every call in `plan`; the
call numbered `plan.at` raises `InjectedFault` (late only for the methods of `LATE`: an
allocation that fails late returns nothing to free, a leak no caller can avoid).
`run_scenario(name, at, late)` runs one scenario with that fault, then, faults off, checks
the invariants, uses every block the allocator hands out (HostBackend raises on unmapped
memory, as a GPU faults), releases everything (a retry of what failed) and returns what is
still live: every count must be 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.errors import PagedKvError
from pagedkv.tiers.host_tier import HostTier


class InjectedFault(PagedKvError, RuntimeError):
    """The failure a FaultyHost injects (what a CudaError is to CudaBackend)."""


WATCHED = (
    "alloc", "free", "create_block_regions", "destroy_block_regions", "reserve_address", "map_chunk",
    "unmap_chunk", "release_address", "alloc_swap_memory", "_forget_swap", "copy_batch_async", "record_event",
    "event_done", "wait_event", "stream_wait_event", "destroy_event", "fill_blocks", "copy_blocks",
    "synchronize", "synchronize_all", "memset_async", "copy_h2d", "copy_d2h",
)
"""The backend methods a plan counts (swap memory's free is `_forget_swap`)."""

LATE = frozenset({
    "unmap_chunk", "map_chunk", "copy_batch_async", "event_done", "wait_event", "stream_wait_event",
    "fill_blocks", "copy_blocks", "synchronize", "synchronize_all", "memset_async", "copy_h2d", "copy_d2h",
})
"""Methods whose late failure a caller can survive: an unmap or map (the elastic mapping
treats the granule as unsettled and unmaps it again before any reuse), a wait, a copy. A
free, release or destroy that fails after taking effect keeps the resource recorded (the
library cannot tell it is gone) and its retry is refused by the backend as unknown: not
swept late."""


@dataclass
class FaultPlan:
    """Fail call number `at` of the watched methods (-1: none), late or early; `calls`
    names every watched call made while armed. `fail_next(method, skip)` arms a failure of
    that method's (skip + 1)-th call from now instead (once)."""

    at: int = -1
    late: bool = False
    armed: bool = True
    calls: list[str] = field(default_factory=list)
    fired: str | None = None
    method: str | None = None
    skip: int = 0

    def fail_next(self, method: str, late: bool = False, skip: int = 0) -> None:
        assert method in WATCHED, method
        self.method, self.late, self.skip, self.fired, self.armed = method, late, skip, None, True

    def hit(self, name: str) -> bool:
        if not self.armed:
            return False
        index = len(self.calls)
        self.calls.append(name)
        if self.method is not None:
            if name != self.method:
                return False
            if self.skip:
                self.skip -= 1
                return False
            self.method, self.fired = None, name
            return True
        if index == self.at and (not self.late or name in LATE):
            self.fired = name
            return True
        return False


class FaultyHost(HostBackend):
    """A HostBackend that fails where its `plan` says (see the module docstring)."""

    def __init__(self, plan: FaultPlan, **kw: Any):
        self.plan = FaultPlan(armed=False)  # construction is not counted
        super().__init__(**kw)
        self.plan = plan


def _wrap(name: str) -> Callable:
    real = getattr(HostBackend, name)

    def method(self, *args, **kwargs):
        if self.plan.hit(name):
            if not self.plan.late:
                raise InjectedFault(f"injected failure of {name} (call {self.plan.at}, before it took effect)")
            real(self, *args, **kwargs)
            raise InjectedFault(f"injected failure of {name} (call {self.plan.at}, after it took effect)")
        return real(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in WATCHED:
    setattr(FaultyHost, _name, _wrap(_name))


CONFIG = KvCacheConfig(block_size=4, num_kv_heads=1, head_dim=16, num_layers=2, dtype="bf16")  # 128-byte sides
GRANULE = 512  # 4 blocks a mapping step


def new_backend(plan: FaultPlan | None = None) -> FaultyHost:
    """A FaultyHost of 4 MiB with 512-byte granules (a plan that fails nothing by default)."""
    return FaultyHost(plan if plan is not None else FaultPlan(armed=False), capacity_bytes=1 << 22,
                      vmm_granularity=GRANULE)


def _new_backend(plan: FaultPlan) -> FaultyHost:
    return FaultyHost(plan, capacity_bytes=1 << 22, vmm_granularity=GRANULE)


@dataclass
class World:
    """What a scenario built (kept whatever it raised, for the recovery and the release)."""

    gpu: FaultyHost
    cache: PagedKvCache | None = None
    tier: HostTier | None = None
    prefix: PrefixCache | None = None
    table: SequenceTable | None = None


def _prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * CONFIG.block_size)]


def scenario_elastic(w: World) -> None:
    """Map, write, free, shrink, map again, reserve, shrink to nothing, release."""
    gpu = w.gpu
    w.cache = cache = PagedKvCache(CONFIG, 40, gpu, elastic=True)
    held = cache.alloc_blocks(18)
    cache.fill_blocks(held, 0x5A, gpu, 0)
    cache.free_blocks(held[6:])
    cache.shrink(gpu)
    more = cache.alloc_blocks(20)
    cache.copy_blocks([(held[0], more[-1])], gpu, 0)
    cache.free_blocks(more)
    cache.reserve(12, gpu)
    cache.free_blocks(held[:6])
    cache.shrink(gpu)
    cache.release(gpu)


def _tiered(w: World, elastic: bool) -> None:
    gpu = w.gpu
    w.cache = cache = PagedKvCache(CONFIG, 12, gpu, elastic=elastic)
    w.tier = tier = HostTier(cache, 10, gpu)
    w.prefix = prefix = PrefixCache(cache, host_tier=tier)
    w.table = table = SequenceTable(cache, prefix, gpu)
    table.add("a", _prompt(1, 3) + [7])
    table.add("b", _prompt(2, 2) + [7])
    table.free("a")
    table.free("b")
    held = cache.alloc_blocks(11)  # evicts the cached blocks: one demotion
    cache.free_blocks(held)
    if elastic:
        cache.shrink(gpu)
    table.add("c", _prompt(1, 3) + [8])  # promoted back: one swap_in
    table.add("d", _prompt(2, 2) + [8])
    table.free("c")
    table.free("d")
    table.release(gpu)
    prefix.close()
    tier.release(gpu)
    cache.release(gpu)


def scenario_tier(w: World) -> None:
    """Cache, host tier, prefix cache and table: demote a batch, promote it, release all."""
    _tiered(w, elastic=False)


def scenario_tier_elastic(w: World) -> None:
    """The tier scenario over elastic pools, with a shrink between demotion and promotion."""
    _tiered(w, elastic=True)


SCENARIOS: dict[str, Callable[[World], None]] = {
    "elastic": scenario_elastic,
    "tier": scenario_tier,
    "tier_elastic": scenario_tier_elastic,
}


def _use_every_block(cache: PagedKvCache, gpu: HostBackend) -> None:
    """Allocate every block the cache can give, write and read each (HostBackend raises on
    an unmapped byte), then free them."""
    blocks = cache.alloc_blocks(cache.num_free_blocks())
    if not blocks:
        return
    data = np.full(CONFIG.k_block_bytes_for_layer(0), 0x3C, np.uint8)
    for block in blocks:
        cache.write_block(0, block, data, data, gpu)
        k, _ = cache.read_block(0, block, gpu)
        assert (k == 0x3C).all(), block
    cache.free_blocks(blocks)


def recover_and_release(w: World) -> dict[str, int]:
    """Faults off: `recover`, then what is still live on the backend."""
    gpu = w.gpu
    gpu.plan.armed = False
    recover(w)
    return {
        "allocations": gpu.live_allocations(),
        "bytes": gpu.live_bytes(),
        "swap_memory": gpu.live_swap_memory(),
        "events": gpu.live_events(),
    }


def recover(w: World) -> None:
    """Check the invariants, use every block, release everything (retrying what a failure
    kept). Backend-neutral: the stub sweep runs it over CudaBackend."""
    gpu = w.gpu
    cache = w.cache
    if w.table is not None and w.prefix is not None and not w.prefix.closed():
        w.table.check_invariants()
    if cache is not None and not cache.allocator().released():
        cache.allocator().check_invariants()
        if w.table is not None:
            w.table.release(gpu)  # its sequences' blocks back, so every block can be used
        _use_every_block(cache, gpu)
        cache.allocator().check_invariants()
    if w.table is not None:
        w.table.release(gpu)
    if w.prefix is not None:
        w.prefix.close()
    if w.tier is not None:
        w.tier.release(gpu)
    if cache is not None:
        cache.release(gpu)


def count_calls(name: str) -> list[str]:
    """The watched calls scenario `name` makes when nothing fails."""
    plan = FaultPlan()
    SCENARIOS[name](World(_new_backend(plan)))
    return plan.calls


def run_scenario(name: str, at: int, late: bool) -> tuple[str | None, BaseException | None, dict[str, int]]:
    """(the method that failed, the scenario's exception or None, what is live after the
    recovery and release)."""
    plan = FaultPlan(at=at, late=late)
    world = World(_new_backend(plan))
    error = None
    try:
        SCENARIOS[name](world)
    except InjectedFault as err:
        error = err
    except PagedKvError as err:  # a clear error caused by the fault (a teardown summary, ...)
        error = err
    return plan.fired, error, recover_and_release(world)
