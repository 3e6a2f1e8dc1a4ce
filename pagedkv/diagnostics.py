"""Checksum diagnostics for KV corruption hunts: BF16 reductions on the backend, as structlog events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .dtype import KvCacheDtype
from .log import get_logger
from .validate import as_int

if TYPE_CHECKING:
    from .backend import GpuBackend
    from .cache import PagedKvCache

_log = get_logger("diagnostics")


def _bf16_sides(cache: "PagedKvCache", layer: int) -> list[str]:
    """The sides of `layer` stored as BF16 ("K", "V"); V is omitted when it aliases K."""
    k, v = cache.dtype_for_layer(layer).kv_pair()
    sides = ["K"] if k is KvCacheDtype.BF16 else []
    if v is KvCacheDtype.BF16 and not cache.config().v_aliases_k:
        sides.append("V")
    return sides


def checksum_per_layer(
    cache: "PagedKvCache",
    blocks: Sequence[int],
    boundary_idx: int,
    gpu: "GpuBackend",
    stream: int,
    tag: str,
) -> None:
    """Synchronise `stream`, then emit `kv_checksum` per BF16 layer, region and side.

    `prefix` is `blocks[:boundary_idx]` and `suffix` the rest (the boundary clamps to the
    list). Each event has `tag, layer, region, side, nblk, sum, ssq, sabs`, the sums in
    float64 over every BF16 value of those blocks, reduced by the backend in one call.
    """
    blocks = list(blocks)
    cache._blocks(blocks)  # every index checked before any event is written
    cut = min(max(as_int(boundary_idx, "boundary_idx"), 0), len(blocks))
    regions = (("prefix", blocks[:cut]), ("suffix", blocks[cut:]))
    gpu.synchronize(stream)
    table = cache.block_regions()
    for layer in range(cache.num_layers()):
        sides = _bf16_sides(cache, layer)
        if layer == 0 and len(sides) < (1 if cache.config().v_aliases_k else 2):
            _log.warning(
                "kv_checksum_non_bf16_layer0", tag=tag, dtype=str(cache.dtype_for_layer(0)),
                note="only BF16 sides are checksummed",
            )
        for region, region_blocks in regions:
            idx = cache._blocks(region_blocks)
            for side in sides:
                stats = gpu.reduce_bf16_blocks(table, cache.region_index(layer, side), idx, stream)
                _log.info(
                    "kv_checksum", tag=tag, layer=layer, region=region, side=side,
                    nblk=len(region_blocks), sum=stats.sum, ssq=stats.ssq, sabs=stats.sabs,
                )


def per_block(
    cache: "PagedKvCache", layer: int, blocks: Sequence[int], gpu: "GpuBackend", stream: int, tag: str
) -> None:
    """Emit `kv_block_checksum` per entry of `blocks`, in order: `tag, layer, logical, phys,
    k_ssq, v_ssq` (v_ssq None when V is not BF16). Nothing when K is not BF16."""
    sides = _bf16_sides(cache, layer)
    blocks = list(blocks)
    cache._blocks(blocks)  # every index checked before any event is written
    if "K" not in sides:
        return
    gpu.synchronize(stream)
    table = cache.block_regions()
    k_row = cache.region_index(layer, "K")
    v_row = cache.region_index(layer, "V") if "V" in sides else None
    for logical, phys in enumerate(blocks):
        idx = cache._blocks([phys])
        k_ssq = gpu.reduce_bf16_blocks(table, k_row, idx, stream).ssq
        v_ssq = None if v_row is None else gpu.reduce_bf16_blocks(table, v_row, idx, stream).ssq
        _log.info("kv_block_checksum", tag=tag, layer=layer, logical=logical, phys=int(phys),
                  k_ssq=k_ssq, v_ssq=v_ssq)
