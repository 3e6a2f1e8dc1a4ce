"""StatePools: the recurrent-state memory of one state group: for every layer of the group
and every tensor of its state, a pool of `num_slots` fixed-size slots on the backend.

Slot `s` of tensor `t` of layer `l` lies at `pool(l, t) + s * stride(l, t)`; the stride is the
tensor's bytes rounded up to 16 so every slot starts aligned. The pools form one region
table (`regions()`, a row per layer and tensor), so the backend's block fill and block copy
(`fill_blocks`, `copy_blocks`: one launch on CudaBackend) zero and copy whole slots.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backends.protocol import BlockRegions, DevicePtr, GpuBackend, as_block_array, check_copy_pairs
from ..core.layer_groups import LayerGroup
from ..core.log import get_logger
from ..core.validate import index_in_range, positive_int
from ..errors import KvCacheError

_log = get_logger("state_pools")

_ALIGN = 16


class StatePools:
    """The slot pools of state group `group` (its layers, global indices), `num_slots` each."""

    def __init__(self, group: LayerGroup, num_slots: int, gpu: GpuBackend):
        if group.is_attention():
            raise ValueError(f"StatePools takes a state group, got a {group.kind!r} group")
        self._group = group
        self._num_slots = positive_int(num_slots, "num_state_slots")
        self._gpu = gpu
        self._layers = {layer: i for i, layer in enumerate(group.layers)}
        self._bytes = [int(np.prod(shape)) * dt.itemsize for shape, dt in group.state]
        self._strides = [-(-b // _ALIGN) * _ALIGN for b in self._bytes]
        self._pools: list[list[DevicePtr]] = []
        self._owned: list[DevicePtr] = []
        self._regions: BlockRegions | None = None
        try:
            rows = []
            for _ in group.layers:
                pools = []
                for nbytes, stride in zip(self._bytes, self._strides):
                    ptr = gpu.alloc(self._num_slots * stride)
                    self._owned.append(ptr)
                    pools.append(ptr)
                    rows.append((int(ptr), stride, nbytes))
                self._pools.append(pools)
            self._regions = gpu.create_block_regions(rows)
        except BaseException:
            self._free_all(gpu)
            raise

    def num_slots(self) -> int:
        """Slots per pool."""
        return self._num_slots

    def regions(self) -> BlockRegions:
        """The region table: a row per (layer, tensor), layer-major."""
        if self._regions is None:
            raise KvCacheError("the state pools were released")
        return self._regions

    def _local(self, layer: object) -> int:
        if layer not in self._layers:
            raise IndexError(f"layer {layer!r} is not in this state group (layers {self._group.layers})")
        return self._layers[layer]  # type: ignore[index]

    def _tensor(self, tensor: object) -> int:
        return index_in_range(tensor, len(self._bytes), "state tensor", f"a state of {len(self._bytes)} tensor(s)")

    def slot(self, slot: object) -> int:
        """`slot` checked as a slot index."""
        return index_in_range(slot, self._num_slots, "state slot", f"a pool of {self._num_slots} slots")

    def state_ptr(self, layer: int, slot: int, tensor: int = 0) -> DevicePtr:
        """Device address of `slot` in `layer`'s pool of state tensor `tensor`."""
        i, t, s = self._local(layer), self._tensor(tensor), self.slot(slot)
        if not self._pools:
            raise KvCacheError("the state pools were released")
        return self._pools[i][t].offset(s * self._strides[t])

    def group(self) -> LayerGroup:
        """The state group these pools hold."""
        return self._group

    def num_tensors(self) -> int:
        """State tensors per layer."""
        return len(self._bytes)

    def region_index(self, layer: int, tensor: int = 0) -> int:
        """The row of `regions()` holding `layer`'s pool of state tensor `tensor`."""
        return self._local(layer) * len(self._bytes) + self._tensor(tensor)

    def pool_ptr(self, layer: int, tensor: int = 0) -> DevicePtr:
        """Base address of `layer`'s pool of state tensor `tensor` (slot 0)."""
        i, t = self._local(layer), self._tensor(tensor)
        if not self._pools:
            raise KvCacheError("the state pools were released")
        return self._pools[i][t]

    def slot_array(self, slots: Sequence[int], what: str = "state slots") -> np.ndarray:
        """`slots` checked (each in range, the first bad one named) as an int64 array."""
        if slots is None or isinstance(slots, (str, bytes)) or not hasattr(slots, "__iter__"):
            raise TypeError(f"{what} must be a sequence of int slot indices, got {type(slots).__name__} {slots!r:.60}")
        return np.asarray([self.slot(s) for s in slots], dtype=np.int64)

    def stride(self, tensor: int = 0) -> int:
        """Bytes between consecutive slots of state tensor `tensor`."""
        return self._strides[self._tensor(tensor)]

    def tensor_bytes(self, tensor: int = 0) -> int:
        """Bytes of one slot of state tensor `tensor`."""
        return self._bytes[self._tensor(tensor)]

    def fill(self, slots: Sequence[int], value: int, gpu: GpuBackend, stream: int) -> None:
        """Set every byte of the listed slots, in every layer and tensor, to `value` (one call)."""
        idx = as_block_array([self.slot(s) for s in slots], "state slots")
        if idx.size:
            gpu.fill_blocks(self.regions(), idx, value, stream)

    def copy(self, src: Sequence[int], dst: Sequence[int], gpu: GpuBackend, stream: int) -> None:
        """Copy slot `src[i]` over `dst[i]` in every layer and tensor, in one backend call."""
        s = as_block_array([self.slot(x) for x in src], "source slots")
        d = as_block_array([self.slot(x) for x in dst], "destination slots")
        check_copy_pairs(s, d)
        if s.size:
            gpu.copy_blocks(self.regions(), s, d, stream)

    def read(self, layer: int, slot: int, gpu: GpuBackend, tensor: int = 0) -> np.ndarray:
        """A host copy of one slot of one tensor, in its shape and dtype."""
        shape, dt = self._group.state[self._tensor(tensor)]
        out = np.empty(shape, dtype=dt)
        gpu.copy_d2h(self.state_ptr(layer, slot, tensor), out.view(np.uint8).reshape(-1))
        return out

    def write(self, layer: int, slot: int, value, gpu: GpuBackend, tensor: int = 0) -> None:
        """Write one slot of one tensor from a host array of exactly its shape (cast to its dtype)."""
        shape, dt = self._group.state[self._tensor(tensor)]
        arr = np.ascontiguousarray(np.asarray(value).astype(dt, copy=False))
        if arr.shape != shape:
            raise ValueError(f"state tensor {tensor} of layer {layer} has shape {shape}, got {arr.shape}")
        gpu.copy_h2d(arr.view(np.uint8).reshape(-1), self.state_ptr(layer, slot, tensor))

    def check_backend(self, gpu: object) -> None:
        """KvCacheError unless `gpu` is the backend the pools were allocated on."""
        if gpu is not self._gpu:
            raise KvCacheError(f"{type(gpu).__name__} {gpu!r:.60}: the state pools live on "
                               f"{type(self._gpu).__name__} {self._gpu!r:.60}")

    def is_live(self) -> bool:
        """True until `release`."""
        return self._regions is not None and bool(self._pools)

    def check_resident(self, top: int) -> None:
        """Every slot is backed (state pools are never elastic): nothing to check."""

    def release(self, gpu: GpuBackend) -> None:
        """Free the region table and every pool (every free attempted, the first error raised)."""
        if gpu is not self._gpu:
            raise KvCacheError(f"release with {type(gpu).__name__}: the state pools live on {type(self._gpu).__name__}")
        if self._owned:
            gpu.synchronize_all()
        self._pools = []
        self._free_all(gpu)

    def _free_all(self, gpu: GpuBackend) -> None:
        first = None
        if self._regions is not None:
            try:
                gpu.destroy_block_regions(self._regions)
                self._regions = None
            except Exception as err:  # noqa: BLE001 - the pools must still be attempted
                first = err
        left = []
        for ptr in self._owned:
            try:
                gpu.free(ptr)
            except Exception as err:  # noqa: BLE001 - every pool attempted
                left.append(ptr)
                first = first or err
                _log.error("state_pool_free_failed", error=str(err))
        self._owned = left
        if first is not None:
            raise first
