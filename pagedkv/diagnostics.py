"""Checksum diagnostics for KV corruption hunts: BF16 reductions on the backend, as structlog events."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .backend import GpuBackend
from .dtype import KvCacheDtype
from .log import get_logger
from .pools import KvPools
from .validate import as_int, block_list

_log = get_logger("diagnostics")


def _bf16_sides(pools: KvPools, layer: int) -> list[str]:
    """The sides of `layer` stored as BF16 ("K", "V"); V is omitted when it aliases K."""
    k, v = pools.config().dtype_for_layer(layer).kv_pair()
    sides = ["K"] if k is KvCacheDtype.BF16 else []
    if v is KvCacheDtype.BF16 and not pools.config().v_aliases_k:
        sides.append("V")
    return sides


def _block_array(pools: KvPools, blocks: Sequence[int]) -> np.ndarray:
    """`blocks` checked against the pools (live, every index in range) as an int64 array."""
    pools.regions()  # KvCacheError once released
    return np.asarray(block_list(blocks, pools.num_blocks()), dtype=np.int64)


def checksum_per_layer(
    pools: KvPools,
    blocks: Sequence[int],
    boundary_idx: int,
    gpu: GpuBackend,
    stream: int,
    tag: str,
) -> None:
    """Synchronise `stream`, then emit `kv_checksum` per BF16 layer, region and side.

    `prefix` is `blocks[:boundary_idx]` and `suffix` the rest (the boundary clamps to the
    list). Each event has `tag, layer, region, side, nblk, sum, ssq, sabs`, the sums in
    float64 over every BF16 value of those blocks, reduced by the backend in one call.
    """
    idx_all = _block_array(pools, blocks)  # every index checked before any event is written
    cut = min(max(as_int(boundary_idx, "boundary_idx"), 0), idx_all.size)
    regions = (("prefix", idx_all[:cut]), ("suffix", idx_all[cut:]))
    gpu.synchronize(stream)
    table = pools.regions()
    config = pools.config()
    for layer in range(config.num_layers):
        sides = _bf16_sides(pools, layer)
        if layer == 0 and len(sides) < (1 if config.v_aliases_k else 2):
            _log.warning(
                "kv_checksum_non_bf16_layer0", tag=tag, dtype=str(config.dtype_for_layer(0)),
                note="only BF16 sides are checksummed",
            )
        for region, idx in regions:
            for side in sides:
                stats = gpu.reduce_bf16_blocks(table, pools.region_index(layer, side), idx, stream)
                _log.info(
                    "kv_checksum", tag=tag, layer=layer, region=region, side=side,
                    nblk=int(idx.size), sum=stats.sum, ssq=stats.ssq, sabs=stats.sabs,
                )


def per_block(
    pools: KvPools, layer: int, blocks: Sequence[int], gpu: GpuBackend, stream: int, tag: str
) -> None:
    """Emit `kv_block_checksum` per entry of `blocks`, in order: `tag, layer, logical, phys,
    k_ssq, v_ssq` (v_ssq None when V is not BF16). Nothing when K is not BF16."""
    pools.layer(layer)
    sides = _bf16_sides(pools, layer)
    idx_all = _block_array(pools, blocks)  # every index checked before any event is written
    if "K" not in sides:
        return
    gpu.synchronize(stream)
    table = pools.regions()
    k_row = pools.region_index(layer, "K")
    v_row = pools.region_index(layer, "V") if "V" in sides else None
    for logical, phys in enumerate(idx_all.tolist()):
        idx = idx_all[logical : logical + 1]
        k_ssq = gpu.reduce_bf16_blocks(table, k_row, idx, stream).ssq
        v_ssq = None if v_row is None else gpu.reduce_bf16_blocks(table, v_row, idx, stream).ssq
        _log.info("kv_block_checksum", tag=tag, layer=layer, logical=logical, phys=int(phys),
                  k_ssq=k_ssq, v_ssq=v_ssq)


def log_nonfinite_inputs(count: int) -> None:
    """Log `count` NaN/inf inputs that device KV writes met (a warning; nothing when 0)."""
    if count:
        _log.warning("kv_nonfinite_inputs", count=int(count))
