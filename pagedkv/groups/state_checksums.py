"""Checksum diagnostics of recurrent-state slots, as structlog events: the state
counterpart of `pagedkv.kv.diagnostics`, with the same exactness rule.

Each sum (sum, sum of squares, sum of |x|) is exact and rounded once to float64: what
`math.fsum` gives over the values (or their squares, exact in float64), on every backend
and grid. What is summed depends on the state tensor's dtype:

- bfloat16: its values, by the backend's `reduce_bf16_blocks` over the slot rows of the
  pools' region table (CudaBackend: on the device, the slot bytes never come back);
- a dtype whose every value float32 holds exactly (float16, float32, int8, uint8, int16,
  uint16): its values, read back slot by slot and summed by
  `pagedkv.core.exact_sum.float_stats`;
- any other dtype (float64, int32, int64, bool, complex,
  ...): its bytes, as uint8 values
  (`over="bytes"` in the events), so the sums stay exact whatever the dtype.

NaN and inf follow `pagedkv.core.exact_sum`'s rules (a poisoned 0xFF bfloat16 or float32
slot sums to NaN).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backends.protocol import Bf16Stats, GpuBackend
from ..core.exact_sum import float_stats
from ..core.lazy_dtypes import ml
from ..core.log import get_logger
from .state_pools import StatePools

_log = get_logger("diagnostics")

_BY_VALUE = {np.dtype(t) for t in (np.float16, np.float32, np.int8, np.uint8, np.int16, np.uint16)}


def _is_bf16(dtype: np.dtype) -> bool:
    """ml_dtypes' bfloat16 (a dtype of that name exists only once ml_dtypes is imported, so
    asking never imports it for other dtypes)."""
    return dtype.name == "bfloat16" and dtype == np.dtype(ml().bfloat16)


def summed_over(dtype: np.dtype) -> str:
    """"values" when a state tensor of `dtype` is checksummed by value, "bytes" otherwise."""
    dtype = np.dtype(dtype)
    return "values" if _is_bf16(dtype) or dtype in _BY_VALUE else "bytes"


def slot_stats(pools: StatePools, layer: int, tensor: int, slots: np.ndarray, gpu: GpuBackend,
               stream: int) -> Bf16Stats:
    """Exact checksums of state tensor `tensor` of `layer` over `slots` (checked int64
    indices; see the module docstring); the caller has synchronised `stream` for a dtype
    summed on the host."""
    shape, dtype = pools.group().state[tensor]
    if slots.size == 0:
        return Bf16Stats(0.0, 0.0, 0.0)
    if _is_bf16(np.dtype(dtype)):
        return gpu.reduce_bf16_blocks(pools.regions(), pools.region_index(layer, tensor), slots, stream)
    nbytes = pools.tensor_bytes(tensor)
    raw = np.empty((slots.size, nbytes), np.uint8)
    for i, slot in enumerate(slots.tolist()):
        gpu.copy_d2h(pools.state_ptr(layer, slot, tensor), raw[i])
    if dtype in _BY_VALUE:
        return float_stats(raw.view(dtype).astype(np.float32))
    return float_stats(raw.astype(np.float32))


def checksum_per_layer(pools: StatePools, slots: Sequence[int], gpu: GpuBackend, stream: int, tag: str,
                       group: int) -> None:
    """Synchronise `stream`, then emit `state_checksum` per layer and state tensor of the
    group: `tag, group, layer, tensor, over, nslot, sum, ssq, sabs`, the exact sums over
    `slots` (every slot checked before any event is written)."""
    idx = pools.slot_array(slots)
    pools.regions()  # KvCacheError once released
    gpu.synchronize(stream)
    for layer in pools.group().layers:
        for tensor, (_, dtype) in enumerate(pools.group().state):
            stats = slot_stats(pools, layer, tensor, idx, gpu, stream)
            _log.info("state_checksum", tag=tag, group=group, layer=layer, tensor=tensor, over=summed_over(dtype),
                      nslot=int(idx.size), sum=stats.sum, ssq=stats.ssq, sabs=stats.sabs)


def per_slot(pools: StatePools, layer: int, slots: Sequence[int], gpu: GpuBackend, stream: int, tag: str) -> None:
    """Emit `state_slot_checksum` per entry of `slots`, in order: `tag, layer, logical, slot,
    ssq` (one exact sum of squares per state tensor, in the group's order)."""
    pools.region_index(layer)  # IndexError naming a layer outside the group
    idx = pools.slot_array(slots)
    pools.regions()
    gpu.synchronize(stream)
    for logical, slot in enumerate(idx.tolist()):
        one = idx[logical : logical + 1]
        ssq = [slot_stats(pools, layer, t, one, gpu, stream).ssq for t in range(pools.num_tensors())]
        _log.info("state_slot_checksum", tag=tag, layer=layer, logical=logical, slot=int(slot), ssq=ssq)
