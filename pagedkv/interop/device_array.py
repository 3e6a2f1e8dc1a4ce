"""DeviceArray: an array in a backend's memory named by address, shape and dtype, and the
reading of `__dlpack__` producers into one.

The device KV path (`pagedkv.kv_device`) takes K/V rows, slot mappings and read outputs as
DeviceArrays or as any DLPack producer on the backend's device; nothing is copied.

A DeviceArray may name its owning `backend`: `from_dlpack` of a pagedkv producer (a pool or
state view, a SequenceTable export's device copy) sets it, and every call that takes a
DeviceArray with a `gpu` refuses one whose backend is another object, before anything is
enqueued. A DeviceArray built without one (`backend=None`, what a user building one from an
address gets) is taken on the caller's word, as before: only its DLPack device is checked.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..core.lazy_dtypes import DtypeTable
from .dlpack import DLManagedTensor, DLManagedTensorVersioned

DEVICE_DTYPES = DtypeTable({"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}, {"bfloat16": "bfloat16"})
"""The element types a DeviceArray may hold, by name."""

_DLPACK_DTYPES = {(2, 32): "float32", (4, 16): "bfloat16", (0, 64): "int64"}

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class DeviceArray:
    """`shape` elements of `dtype` (float32, bfloat16 or int64, by name or numpy dtype) at
    device address `ptr`; rows of axis 0 are `row_stride` elements apart (default: packed),
    every other axis is contiguous. `device` is the DLPack `(device_type, device_id)` the
    memory lives on when known (None: the caller vouches it is the backend's). Holds
    `owner` (e.g. a DLPack capsule) alive as long as itself. `backend` is the backend whose
    memory it is when known (None: unknown, the caller vouches; see the module docstring):
    calls given another backend refuse the array. ValueError/TypeError name a bad field."""

    def __init__(self, ptr: int, shape, dtype, row_stride: int | None = None,
                 device: tuple[int, int] | None = None, owner: Any = None, backend: Any = None):
        if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)) or int(ptr) <= 0:
            raise ValueError(f"ptr must be a non-null device address (int), got {ptr!r}")
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        if not shape or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
            raise ValueError(f"shape must be a non-empty tuple of non-negative ints, got {shape!r}")
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        if name not in DEVICE_DTYPES:
            raise TypeError(f"a DeviceArray holds float32, bfloat16 or int64, got dtype {dtype!r}")
        packed = int(np.prod(shape[1:], dtype=np.int64))
        if row_stride is None:
            row_stride = packed
        if isinstance(row_stride, bool) or not isinstance(row_stride, (int, np.integer)) or row_stride < packed:
            raise ValueError(f"row_stride must be an int of at least {packed} elements (one row), got {row_stride!r}")
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = DEVICE_DTYPES[name]
        self.row_stride = int(row_stride)
        self.device = device
        self.backend = backend
        """The owning backend, or None when unknown (set by pagedkv's producers)."""
        self._owner = owner

    @property
    def nbytes_spanned(self) -> int:
        """Bytes from `ptr` to the end of the last row (0 for an empty array)."""
        if self.shape[0] == 0:
            return 0
        packed = int(np.prod(self.shape[1:], dtype=np.int64))
        return ((self.shape[0] - 1) * self.row_stride + packed) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"DeviceArray(0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype.name}, row_stride={self.row_stride})"


def owning_backend(obj: Any) -> Any:
    """The backend whose memory `obj` is: a DeviceArray's `backend`, or what a pagedkv DLPack
    producer (pool and state views, SequenceTable exports) names as `pagedkv_backend`; None
    when unknown (a foreign producer, a DeviceArray built without one, a host export)."""
    if isinstance(obj, DeviceArray):
        return obj.backend
    try:
        return getattr(obj, "pagedkv_backend", None)
    except Exception:  # noqa: BLE001 - a released view's property may raise: unknown, the export will say
        return None


def check_backend(obj: Any, what: str, gpu: Any) -> None:
    """ValueError naming both backends when `obj` (a DeviceArray or DLPack producer) names
    an owning backend that is not `gpu`; nothing when it names none."""
    owner = owning_backend(obj)
    if owner is not None and owner is not gpu:
        raise ValueError(
            f"{what} is memory of {type(owner).__name__} {owner!r:.60}, not of the call's "
            f"{type(gpu).__name__} {gpu!r:.60}: a DeviceArray or view of another backend")


def from_dlpack(obj: Any, stream: int | None = None) -> DeviceArray:
    """A DeviceArray over the memory `obj.__dlpack__(stream=...)` describes (no copy); the
    capsule is kept alive with it, and the owning backend a pagedkv producer names
    (`owning_backend`) is its `backend`. TypeError for an unsupported dtype or a layout
    whose inner axes are not contiguous."""
    backend = owning_backend(obj)
    capsule = obj.__dlpack__(stream=stream) if stream is not None else obj.__dlpack__()
    name = _capsule_name(capsule)
    if name == b"dltensor":
        tensor = DLManagedTensor.from_address(_capsule_pointer(capsule, name)).dl_tensor
    elif name == b"dltensor_versioned":
        tensor = DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, name)).dl_tensor
    else:
        raise TypeError(f"{type(obj).__name__}.__dlpack__ returned a capsule named {name!r}, not a DLPack tensor")
    key = (int(tensor.dtype.code), int(tensor.dtype.bits))
    if key not in _DLPACK_DTYPES or tensor.dtype.lanes != 1:
        raise TypeError(f"{type(obj).__name__} holds DLPack dtype code {key[0]} bits {key[1]}: expected float32, bfloat16 or int64")
    shape = tuple(int(tensor.shape[i]) for i in range(tensor.ndim))
    if not shape:
        raise ValueError(f"{type(obj).__name__} is a 0-d tensor: expected at least one axis")
    row_stride = None
    if tensor.strides:
        strides = [int(tensor.strides[i]) for i in range(tensor.ndim)]
        expect = 1
        for axis in range(len(shape) - 1, 0, -1):
            if shape[axis] != 1 and strides[axis] != expect:
                raise TypeError(f"{type(obj).__name__} of shape {shape} has strides {tuple(strides)}: inner axes must be contiguous")
            expect *= shape[axis]
        if shape[0] > 1:
            row_stride = strides[0]
    ptr = int(tensor.data or 0) + int(tensor.byte_offset)
    device = (int(tensor.device.device_type), int(tensor.device.device_id))
    return DeviceArray(ptr, shape, _DLPACK_DTYPES[key], row_stride, device, owner=capsule, backend=backend)
