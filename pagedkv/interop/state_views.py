"""StateView: one state tensor's slot pool of one layer as a tensor, zero copy, for DLPack
consumers (and `__cuda_array_interface__` v3 where the dtype has a typestr) - the state
counterpart of `pagedkv.interop.views.PoolView`, made by `HybridKvCache.state_view`.

Shape `(num_slots, *shape)` in the state tensor's own dtype (float16/32/64, bfloat16, ints
and uints of 8 to 64 bits); slot `s` is index `s`, so an engine's recurrent kernel indexes
the pool with `SequenceTable.state_slots`. Slots are `StatePools.stride(tensor)` bytes apart
(the tensor's bytes rounded up to 16), elements within a slot are C-contiguous.
`bits_view()` is the same tensor with the element bits as an unsigned int of the same
width (numpy's `from_dlpack` refuses bfloat16). A dtype DLPack cannot carry here (bool,
complex, ...) raises TypeError when the view is used (shape, export), pointing at
`bits_view()`: its bytes, uint8 `(num_slots, tensor_bytes)`.

The device is the backend's (kDLCPU on HostBackend, the backend's own host memory; kDLCUDA
on CudaBackend). A view is valid while the cache is: exporting after `cache.release`
raises, and a consumer's tensor must not outlive the pools.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.protocol import DevicePtr
from ..core.streams import stream_handle
from .views import NUMPY_DTYPES, _Layout, _MemoryExport, dlpack_device_of

_NAMES: dict = {}  # np.dtype -> DLPack name, filled on first use (bfloat16 needs ml_dtypes)
_BITS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def dlpack_name(dtype: np.dtype) -> str | None:
    """The DLPack dtype name of a state tensor's dtype, or None when a view cannot carry it."""
    if not _NAMES:
        _NAMES.update({NUMPY_DTYPES[name]: name for name in NUMPY_DTYPES.names() if name != "float8_e4m3fn"})
    return _NAMES.get(np.dtype(dtype))


class StateView(_MemoryExport):
    """State tensor `tensor` of `layer` (a global layer index of the pools' group) over every
    slot of `pools` (a `pagedkv.groups.state_pools.StatePools`); `bits` for the bits view."""

    def __init__(self, pools, layer: int, tensor: int, gpu: Any, stream: Any = 0, readonly: bool = False,
                 bits: bool = False):
        if not isinstance(readonly, bool):
            raise ValueError(f"readonly must be a bool, got {readonly!r}")
        stream_handle(stream)  # validates; the object itself is kept for the backend
        pools.region_index(layer, tensor)  # IndexError naming a layer or tensor outside the group
        shape, dtype = pools.group().state[tensor]
        name = dlpack_name(dtype)
        self._dl_device = dlpack_device_of(gpu)
        self._pools, self._layer_index, self._tensor = pools, layer, tensor
        self._gpu, self._stream, self._readonly, self._bits = gpu, stream, readonly, bits
        self._state_shape, self._state_dtype, self._name = tuple(shape), np.dtype(dtype), name
        self._geometry: _Layout | None = None

    @property
    def layer(self) -> int:
        """The (global) layer this view shows."""
        return self._layer_index

    @property
    def tensor(self) -> int:
        """The index of the state tensor within the layer's state."""
        return self._tensor

    def bits_view(self) -> "StateView":
        """The same memory with the element bits as unsigned ints of the element's width
        (uint8 `(num_slots, tensor_bytes)` for a dtype without a DLPack name):
        `np.from_dlpack(view.bits_view()).view(ml_dtypes.bfloat16)` is the zero-copy array."""
        return StateView(self._pools, self._layer_index, self._tensor, self._gpu, self._stream, self._readonly,
                         bits=True)

    def _address(self) -> DevicePtr:
        return self._pools.pool_ptr(self._layer_index, self._tensor)  # raises once released

    def _device(self) -> tuple[int, int]:
        return self._dl_device

    def _extent(self) -> int:
        return self._pools.num_slots() * self._pools.stride(self._tensor)

    def _layout(self) -> _Layout:
        self._address()
        if self._geometry is None:
            self._geometry = self._compute_layout()
        return self._geometry

    def _compute_layout(self) -> _Layout:
        slots, stride = self._pools.num_slots(), self._pools.stride(self._tensor)
        if self._name is None and not self._bits:
            raise TypeError(f"state tensor {self._tensor} of layer {self._layer_index} is {self._state_dtype}, which a "
                            f"DLPack view cannot carry; take its bytes with bits_view() (uint8)")
        if self._name is None:
            return _Layout(0, "uint8", (slots, self._pools.tensor_bytes(self._tensor)), (stride, 1))
        size = self._state_dtype.itemsize
        name = _BITS[size] if self._bits else self._name
        inner = tuple(int(s) for s in np.cumprod((1,) + self._state_shape[:0:-1])[::-1] * size) if self._state_shape else ()
        return _Layout(0, name, (slots,) + self._state_shape, (stride,) + inner)

    def exported_from(self, pools: Any) -> bool:
        """True when this view is of `pools` (a state group's StatePools)."""
        return self._pools is pools

    def __repr__(self) -> str:
        return f"StateView(layer={self._layer_index}, tensor={self._tensor}, {self._what()})"
