"""Conformance rules for a hybrid cache's state slots over the backend: slot writes,
copy_state, zero / poison / init fills, fork's slot copy and the exact state checksums, and
(with "host_tier") a sequence parked in a `HybridHostTier` and brought back. Each runs the
same steps on the backend under test and on a HostBackend and compares every byte.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..backends.host import HostBackend
from ..cache.paged_cache import PagedKvCache
from ..core.config import KvCacheConfig
from ..core.layer_groups import LayerGroup
from ..groups.state_checksums import slot_stats
from ..sequences.sequence_table import SequenceTable
from ..tiers.hybrid_host_tier import HybridHostTier
from .registry import expect, expect_bytes, rule

_STATE = (((4, 8), np.dtype(ml_dtypes.bfloat16)), ((3,), np.dtype(np.float32)))
_HYBRID = KvCacheConfig(4, 1, 16, 3, "bf16", layer_groups=(
    LayerGroup("full", (0,)),
    LayerGroup("sliding", (1,), window=8),
    LayerGroup("state", (2,), state=_STATE),
))


def _pair(gpu: Any) -> list[tuple[Any, Any]]:
    """The hybrid cache on the backend under test and on a HostBackend, as (cache, backend)."""
    host = HostBackend(capacity_bytes=1 << 26)
    pairs = [(PagedKvCache(_HYBRID, [8, 8, None], gpu, num_state_slots=8), gpu)]
    try:
        pairs.append((PagedKvCache(_HYBRID, [8, 8, None], host, num_state_slots=8), host))
    except BaseException:
        pairs[0][0].release(gpu)
        raise
    return pairs


def _expect_same_slots(pairs, slots, what: str) -> None:
    (cache, gpu), (twin, host) = pairs
    for slot in slots:
        for t in range(len(_STATE)):
            expect_bytes(cache.read_state(2, slot, gpu, tensor=t).view(np.uint8).reshape(-1),
                         twin.read_state(2, slot, host, tensor=t).view(np.uint8).reshape(-1),
                         f"{what}: state slot {slot} tensor {t}")


@rule("cache")
def rule_hybrid_state_slots(gpu: Any) -> None:
    """A hybrid cache's state slots over the backend: written slots, then copy_state of
    three pairs, zero_slots, poison_slots, init_slots and a table's fork read back byte for
    byte as on HostBackend, and the exact state checksums (bfloat16 and float32) match."""
    pairs = _pair(gpu)
    try:
        rng = np.random.default_rng(8)
        values = [[(rng.standard_normal(shape) * 2).astype(dtype) for shape, dtype in _STATE] for _ in range(6)]
        for cache, backend in pairs:
            group = cache.group(2)
            group.alloc_blocks(5)
            s = backend.default_stream()
            group.zero_slots(range(5), backend, s)
            backend.synchronize(s)
            for slot in range(3):
                for t in range(len(_STATE)):
                    cache.write_state(2, slot, values[slot][t], backend, tensor=t)
            cache.copy_state([0, 1, 0], [3, 4, 2], backend, s)
            group.poison_slots([1], backend, s)
            group.init_slots([0], backend, s)  # zero: the conformance runs without METRALE_KV_POISON
            backend.synchronize(s)
        _expect_same_slots(pairs, range(5), "copy_state, poison and init")
        for cache, backend in pairs:  # a sequence's live slot (5) copied on fork (into 6)
            table = SequenceTable(cache, None, backend)
            table.add("a", [1, 2, 3])
            (live,) = np.asarray(table.state_slots(["a"])).tolist()
            cache.write_state(2, live, values[5][1], backend, tensor=1)
            table.fork("a", "b")
            backend.synchronize(backend.default_stream())
            table.release(backend)
        _expect_same_slots(pairs, range(7), "fork")
        (cache, _), (twin, host) = pairs
        for t in range(len(_STATE)):
            slots = np.array([2, 3, 4], np.int64)
            got = slot_stats(cache.state_pools(), 2, t, slots, gpu, gpu.default_stream())
            want = slot_stats(twin.state_pools(), 2, t, slots, host, 0)
            expect(np.array_equal(np.array(got), np.array(want)),
                   f"state tensor {t} checksum {tuple(got)}, HostBackend gives {tuple(want)}")
    finally:
        for cache, backend in pairs:
            cache.release(backend)


@rule("cache", requires=("host_tier",))
def rule_hybrid_park(gpu: Any) -> None:
    """A hybrid sequence parked in a HybridHostTier (every group's blocks and its state
    slot, one batched copy) and brought back into fresh blocks reads back byte for byte as
    on HostBackend."""
    pairs = _pair(gpu)
    tiers: list[tuple[Any, Any]] = []
    try:
        got = []
        for cache, backend in pairs:
            tier = HybridHostTier(cache, 6, backend)
            tiers.append((tier, backend))
            table = SequenceTable(cache, None, backend)
            table.add("a", list(range(10)))
            rows = np.random.default_rng(3).standard_normal((10, 1, 16)).astype(np.float32)
            for layer in (0, 1):
                g = cache.group_of_layer(layer)
                held, first = table.blocks("a", g), table.first_block_position("a", g) // 4
                slots = [held[p // 4 - first] * 4 + p % 4 if p // 4 >= first else -1 for p in range(10)]
                cache.write_tokens(layer, slots, rows, rows * 2, backend, backend.default_stream())
            (live,) = np.asarray(table.state_slots(["a"])).tolist()
            cache.write_state(2, live, np.arange(3), backend, tensor=1)
            backend.synchronize(backend.default_stream())
            parked = table.swap_out("a", tier)
            table.add("b", list(range(50, 60)))  # takes the freed blocks
            table.swap_in(parked)
            backend.synchronize(backend.default_stream())
            out = []
            for g in (0, 1):
                for b in table.blocks("a", g):
                    out += [x.tobytes() for x in cache.group(g).read_block(0, b, backend)]
            (live,) = np.asarray(table.state_slots(["a"])).tolist()
            out.append(cache.read_state(2, live, backend, tensor=1).tobytes())
            got.append(out)
            table.release(backend)
        expect(len(got[0]) == len(got[1]), "parked sequence holds other block counts than on HostBackend")
        for i, (a, b) in enumerate(zip(*got)):
            expect(a == b, f"parked sequence part {i} differs from HostBackend after swap_in")
    finally:
        for tier, backend in tiers:
            tier.release(backend)
        for cache, backend in pairs:
            cache.release(backend)
