"""Kernel arguments packed with ctypes: one argument structure and one pointer array per
kernel, built once; a launch writes the fields and passes the array's address.

The field list of each `*Args` structure mirrors the kernel's parameter list in
`pagedkv/nvrtc_src` in order and C type.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from ._bindings import driver
from .errors import check


class FillArgs(ctypes.Structure):
    """Parameters of `pagedkv_fill_blocks` (fill_blocks.cu)."""

    _fields_ = [
        ("table", ctypes.c_uint64),
        ("num_rows", ctypes.c_int32),
        ("blocks", ctypes.c_uint64),
        ("num_blocks", ctypes.c_int32),
        ("value", ctypes.c_uint32),
    ]


class CopyArgs(ctypes.Structure):
    """Parameters of `pagedkv_copy_blocks` (copy_blocks.cu)."""

    _fields_ = [
        ("table", ctypes.c_uint64),
        ("num_rows", ctypes.c_int32),
        ("src", ctypes.c_uint64),
        ("dst", ctypes.c_uint64),
        ("num_pairs", ctypes.c_int32),
    ]


class CopyBatchArgs(ctypes.Structure):
    """Parameters of `pagedkv_copy_batch` (copy_batch.cu)."""

    _fields_ = [
        ("ranges", ctypes.c_uint64),
        ("count", ctypes.c_int64),
        ("chunk", ctypes.c_int64),
    ]


class ReducePartialArgs(ctypes.Structure):
    """Parameters of `pagedkv_reduce_bf16_partial` (reduce_bf16.cu)."""

    _fields_ = [
        ("base", ctypes.c_int64),
        ("stride", ctypes.c_int64),
        ("nbytes", ctypes.c_int64),
        ("blocks", ctypes.c_uint64),
        ("num_blocks", ctypes.c_int32),
        ("partials", ctypes.c_uint64),
    ]


class ReduceFinalArgs(ctypes.Structure):
    """Parameters of `pagedkv_reduce_bf16_final` (reduce_bf16.cu)."""

    _fields_ = [
        ("partials", ctypes.c_uint64),
        ("num_partials", ctypes.c_int32),
        ("out", ctypes.c_uint64),
    ]


class KernelLauncher:
    """One kernel function with its reusable argument structure, pointer array and the
    `threads` per CTA it is always launched with.

    `launch(grid, stream, **fields)` sets the named fields and calls cuLaunchKernel;
    the driver copies the values at launch, so the structure is reused at once. A lock
    makes concurrent launches of the same kernel from several threads safe.
    """

    def __init__(self, name: str, function: Any, args_type: type[ctypes.Structure], threads: int):
        self.name = name
        self.threads = threads
        self.function = function
        self.args = args_type()
        base = ctypes.addressof(self.args)
        fields = [f[0] for f in args_type._fields_]
        self._fields = frozenset(fields)
        self.pointers = (ctypes.c_void_p * len(fields))(
            *(base + getattr(args_type, f).offset for f in fields)
        )
        self._pointers_address = ctypes.addressof(self.pointers)
        self._lock = threading.Lock()

    def launch(self, grid: int, stream: Any, shared_bytes: int = 0, **fields: int) -> None:
        """Launch `grid` CTAs of `threads` threads on `stream` with these parameter values
        (every field must be given; an unknown or missing one raises TypeError)."""
        if fields.keys() != self._fields:
            missing, extra = self._fields - fields.keys(), fields.keys() - self._fields
            raise TypeError(f"{self.name} arguments: missing {sorted(missing)}, unknown {sorted(extra)}")
        block = self.threads
        with self._lock:
            for name, value in fields.items():
                setattr(self.args, name, value)
                if getattr(self.args, name) != value:
                    raise OverflowError(f"{self.name} argument {name}={value} does not fit its C type")
            check(
                driver.cuLaunchKernel(
                    self.function, grid, 1, 1, block, 1, 1, shared_bytes, stream, self._pointers_address, 0
                ),
                "cuLaunchKernel",
                f"({self.name}, grid {grid}, block {block})",
            )


class PreparedLaunch:
    """One kernel launch with every argument fixed (a private copy of the argument structure
    and its pointer array): `launch(stream)` is one cuLaunchKernel, no field written, for
    the per-step calls an engine repeats with the same buffers (`CudaBackend.kv_prepare_*`).
    `backend` gives the stream lookup, the lock and the current context."""

    def __init__(self, backend: Any, launcher: KernelLauncher, grid: int, fields: dict):
        self._backend = backend
        self.name = launcher.name
        self.grid = grid
        self.threads = launcher.threads
        self.function = launcher.function
        args_type = type(launcher.args)
        self.args = args_type()
        for name, value in fields.items():
            setattr(self.args, name, value)
            if getattr(self.args, name) != value:
                raise OverflowError(f"{self.name} argument {name}={value} does not fit its C type")
        base = ctypes.addressof(self.args)
        self.pointers = (ctypes.c_void_p * len(args_type._fields_))(
            *(base + getattr(args_type, f[0]).offset for f in args_type._fields_)
        )
        self._address = ctypes.addressof(self.pointers)

    def launch(self, stream: Any) -> None:
        """Enqueue the launch on `stream` (an int handle of the backend or a `__cuda_stream__`)."""
        backend = self._backend
        handle = backend._stream(stream)
        with backend._lock:
            backend._enter()
            check(driver.cuLaunchKernel(self.function, self.grid, 1, 1, self.threads, 1, 1, 0, handle, self._address, 0),
                  "cuLaunchKernel", f"({self.name}, grid {self.grid}, block {self.threads})")
