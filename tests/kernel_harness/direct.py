"""Launch a kernel library's kernels in this process through the harness's C entry points
(no libcuda): what the harness and traffic-model tests use on probe kernels."""

from __future__ import annotations

import ctypes
from pathlib import Path

ASCENDING, DESCENDING, RANDOM = 0, 1, 2
"""CTA (and thread) orders of pkv_harness_launch."""


class Harness:
    """The probe library: `launch(name, grid, block, *args)` -> (status, message)."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.pkv_harness_kernel_name.restype = ctypes.c_char_p
        self.lib.pkv_harness_launch.argtypes = [
            ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int, ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int,
        ]
        self.index = {self.lib.pkv_harness_kernel_name(k).decode(): k for k in range(self.lib.pkv_harness_kernel_count())}

    def launch(self, name, grid, block, *args, order=ASCENDING, seed=0):
        grid = (tuple(grid) + (1, 1))[:3] if isinstance(grid, tuple) else (grid, 1, 1)
        block = (tuple(block) + (1, 1))[:3] if isinstance(block, tuple) else (block, 1, 1)
        values = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_void_p(a.ctypes.data) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        message = ctypes.create_string_buffer(512)
        status = self.lib.pkv_harness_launch(
            self.index[name], (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), params, order, seed, message, 512
        )
        return status, message.value.decode()
