"""Shared fixtures: the backend under test, parametrised over every backend present."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from pagedkv import HostBackend, reload_flags

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

HOST_CAPACITY = 1 << 30


def _cuda_backend():
    """A CudaBackend, or pytest.skip with the reason there is none."""
    try:
        from pagedkv import driver
    except ImportError as err:  # pragma: no cover - the package always ships it
        pytest.skip(f"pagedkv.driver not importable: {err}")
    is_available = getattr(driver, "is_available", None)
    if is_available is None:
        pytest.skip("pagedkv.driver has no CudaBackend yet")
    if not is_available():
        pytest.skip("no CUDA driver or GPU on this machine")
    return driver.CudaBackend()


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.cuda)])
def gpu(request):
    """The backend under test: HostBackend always, CudaBackend where a GPU is present."""
    if request.param == "host":
        yield HostBackend(capacity_bytes=HOST_CAPACITY)
        return
    backend = _cuda_backend()
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def host():
    """A HostBackend alone, for tests about the host backend itself."""
    return HostBackend(capacity_bytes=HOST_CAPACITY)


@pytest.fixture
def env_flags(monkeypatch):
    """Set METRALE_* variables for one test: `env_flags(METRALE_KV_TRACE="1")`; restores after."""

    def set_flags(**values: str):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        return reload_flags()

    yield set_flags
    monkeypatch.undo()
    reload_flags()
