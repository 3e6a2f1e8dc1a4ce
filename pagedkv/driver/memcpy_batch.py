"""cuMemcpyBatchAsync, resolved once through cuGetProcAddress and called through ctypes.

The entry point exists from CUDA 12.8, in two ABIs: 12.8's takes a `size_t *failIdx`
before the stream, CUDA 13's (`cuMemcpyBatchAsync_v2` in cuda.h) does not. A driver of
version 13.0 or later is asked for the 13 ABI (cudaVersion 13000), a 12.8/12.9 driver for
the 12.8 one (12080), and the ctypes prototype matches the version requested (asking a
driver for a version above its own is refused). Older drivers, or a driver that reports
the symbol missing, give None: the caller uses its copy kernel instead.

Every copy of a batch gets one of the attributes built here: source access in stream
order (CU_MEMCPY_SRC_ACCESS_ORDER_STREAM) and the location hints of its source and
destination (host, or the backend's device); consecutive copies with the same kinds share
one attribute entry.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .errors import CudaError, check, driver_status_text

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
_CUDA_SUCCESS = 0
_ABI_13 = 13000
_ABI_12_8 = 12080


class MemLocation(ctypes.Structure):
    """CUmemLocation: `type` (CUmemLocationType) and `id`."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (24 bytes)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_PROTOTYPES = {
    # dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, [failIdx,] stream
    _ABI_13: ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _SIZE, _P, _P, _SIZE, _P),
    _ABI_12_8: ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _SIZE, _P, _P, _SIZE, _P, _P),
}


class MemcpyBatch:
    """The driver's cuMemcpyBatchAsync of ABI `abi` (13000 or 12080) at address `address`."""

    def __init__(self, address: int, abi: int):
        self.abi = abi
        self.address = address
        self._call = _PROTOTYPES[abi](address)

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                 src_host: np.ndarray, dst_host: np.ndarray, device: int, stream: int) -> None:
        """One cuMemcpyBatchAsync of the ranges (uint64 arrays, at least one range) on
        `stream` (a handle other than the legacy default stream's); `src_host`/`dst_host`
        say which ends are host memory. CudaError when the driver refuses (with the range
        it names, where its ABI reports one)."""
        dsts = np.ascontiguousarray(dsts, dtype=np.uint64)
        srcs = np.ascontiguousarray(srcs, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        attrs, firsts = _attributes(src_host, dst_host, device)
        count = dsts.size
        args = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count,
                ctypes.addressof(attrs), firsts.ctypes.data, len(firsts)]
        fail = ctypes.c_size_t(2**64 - 1)
        if self.abi == _ABI_12_8:
            args.append(ctypes.addressof(fail))
        status = self._call(*args, stream)
        if status != _CUDA_SUCCESS:
            name, message = driver_status_text(status)
            where = f"at range {fail.value} " if fail.value != 2**64 - 1 else ""
            raise CudaError("cuMemcpyBatchAsync", status, name, message, f"{where}of a batch of {count}")


def _attributes(src_host: np.ndarray, dst_host: np.ndarray, device: int) -> tuple[Any, np.ndarray]:
    """One attribute per run of copies whose source and destination kinds are alike, and
    the index of each run's first copy."""
    kinds = src_host.astype(np.int8) * 2 + dst_host.astype(np.int8)
    firsts = np.concatenate([[0], np.flatnonzero(kinds[1:] != kinds[:-1]) + 1]).astype(np.uint64)
    attrs = (MemcpyAttributes * len(firsts))()
    for attr, first in zip(attrs, firsts.tolist()):
        attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        for hint, host in ((attr.srcLocHint, src_host[first]), (attr.dstLocHint, dst_host[first])):
            hint.type = CU_MEM_LOCATION_TYPE_HOST if host else CU_MEM_LOCATION_TYPE_DEVICE
            hint.id = 0 if host else device
        attr.flags = 0
    return attrs, firsts


def resolve(driver: Any) -> MemcpyBatch | None:
    """The driver's cuMemcpyBatchAsync in the newest ABI it offers (13 from a 13.x driver,
    12.8 from a 12.8/12.9 one), or None when the driver is older or reports the symbol
    missing (CUDA_ERROR_NOT_FOUND, or no pointer with a symbolStatus saying why)."""
    version = int(check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
    if version >= _ABI_13:
        abi = _ABI_13
    elif version >= _ABI_12_8:
        abi = _ABI_12_8
    else:
        return None
    result = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", abi, 0)
    status = int(getattr(result[0], "value", result[0]))
    if status == 500:  # CUDA_ERROR_NOT_FOUND
        return None
    check(result[0], "cuGetProcAddress", "cuMemcpyBatchAsync")
    address, symbol_status = result[1], result[2]
    if not address or int(getattr(symbol_status, "value", symbol_status) or 0) != 0:
        return None
    return MemcpyBatch(int(address), abi)
