"""pagedkv.driver: the CUDA backend. The CUDA driver API through cuda-python's
`cuda.bindings`, with the kernels of `pagedkv/nvrtc_src/` compiled at run time by NVRTC.

Importing this package calls nothing in the driver, loads no libcuda and compiles
nothing (CUDA initialised in a parent process breaks forked children): `CudaBackend`,
`CudaError`, `CudaUnavailable`, `CudaOutOfMemory`, `BackendClosed`,
`UnsupportedArchitecture`, `PinnedBuffer`, `SwapMemory`, `CudaGraph` and
`GraphCaptureError` are imported on first use, and the first `CudaBackend()` initialises
the driver.

May import: `pagedkv.backends`, `pagedkv.codecs` (the rotation's head dims), `pagedkv.core`,
`pagedkv.errors`.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Any

__all__ = [
    "BackendClosed",
    "CudaBackend",
    "CudaError",
    "CudaGraph",
    "CudaOutOfMemory",
    "CudaUnavailable",
    "GraphCaptureError",
    "PinnedBuffer",
    "SwapMemory",
    "UnsupportedArchitecture",
    "is_available",
]

_LAZY = {
    "BackendClosed": "errors",
    "CudaBackend": "backend",
    "CudaError": "errors",
    "CudaGraph": "graphs",
    "GraphCaptureError": "graphs",
    "CudaOutOfMemory": "errors",
    "CudaUnavailable": "errors",
    "check": "errors",
    "PinnedBuffer": "pinned",
    "SwapMemory": "swap_memory",
    "UnsupportedArchitecture": "errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def _has_gpu_device_node() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg")


def _driver_library_loadable() -> bool:
    import ctypes

    try:
        handle = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError:
        return False
    del handle  # loading libcuda runs no cuInit: fork safety is kept
    return True


def _bindings_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=1)
def is_available() -> bool:
    """True when a CudaBackend can probably be made here: cuda-bindings is installed, a GPU
    device node exists and libcuda.so.1 loads. Cheap, cached, never raises, and never
    initialises CUDA in this process (CudaBackend() is the definitive test)."""
    try:
        return _has_gpu_device_node() and _bindings_importable() and _driver_library_loadable()
    except Exception:  # noqa: BLE001 - this probe must never raise
        return False
