"""Checksum diagnostics for KV corruption hunts, as structlog events: the exact sum, sum of
squares and sum of |x| of every side's stored values, decoded without unrotation (fp8 as
its E4M3 values, without the per-tensor scale), each exact and rounded once to float64:
what `math.fsum` gives over the decoded values, on every backend.

Where the sums are made: a backend with the optional method
`reduce_kv_blocks(regions, region, blocks, fmt, block_size, row_elements, stream) ->
Bf16Stats` (CudaBackend: kernels decoding and reducing every format on the device, either
block layout, so the pool bytes never come back to the host) reduces every side itself.
An NHD cache calls it with those seven arguments only (the method's original form, which
backends written before HND keep); an HND cache adds the keywords `layout="HND"` and
`heads=` (the layer's heads), so a backend serving HND caches takes them (one without
them raises TypeError there rather than summing HND blocks as NHD). On any other backend
BF16 sides are reduced by the required `reduce_bf16_blocks` and the other formats are
read back block by block (HND blocks put in NHD order first: the sums do not depend on the
order) and decoded by the host codecs (pagedkv.exact_sum.float_stats)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backends.protocol import Bf16Stats, GpuBackend
from ..codecs import decode
from ..core.dtype import KvCacheDtype, side_bytes
from ..core.exact_sum import float_stats
from ..core.log import get_logger
from ..core.validate import as_int, block_list
from .pools import KvPools

_log = get_logger("diagnostics")


def _sides(pools: KvPools) -> list[str]:
    """The sides every layer stores ("K", "V"); V is omitted when it aliases K."""
    return ["K"] if pools.config().v_aliases_k else ["K", "V"]


def side_stats(pools: KvPools, layer: int, side: str, idx: np.ndarray, gpu: GpuBackend, stream: int) -> Bf16Stats:
    """Exact checksums of `side` ("K"/"V") of `layer` over blocks `idx` (see the module
    docstring); the caller has synchronised `stream` for a format the host decodes."""
    fmt = pools.config().dtype_for_layer(layer).kv_pair()[0 if side == "K" else 1]
    heads, head_dim = pools.config().dims_for_layer(layer)
    block_size = pools.config().block_size
    reduce_kv = getattr(gpu, "reduce_kv_blocks", None)
    if reduce_kv is not None:
        placement = {} if pools.config().layout == "NHD" else {"layout": pools.config().layout, "heads": heads}
        return reduce_kv(pools.regions(), pools.region_index(layer, side), idx, fmt, block_size, heads * head_dim, stream,
                         **placement)
    if fmt is KvCacheDtype.BF16:
        return gpu.reduce_bf16_blocks(pools.regions(), pools.region_index(layer, side), idx, stream)
    nbytes = side_bytes(fmt, block_size * heads * head_dim)
    block_ptr = pools.k_block_ptr if side == "K" else pools.v_block_ptr
    geometry = pools.config().side_layout(layer, side)
    values = np.empty((idx.size, block_size, heads, head_dim), np.float32)
    raw = np.empty(nbytes, np.uint8)
    for i, block in enumerate(idx.tolist()):
        gpu.copy_d2h(block_ptr(layer, int(block)), raw)
        values[i] = decode(geometry.to_nhd(raw), fmt, block_size, heads, head_dim, unrotate=False)
    return float_stats(values)


def _block_array(pools: KvPools, blocks: Sequence[int]) -> np.ndarray:
    """`blocks` checked against the pools (live, every index in range and, for elastic
    pools, resident: a checksum kernel reading an unmapped block would fault the GPU) as an
    int64 array."""
    pools.regions()  # KvCacheError once released
    idx = np.asarray(block_list(blocks, pools.num_blocks()), dtype=np.int64)
    if idx.size:
        pools.check_resident(int(idx.max()))
    return idx


def checksum_per_layer(
    pools: KvPools,
    blocks: Sequence[int],
    boundary_idx: int,
    gpu: GpuBackend,
    stream: int,
    tag: str,
) -> None:
    """Synchronise `stream`, then emit `kv_checksum` per layer, region and side, every format.

    `prefix` is `blocks[:boundary_idx]` and `suffix` the rest (the boundary clamps to the
    list). Each event has `tag, layer, region, side, nblk, sum, ssq, sabs`, the exact sums
    (module docstring) over every stored value of those blocks.
    """
    idx_all = _block_array(pools, blocks)  # every index checked before any event is written
    cut = min(max(as_int(boundary_idx, "boundary_idx"), 0), idx_all.size)
    regions = (("prefix", idx_all[:cut]), ("suffix", idx_all[cut:]))
    gpu.synchronize(stream)
    config = pools.config()
    for layer in range(config.num_layers):
        for region, idx in regions:
            for side in _sides(pools):
                stats = side_stats(pools, layer, side, idx, gpu, stream)
                _log.info(
                    "kv_checksum", tag=tag, layer=layer, region=region, side=side,
                    nblk=int(idx.size), sum=stats.sum, ssq=stats.ssq, sabs=stats.sabs,
                )


def per_block(
    pools: KvPools, layer: int, blocks: Sequence[int], gpu: GpuBackend, stream: int, tag: str
) -> None:
    """Emit `kv_block_checksum` per entry of `blocks`, in order: `tag, layer, logical, phys,
    k_ssq, v_ssq`, the exact sums of squares of every format (module docstring; v_ssq None
    when V aliases K)."""
    pools.layer(layer)
    sides = _sides(pools)
    idx_all = _block_array(pools, blocks)  # every index checked before any event is written
    gpu.synchronize(stream)
    for logical, phys in enumerate(idx_all.tolist()):
        idx = idx_all[logical : logical + 1]
        k_ssq = side_stats(pools, layer, "K", idx, gpu, stream).ssq
        v_ssq = side_stats(pools, layer, "V", idx, gpu, stream).ssq if "V" in sides else None
        _log.info("kv_block_checksum", tag=tag, layer=layer, logical=logical, phys=int(phys),
                  k_ssq=k_ssq, v_ssq=v_ssq)


def log_nonfinite_inputs(count: int) -> None:
    """Log `count` NaN/inf inputs that device KV writes met (a warning; nothing when 0)."""
    if count:
        _log.warning("kv_nonfinite_inputs", count=int(count))
