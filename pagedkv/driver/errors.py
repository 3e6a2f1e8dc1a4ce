"""CUDA errors and the one `check()` that turns a driver or NVRTC status into one.

Imports nothing from cuda.bindings at module level: the status name and message are
looked up only when a call has already failed.
"""

from __future__ import annotations

from typing import Any

from ..errors import DeviceOutOfMemory, PagedKvError

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


class CudaError(PagedKvError, RuntimeError):
    """A CUDA driver or NVRTC call failed: `call`, `status` (int), `status_name` and the
    driver's own message are kept; str() reads `cuMemAlloc failed: CUDA_ERROR_... (msg) detail`."""

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
    """No usable CUDA here (no driver library, no device, or the driver refused to start);
    the message is one readable sentence."""


def _status_int(status: Any) -> int:
    return int(getattr(status, "value", status))


def driver_status_text(status: int) -> tuple[str, str]:
    """(name, message) of a driver status, asking the driver; falls back to the enum name."""
    from cuda.bindings import driver

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


def check(result: Any, call: str, detail: str = "") -> Any:
    """Unpack a cuda.bindings driver result `(status, *values)`: raise CudaError (or
    CudaOutOfMemory) naming `call` on failure, else return the value(s) (None if none)."""
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    code = _status_int(status)
    if code != CUDA_SUCCESS:
        name, message = driver_status_text(code)
        cls = CudaOutOfMemory if code == CUDA_ERROR_OUT_OF_MEMORY else CudaError
        raise cls(call, code, name, message, detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def check_nvrtc(result: Any, call: str, detail: str = "") -> Any:
    """Like `check` for an NVRTC result tuple; the message is nvrtcGetErrorString's."""
    from cuda.bindings import nvrtc

    status, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    code = _status_int(status)
    if code != 0:
        try:
            name = nvrtc.nvrtcResult(code).name
        except ValueError:
            name = f"nvrtcResult {code}"
        raw = nvrtc.nvrtcGetErrorString(code)
        raw = raw[1] if isinstance(raw, tuple) else raw
        message = raw.decode() if isinstance(raw, bytes) else str(raw)
        raise CudaError(call, code, name, message, detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else values
