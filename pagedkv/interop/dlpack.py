"""A DLPack producer in ctypes: pagedkv memory handed to torch, numpy, CuPy, JAX... without a copy.

`DlpackProducer` implements the Python specification's `__dlpack__(*, stream=None,
max_version=None, dl_device=None, copy=None)` and `__dlpack_device__()` for anything that
can describe itself as a `TensorSpec`. A consumer passing `max_version >= (1, 0)` gets a
`dltensor_versioned` capsule (DLPack 1.x, with the read-only and is-copied flags), others
the legacy `dltensor` capsule. Strides are always filled, in elements. Dtypes use the real
codes: int and uint of 8 to 64 bits, float16/32/64 (kDLFloat), bfloat16 (kDLBfloat, code 4)
and float8_e4m3fn (code 10).

Lifetime: each capsule has one record holding the struct, its shape and strides, a
reference to the memory's owner and the capsule. The consumer's call of the deleter drops
the record; the record of a capsule that was never consumed is dropped once nothing else
holds the capsule (swept as capsules are made, and by `live_exports`). Capsules carry no
destructor: a consumer that refuses one (numpy, for bfloat16) drops it with its own
exception set, which a Python destructor would turn into a SystemError.
"""

from __future__ import annotations

import ctypes
import sys
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
    "int8": (0, 8),
    "int16": (0, 16),
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
    "uint16": (1, 16),
    "uint32": (1, 32),
    "uint64": (1, 64),
    "float16": (2, 16),
    "float32": (2, 32),
    "float64": (2, 64),
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

# Own function objects: `ctypes.pythonapi.X` is shared, and other code may reset its argtypes.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi)
)  # no destructor: see _sweep
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)  # (of a capsule object)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

_LIVE: dict[int, tuple] = {}  # managed-tensor address -> (struct, what it points into, capsule, capsule name)


def _alone_count() -> int:
    """What `sys.getrefcount` reports, in `_sweep`'s expression, for an object held only by
    its `_LIVE`-style record (measured, not assumed)."""
    probe: dict[int, tuple] = {0: (None, None, object(), b"")}
    return min(_getrefcount(record[2]) for record in probe.values())


_getrefcount = sys.getrefcount
_addressof = ctypes.addressof
_ALONE = _alone_count()
_sweep_at = 64


def _sweep() -> None:
    """Drop the records of capsules that nobody holds and no consumer took: a capsule has no
    destructor (a Python one would run with a refusing consumer's exception set, and lose
    it), so each record holds its capsule, and a record whose capsule only it holds, still
    under its own name (a consumer renames what it takes, "used_dltensor"), is dead."""
    global _sweep_at
    dead = [
        address for address, record in _LIVE.copy().items()  # a snapshot (one C call): a deleter may run meanwhile
        if _getrefcount(record[2]) <= _ALONE and _capsule_valid(record[2], record[3])
    ]
    for address in dead:
        _LIVE.pop(address, None)
    _sweep_at = max(64, 2 * len(_LIVE))


def live_exports() -> int:
    """How many exported tensors are still held by a consumer or an unconsumed capsule."""
    _sweep()
    return len(_LIVE)


def live_exports_of(test) -> int:
    """How many live exports (as `live_exports`) have an owner for which `test(owner)` is
    true (the owner a producer gave its TensorSpec)."""
    _sweep()
    return sum(1 for record in _LIVE.copy().values() if test(record[1][2]))


def _release(address: int) -> None:
    _LIVE.pop(address, None)


def _forever(thunk):
    """Keep a C callback's thunk alive for the life of the process: consumers call it by
    its raw address, possibly while the interpreter tears this module down at exit (a freed
    thunk there is a segfault)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thunk))
    return thunk


@_forever
@_Deleter
def _deleter(address, _live=_LIVE):  # the consumer is done with the tensor
    _live.pop(address, None)  # defaults, not globals: at exit the module's globals may be gone


def _new_capsule(address: int, managed, keep, name: bytes):
    """The capsule of the managed tensor at `address`, recorded in `_LIVE` (with `keep`,
    what it points into); sweeps dead records now and then (amortised O(1))."""
    if len(_LIVE) >= _sweep_at:
        _sweep()
    capsule = _capsule_new(address, name, None)
    _LIVE[address] = (managed, keep, capsule, name)
    return capsule


def _fill(managed, spec: TensorSpec, shape, strides, versioned: bool, copied: bool, minor: int) -> None:
    """Write `spec` into the managed-tensor struct `managed` (shape and strides arrays given)."""
    tensor = managed.dl_tensor
    tensor.data = spec.data
    tensor.device = DLDevice(*spec.device)
    tensor.ndim = len(spec.shape)
    code, bits = DTYPE_CODES[spec.dtype]
    tensor.dtype = DLDataType(code, bits, 1)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = spec.byte_offset
    managed.deleter = _deleter
    if versioned:
        managed.version = DLPackVersion(DLPACK_VERSION[0], minor)
        managed.flags = (FLAG_READ_ONLY if spec.readonly else 0) | (FLAG_IS_COPIED if copied else 0)


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
    _fill(managed, spec, shape, strides, versioned, copied, minor)
    return _new_capsule(ctypes.addressof(managed), managed, (shape, strides, spec.owner),
                        _VERSIONED_NAME if versioned else _LEGACY_NAME)


class CapsuleTemplate:
    """A prepared export of one `TensorSpec`: the managed-tensor struct built once (its
    shape, strides, data pointer and deleter filled), so each capsule costs one copy of
    its bytes and the capsule itself. `make()` gives a fresh capsule, owning its own copy
    of the struct, exactly as `make_capsule(spec, versioned, False, minor)` would."""

    __slots__ = ("_raw", "_buffer", "_keep", "_name", "spec")

    def __init__(self, spec: TensorSpec, versioned: bool, minor: int = DLPACK_VERSION[1]):
        if spec.dtype not in DTYPE_CODES:
            raise BufferError(f"dtype {spec.dtype!r} has no DLPack code here; known: {', '.join(DTYPE_CODES)}")
        ndim = len(spec.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*spec.shape)
        strides = (ctypes.c_int64 * max(ndim, 1))(*spec.strides)
        managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        _fill(managed, spec, shape, strides, versioned, False, minor)
        self._raw = ctypes.string_at(ctypes.addressof(managed), ctypes.sizeof(managed))
        self._buffer = ctypes.c_char * len(self._raw)
        self._keep = (shape, strides, spec.owner)  # shared by every capsule made
        self._name = _VERSIONED_NAME if versioned else _LEGACY_NAME
        self.spec = spec

    def make(self):
        """A new capsule of the prepared tensor."""
        managed = self._buffer.from_buffer_copy(self._raw)
        address = _addressof(managed)
        if len(_LIVE) >= _sweep_at:
            _sweep()
        capsule = _capsule_new(address, self._name, None)
        _LIVE[address] = (managed, self._keep, capsule, self._name)
        return capsule


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


_VERSIONS = {None: (False, 0), (1, 0): (True, 0), (1, 1): (True, 1), (1, 2): (True, 1), (2, 0): (True, 1)}
"""`_wants_versioned` of the usual `max_version` values."""


def _device_pair(dl_device: object) -> tuple[int, int]:
    try:
        kind, ordinal = dl_device  # type: ignore[misc]
        return int(kind), int(ordinal)
    except (TypeError, ValueError):
        raise ValueError(f"dl_device must be a (device_type, device_id) pair, got {dl_device!r}") from None


def prepared_export(spec: TensorSpec, versioned: bool, minor: int) -> CapsuleTemplate:
    """`CapsuleTemplate(spec, versioned, minor)`, refusing (BufferError) a read-only spec
    in a legacy capsule, which cannot say read-only."""
    if spec.readonly and not versioned:
        raise BufferError(
            "this view is read-only and a legacy DLPack capsule cannot say so: "
            "consume it with max_version=(1, 0) or newer"
        )
    return CapsuleTemplate(spec, versioned, minor)


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
        if copy is None and dl_device is None and stream is None:  # the usual zero-copy request
            try:
                versioned, minor = _VERSIONS[max_version]
            except (KeyError, TypeError):
                versioned, minor = _wants_versioned(max_version)
            if self._device()[0] != KDL_CUDA:  # a host export: no stream to order
                return self._template(versioned, minor).make()
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
        template = self._template(versioned, minor)
        if consumer is not None:
            self._consumer_waits(consumer)
        return template.make()

    def _template(self, versioned: bool, minor: int) -> CapsuleTemplate:
        """The prepared zero-copy export of `_tensor_spec()` (producers may keep it);
        BufferError for a read-only one asked for as a legacy capsule."""
        return prepared_export(self._tensor_spec(), versioned, minor)

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
