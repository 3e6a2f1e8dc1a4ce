"""cuda-bindings' driver and NVRTC modules, imported once for every driver module.

Importing them loads no CUDA library and calls nothing (cuda-bindings resolves the
libraries on first use). Without the cu13/cu12 extra both names are None and
`IMPORT_ERROR` says why; CudaBackend() then raises CudaUnavailable.
"""

from __future__ import annotations

try:
    from cuda.bindings import driver, nvrtc
except ImportError as err:  # pragma: no cover - the test extra always installs cuda-bindings
    driver = nvrtc = None
    IMPORT_ERROR: ImportError | None = err
else:
    IMPORT_ERROR = None

CU_STREAM_LEGACY = 1
"""The legacy default stream's explicit handle: the same stream whatever
CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM says (handle 0 would follow that setting)."""
