"""CUDA errors and the one `check()` that turns a driver or NVRTC status into one.

The status name and message are looked up only when a call has already failed.
"""

from __future__ import annotations

from typing import Any

from ..errors import DeviceOutOfMemory, PagedKvError
from . import _bindings

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


class CudaError(PagedKvError, RuntimeError):
    """A CUDA driver or NVRTC call failed: `call`, `status` (int, the library's own),
    `status_name` and the library's own message are kept; str() reads
    `cuMemAlloc failed: CUDA_ERROR_... (msg) detail`."""

    def __init__(self, call: str, status: int, status_name: str, message: str, detail: str = ""):
        self.call = call
        self.status = status
        self.status_name = status_name
        self.driver_message = message
        self.detail = detail
        text = f"{call} failed: {status_name} ({message})"
        super().__init__(f"{text} {detail}" if detail else text)


class CudaOutOfMemory(CudaError, DeviceOutOfMemory):
    """CUDA_ERROR_OUT_OF_MEMORY: a CudaError that is also the backend-neutral DeviceOutOfMemory."""


class CudaUnavailable(PagedKvError, RuntimeError):
    """No usable CUDA here (no driver library, no device, the driver refused to start, or
    no kernel build for the device); the message is one readable sentence."""


class UnsupportedArchitecture(CudaUnavailable):
    """This NVRTC cannot compile for the device: `arch` (e.g. 120) is not in `supported`."""

    def __init__(self, arch: int, supported: list[int]):
        self.arch = arch
        self.supported = supported
        super().__init__(
            f"sm_{arch} is not among this NVRTC's targets {supported}; install a newer nvidia-cuda-nvrtc."
        )


class BackendClosed(PagedKvError, RuntimeError):
    """A call on a CudaBackend after its `close()`."""


def _status_int(status: Any) -> int:
    return int(getattr(status, "value", status))


def _is_nvrtc(status: Any) -> bool:
    return type(status).__name__ == "nvrtcResult"


def driver_status_text(status: int) -> tuple[str, str]:
    """(name, message) of a driver status, asking the driver; falls back to the enum name."""
    driver = _bindings.driver
    name = message = None
    try:
        err, raw = driver.cuGetErrorName(status)
        if _status_int(err) == CUDA_SUCCESS and raw:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        err, raw = driver.cuGetErrorString(status)
        if _status_int(err) == CUDA_SUCCESS and raw:
            message = raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:  # noqa: BLE001 - a failing lookup must not hide the original error
        pass
    if name is None:
        try:
            name = driver.CUresult(status).name
        except ValueError:
            name = f"CUresult {status}"
    return name, message or "no message from the driver"


def nvrtc_status_text(status: int) -> tuple[str, str]:
    """(name, message) of an NVRTC status, from nvrtcGetErrorString."""
    nvrtc = _bindings.nvrtc
    try:
        name = nvrtc.nvrtcResult(status).name
    except ValueError:
        name = f"nvrtcResult {status}"
    raw = nvrtc.nvrtcGetErrorString(status)
    raw = raw[1] if isinstance(raw, tuple) else raw
    message = raw.decode() if isinstance(raw, bytes) else str(raw)
    return name, message


def check(result: Any, call: str, detail: str = "") -> Any:
    """Unpack a cuda.bindings driver or NVRTC result `(status, *values)`: raise CudaError
    (CudaOutOfMemory for a driver out-of-memory) naming `call` on failure, with the status's
    own name and message; else return the value(s) (None if none)."""
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    code = _status_int(status)
    if code != CUDA_SUCCESS:
        if _is_nvrtc(status):
            name, message = nvrtc_status_text(code)
            raise CudaError(call, code, name, message, detail)
        name, message = driver_status_text(code)
        cls = CudaOutOfMemory if code == CUDA_ERROR_OUT_OF_MEMORY else CudaError
        raise cls(call, code, name, message, detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else values
