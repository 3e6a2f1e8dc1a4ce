"""Device facts: starting the driver and reading what a CUDA device is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _bindings
from .errors import CudaUnavailable, check, driver_status_text

_CUDA_ERROR_NO_DEVICE = 100
_ATTR_SM_COUNT = 16
_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76


def load_driver() -> Any:
    """The cuda.bindings driver module, initialised (cuInit); CudaUnavailable in one
    sentence when cuda-bindings, libcuda or a GPU is missing or the driver will not start."""
    driver = _bindings.driver
    if driver is None:
        raise CudaUnavailable(
            f"cuda-bindings is not installed ({_bindings.IMPORT_ERROR}); install pagedkv[cu13] or pagedkv[cu12]."
        )
    try:
        result = driver.cuInit(0)
    except Exception as err:  # noqa: BLE001 - pathfinder raises its own types when libcuda is absent
        raise CudaUnavailable(
            f"No NVIDIA driver on this machine: libcuda.so.1 could not be loaded ({type(err).__name__})."
        ) from None
    status = int(result[0] if isinstance(result, tuple) else result)
    if status == _CUDA_ERROR_NO_DEVICE:
        raise CudaUnavailable("The NVIDIA driver is installed but reports no GPU (CUDA_ERROR_NO_DEVICE).")
    if status != 0:
        name, message = driver_status_text(status)
        raise CudaUnavailable(f"The NVIDIA driver did not start: cuInit returned {name} ({message}).")
    return driver


@dataclass(frozen=True)
class DeviceFacts:
    """What one device is: its `name`, `compute_capability` (major, minor) and `sm_count`."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int


def _attribute(device: Any, attribute: int) -> int:
    attr = _bindings.driver.CUdevice_attribute(attribute)
    return int(check(_bindings.driver.cuDeviceGetAttribute(attr, device), "cuDeviceGetAttribute", attr.name))


def read_device_facts(device: Any) -> DeviceFacts:
    """The DeviceFacts of a `CUdevice` (the driver must be initialised)."""
    raw = check(_bindings.driver.cuDeviceGetName(256, device), "cuDeviceGetName")
    name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
    major = _attribute(device, _ATTR_CC_MAJOR)
    minor = _attribute(device, _ATTR_CC_MINOR)
    return DeviceFacts(name, (major, minor), _attribute(device, _ATTR_SM_COUNT))
