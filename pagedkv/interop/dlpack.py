"""A DLPack producer in ctypes: pagedkv memory handed to torch, numpy, CuPy, JAX... without a copy.

`DlpackProducer` implements the Python specification's `__dlpack__(*, stream=None,
max_version=None, dl_device=None, copy=None)` and `__dlpack_device__()` for anything that
can describe itself as a `TensorSpec`. A consumer passing `max_version >= (1, 0)` gets a
`dltensor_versioned` capsule (DLPack 1.x, with the read-only and is-copied flags), others
the legacy `dltensor` capsule. Strides are always filled, in elements. Dtypes use the real
codes: uint8, int32, int64, bfloat16 (kDLBfloat, code 4) and float8_e4m3fn (code 10).

Lifetime: each capsule owns one heap record holding the struct, its shape and strides and
a reference to the memory's owner. The consumer's call of the deleter drops the record;
a capsule that is never consumed drops it in its own destructor.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.streams import stream_handle

KDL_CPU = 1
"""DLDeviceType of host memory."""
KDL_CUDA = 2
"""DLDeviceType of CUDA device memory."""

DLPACK_VERSION = (1, 1)
"""The newest DLPack version this producer writes (1.1 named the float8 codes)."""

FLAG_READ_ONLY = 1 << 0
"""DLManagedTensorVersioned flag: the consumer must not write the memory."""
FLAG_IS_COPIED = 1 << 1
"""DLManagedTensorVersioned flag: the memory is a copy made for this export."""

STREAM_LEGACY = 1
"""DLPack's (and CUDA's CU_STREAM_LEGACY) value for the legacy default stream."""
STREAM_NO_SYNC = -1
"""DLPack's `stream` value asking the producer not to synchronise."""

# dtype name -> (DLDataTypeCode, bits)
DTYPE_CODES = {
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
    "bfloat16": (4, 16),
    "float8_e4m3fn": (10, 8),
}


class DLDevice(ctypes.Structure):
    """DLPack's `DLDevice`."""

    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    """DLPack's `DLDataType`."""

    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    """DLPack's `DLTensor`."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    """DLPack's legacy `DLManagedTensor` (capsule name "dltensor")."""

    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class DLPackVersion(ctypes.Structure):
    """DLPack's `DLPackVersion`."""

    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """DLPack 1.x `DLManagedTensorVersioned` (capsule name "dltensor_versioned")."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


@dataclass(frozen=True)
class TensorSpec:
    """What one export describes: memory at `data + byte_offset` on `device` (a
    `(device_type, device_id)` pair), `shape` and `strides` in elements, a dtype name of
    `DTYPE_CODES`, whether it is read-only, and `owner`, kept alive until the consumer is
    done (the memory's keeper: a numpy array on the host)."""

    data: int
    byte_offset: int
    device: tuple[int, int]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    readonly: bool = False
    owner: Any = None

    @classmethod
    def of_host_array(cls, array: np.ndarray, dtype: str, readonly: bool, owner: Any = None) -> "TensorSpec":
        """The spec of a numpy array's own memory (strides converted from bytes)."""
        itemsize = array.dtype.itemsize
        if any(s % itemsize for s in array.strides):
            raise BufferError(f"strides {array.strides} are not whole {itemsize}-byte elements")
        return cls(
            data=array.__array_interface__["data"][0],
            byte_offset=0,
            device=(KDL_CPU, 0),
            shape=tuple(array.shape),
            strides=tuple(s // itemsize for s in array.strides),
            dtype=dtype,
            readonly=readonly,
            owner=array if owner is None else owner,
        )


# -- capsules --------------------------------------------------------------------------

_LEGACY_NAME = b"dltensor"
_VERSIONED_NAME = b"dltensor_versioned"
_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Own function objects: `ctypes.pythonapi.X` is shared, and other code may reset its argtypes.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _Destructor)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

_LIVE: dict[int, tuple] = {}  # managed-tensor address -> (struct, shape, strides, owner)
_IDS = itertools.count(1)


def live_exports() -> int:
    """How many exported tensors are still held by a consumer or an unconsumed capsule."""
    return len(_LIVE)


def _release(address: int) -> None:
    _LIVE.pop(address, None)


def _forever(thunk):
    """Keep a C callback's thunk alive for the life of the process: capsules and consumers
    call it by its raw address, possibly while the interpreter tears this module down at
    exit (a freed thunk there is a segfault)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thunk))
    return thunk


@_forever
@_Deleter
def _deleter(address, _live=_LIVE):  # the consumer is done with the tensor
    _live.pop(address, None)  # defaults, not globals: at exit the module's globals may be gone


@_forever
@_Destructor
def _destructor(capsule, _names=(_LEGACY_NAME, _VERSIONED_NAME), _valid=_capsule_is_valid,
                _pointer=_capsule_pointer, _live=_LIVE):  # a capsule dies; unconsumed ones still own their tensor
    try:
        for name in _names:
            if _valid(capsule, name):
                _live.pop(_pointer(capsule, name), None)
    except BaseException:  # noqa: BLE001 - a destructor has no caller to raise to
        pass


def make_capsule(spec: TensorSpec, versioned: bool, copied: bool = False, minor: int = DLPACK_VERSION[1]):
    """A PyCapsule holding a managed tensor for `spec`: "dltensor_versioned" (version
    `(1, minor)`, flags from `spec.readonly` and `copied`) or the legacy "dltensor"."""
    if spec.dtype not in DTYPE_CODES:
        raise BufferError(f"dtype {spec.dtype!r} has no DLPack code here; known: {', '.join(DTYPE_CODES)}")
    if len(spec.shape) != len(spec.strides):
        raise ValueError(f"shape {spec.shape} and strides {spec.strides} differ in length")
    ndim = len(spec.shape)
    shape = (ctypes.c_int64 * max(ndim, 1))(*spec.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*spec.strides)
    managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    tensor = managed.dl_tensor
    tensor.data = spec.data
    tensor.device = DLDevice(*spec.device)
    tensor.ndim = ndim
    code, bits = DTYPE_CODES[spec.dtype]
    tensor.dtype = DLDataType(code, bits, 1)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = spec.byte_offset
    managed.manager_ctx = next(_IDS)
    managed.deleter = _deleter
    if versioned:
        managed.version = DLPackVersion(DLPACK_VERSION[0], minor)
        managed.flags = (FLAG_READ_ONLY if spec.readonly else 0) | (FLAG_IS_COPIED if copied else 0)
    address = ctypes.addressof(managed)
    _LIVE[address] = (managed, shape, strides, spec.owner)
    try:
        return _capsule_new(address, _VERSIONED_NAME if versioned else _LEGACY_NAME, _destructor)
    except BaseException:
        _release(address)
        raise


# -- the producer protocol -----------------------------------------------------------------


def _wants_versioned(max_version: object) -> tuple[bool, int]:
    """(versioned capsule?, minor version to write) for the consumer's `max_version`."""
    if max_version is None:
        return False, 0
    try:
        major, minor = max_version  # type: ignore[misc]
        major, minor = int(major), int(minor)
    except (TypeError, ValueError):
        raise ValueError(f"max_version must be a (major, minor) pair of ints, got {max_version!r}") from None
    if major < 1:
        return False, 0
    return True, DLPACK_VERSION[1] if major > 1 else min(minor, DLPACK_VERSION[1])


def _device_pair(dl_device: object) -> tuple[int, int]:
    try:
        kind, ordinal = dl_device  # type: ignore[misc]
        return int(kind), int(ordinal)
    except (TypeError, ValueError):
        raise ValueError(f"dl_device must be a (device_type, device_id) pair, got {dl_device!r}") from None


class DlpackProducer:
    """Mixin giving `__dlpack__` and `__dlpack_device__` to anything that defines
    `_tensor_spec()` (the zero-copy export), `_host_copy()` (a fresh host numpy array of
    the same values, plus its DLPack dtype name) and `_consumer_waits(handle)` (make the
    consumer's CUDA stream `handle` wait for pagedkv's pending work)."""

    def _tensor_spec(self) -> TensorSpec:  # pragma: no cover - every producer defines it
        raise NotImplementedError

    def _host_copy(self) -> tuple[np.ndarray, str]:  # pragma: no cover
        raise NotImplementedError

    def _consumer_waits(self, handle: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def _device(self) -> tuple[int, int]:  # pragma: no cover
        raise NotImplementedError

    def __dlpack_device__(self) -> tuple[int, int]:
        """`(device_type, device_id)`: `(1, 0)` (kDLCPU) on the host, `(2, ordinal)` (kDLCUDA)."""
        return self._device()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of this memory, per the Python specification.

        `stream` (CUDA only; on the host it must be None or -1): the consumer's stream,
        an int (None and 1 the legacy default stream, 2 the per-thread one, -1 no
        synchronisation; 0 is refused as ambiguous) or an object with `__cuda_stream__`;
        it is made to wait, through an event, for the work pending on pagedkv's stream.
        `max_version >= (1, 0)` gives a versioned capsule, else the legacy one (a read-only
        view refuses the legacy form with BufferError, which cannot say read-only).
        `dl_device`: the device the consumer wants; `(1, 0)` on a CUDA view copies to the
        host (BufferError with `copy=False`); any other device raises BufferError.
        `copy=True` exports a fresh host copy (flagged is-copied), `False` never copies."""
        if copy is not None and not isinstance(copy, bool):
            raise ValueError(f"copy must be None, True or False, got {copy!r}")
        versioned, minor = _wants_versioned(max_version)
        here = self._device()
        target = here if dl_device is None else _device_pair(dl_device)
        if target != here:
            if target != (KDL_CPU, 0):
                raise BufferError(f"cannot export memory on device {here} to device {target}: only to the host (1, 0)")
            if copy is False:
                raise BufferError(f"exporting memory on device {here} to the host needs a copy, but copy=False")
            copy = True
        if copy and target != (KDL_CPU, 0):
            raise BufferError(f"copy=True of memory on device {here} is only supported to the host: pass dl_device=(1, 0)")
        consumer = self._consumer_stream(stream, here)
        if copy:
            array, dtype = self._host_copy()
            return make_capsule(TensorSpec.of_host_array(array, dtype, readonly=False), versioned, True, minor)
        spec = self._tensor_spec()
        if spec.readonly and not versioned:
            raise BufferError(
                "this view is read-only and a legacy DLPack capsule cannot say so: "
                "consume it with max_version=(1, 0) or newer"
            )
        if consumer is not None:
            self._consumer_waits(consumer)
        return make_capsule(spec, versioned, False, minor)

    @staticmethod
    def _consumer_stream(stream: object, device: tuple[int, int]) -> int | None:
        """The consumer's CUDA stream handle to synchronise, or None for no synchronisation."""
        if device[0] != KDL_CUDA:
            if stream is not None and stream != STREAM_NO_SYNC:
                raise ValueError(f"stream must be None for a host (kDLCPU) export, got {stream!r}")
            return None
        if stream is None:
            return STREAM_LEGACY
        if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
            if stream == STREAM_NO_SYNC:
                return None
            if stream == 0:
                raise ValueError("stream 0 is ambiguous in DLPack: pass 1 (legacy default), 2 (per-thread) or a handle")
        return stream_handle(stream)
